"""
An FSDP run's checkpoint folder, ckpt.dcp, read (lab/fsdp.py writes it): run.pt (the config, step,
RNG and every file's size and sha256) and the model and optimizer shards of
torch.distributed.checkpoint. checkpoint.py reads it whole in one process; lab/fsdp.py each rank its
shards. Every file is checked against run.pt's record first, so a damaged, truncated, missing or
swapped file is a CheckpointError naming it, never weights served.
"""
import hashlib
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from configurator import CheckpointError, reason


def file_digest(path, chunk=1 << 24) -> str:
    """sha256 of a file in 16 MiB chunks (hashlib frees the GIL: files hash in parallel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def digest_files(folder, names) -> dict:
    """{name: {"bytes": size, "sha256": digest}} of the named files in folder, several at once."""
    names = list(names)
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda n: file_digest(Path(folder) / n), names))
    return {n: {"bytes": (Path(folder) / n).stat().st_size, "sha256": d}
            for n, d in zip(names, digests)}


def verify_shards(path, files, rank=0, world=1) -> list:
    """What is wrong with this rank's share (every world-th file from the rank-th) of the folder
    against run.pt's record of its files; [] when all is well."""
    mine = sorted(files)[rank::world]
    bad = [f"{n} is missing" for n in mine if not (path / n).is_file()]
    sizes = {n: (path / n).stat().st_size for n in mine if (path / n).is_file()}
    bad += [f"{n} has {size} bytes, {files[n]['bytes']} were written" for n, size in sizes.items()
            if size != files[n]["bytes"]]
    rest = [n for n, size in sizes.items() if size == files[n]["bytes"]]
    found = digest_files(path, rest) if rest else {}
    return bad + [f"{n} no longer matches its checksum" for n in rest
                  if found[n]["sha256"] != files[n]["sha256"]]


def read_shards(state, ckpt, rank=0, world=1):
    """Fill state's tensors from the folder (ckpt: checkpoint.read_checkpoint's dict of it):
    whole tensors in one process, each rank its shards under torchrun. state is laid out as
    lab/fsdp.py saves, {"model": ..., "optimizer": ...}, or is a model's state_dict alone."""
    state = state if "model" in state else {"model": state}
    path = Path(ckpt["shards"])
    if path.name.endswith(".old") and not path.exists():  # put back since by the run's lock holder
        path = path.with_name(path.name[:-4])
    if "files" in ckpt:
        bad = verify_shards(path, ckpt["files"], rank, world)
        if world > 1:  # every rank hears of every rank's findings, and all stop together
            found = [None] * world
            dist.all_gather_object(found, bad)
            bad = [b for part in found for b in part]
        if bad:
            raise CheckpointError(f"{path} is damaged: {'; '.join(bad)}; restore it or retrain")
    elif rank == 0:
        print(f"warning: {path} has no file checksums (written before them); reading it "
              f"unverified", file=sys.stderr)
    try:
        with warnings.catch_warnings():  # "loading in a single process", as intended
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(state, checkpoint_id=path)
    except (CheckpointException, OSError) as e:  # a bug of ours stays a traceback
        raise CheckpointError(f"{path}: the shards cannot be read ({reason(e)}); restore the "
                              f"folder or retrain") from e


def snapshot(find, read):
    """read(path) of the folder path = find(), which a run replaces by renames while it trains, as
    one snapshot: the folder held open before the read must still be the one at path after it
    (held, its inode is not reused). Replaced meanwhile, the read (or its failure: its files went)
    counts for nothing and is tried once more; a second replacement says so."""
    for attempt in range(2):
        path = find()
        if not path.is_dir():
            return read(path)
        try:
            held = os.open(path, os.O_RDONLY)
        except OSError:  # nothing there (read says so), or gone between a look and the open
            if attempt:
                return read(path)
            continue
        try:
            try:
                result = read(path)
            except (CheckpointError, OSError):
                if _unchanged(held, path):
                    raise
                continue
            if _unchanged(held, path):
                return result
        finally:
            os.close(held)
    raise CheckpointError(f"{path} was replaced while being read (a run is writing it); try again")


def _unchanged(held, path) -> bool:
    try:
        now, was = os.stat(path), os.fstat(held)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino)
