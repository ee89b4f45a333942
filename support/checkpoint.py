"""
Saving and loading trained models: train.py's atomic checkpoints (ckpt.pt, and an FSDP run's sharded
ckpt.dcp), and `load_model(init_from)`, the one way every script that reads a trained model
(sample.py, eval.py, export.py, train.py --init_from) turns a path into a model and its tokenizer.
What the user can fix is a UserError (CheckpointError here and in hf.py, DataError from
tokenizer.py); anything else is a bug.

    init_from = "out/shakespeare"             a train.py out_dir (reads its ckpt.pt or ckpt.dcp)
              = "out/shakespeare/ckpt.pt"     a checkpoint file
              = "out/shakespeare_hf"          a Hugging Face folder: config.json + *.safetensors (hf.py)
              = "zeng123/Depth-attention-3B"  a Hugging Face hub id, downloaded by huggingface_hub
"""

import hashlib
import os
import random
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import torch.distributed as dist

from support.variants import build_model, make_config
from model import GPT
from model import ConfigError as ModelConfigError
from support import hf
from support.cli import SHARDED, reason
from support.errors import CheckpointError
from support.tokenizer import folder_tokenizer, from_record, looks_like_hub_id, snapshot

try:
    import fcntl  # the out_dir lock; absent on Windows, where runs go unlocked
except ImportError:
    fcntl = None


TOKENIZER_KEYS = ("tokenizer", "tokenizer_json", "eot_token")  # tokenizer.tokenizer_record's keys
OLD = SHARDED + ".old"  # the previous ckpt.dcp between save_sharded's two renames
# An FSDP run's checkpoint (save_sharded) is the folder SHARDED: a torch.distributed.checkpoint folder of
# the model and optimizer shards, plus run.pt, the rest of a checkpoint. train.py --parallel=ddp (and one
# process) writes ckpt.pt.


def _digest(value, h):
    """Feed value into hash h: tensors as dtype, shape and bytes (one pass, a tensor at a time),
    containers in their order, everything else as its repr. torch.load gives back equal values, so
    an equal digest."""
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {tuple(value.shape)};".encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(b"{")
        for k, v in value.items():
            _digest(k, h)
            _digest(v, h)
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"(" if isinstance(value, tuple) else b"[")
        for v in value:
            _digest(v, h)
        h.update(b")")
    else:
        h.update(f"{type(value).__name__} {value!r};".encode())
    return h


def checksums(obj: dict) -> dict:
    """{entry: sha256 of its contents} for every top-level entry of a checkpoint: a flipped byte in
    any tensor or value changes its entry's digest, and a reader can verify just the entries it
    uses."""
    return {
        key: _digest(value, hashlib.sha256()).hexdigest()
        for key, value in obj.items()
        if key != "checksums"
    }


def save_checkpoint(obj, path):
    """Write obj with its checksums to a temporary file in the same folder, sync it, then rename: a
    kill at any moment leaves either the previous checkpoint or the new one, never a torn file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({**obj, "checksums": checksums(obj)}, f)
            f.flush()
            os.fsync(f.fileno())
    # a full disk, an interrupt: the previous checkpoint stays, the partial file goes
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder):
    """Make a rename inside folder durable."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state():
    """Every generator a run draws from (Python, numpy, torch, CUDA), as plain tensors and
    values."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state):
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def claim_out_dir(out_dir, resuming, overwrite):
    """Create out_dir and lock it for the life of this process (flock: the kernel releases it when
    the process dies, so a killed run never blocks the next one). A second run into the folder is
    refused rather than mixed with this one, and a fresh start over a checkpoint needs overwrite.
    Returns the open lock file."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = open(out_dir / "train.lock", "a+")
    except OSError as e:
        raise CheckpointError(
            f"cannot write to --out_dir={out_dir} ({e.strerror}); pick a writable folder"
        ) from e
    if fcntl:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise CheckpointError(
                f"another train.py ({lock.read().strip() or 'pid unknown'}) is writing to "
                f"{out_dir}; wait for it to finish or pick another --out_dir"
            ) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    # a write cut short by a kill; no other writer holds the lock
    for torn in out_dir.glob("ckpt.pt.tmp*"):
        torn.unlink()
    shutil.rmtree(out_dir / f"{SHARDED}.tmp", ignore_errors=True)
    recover_sharded(out_dir)
    shutil.rmtree(out_dir / OLD, ignore_errors=True)  # the new ckpt.dcp is whole: the old one goes
    held = [out_dir / name for name in ("ckpt.pt", SHARDED) if (out_dir / name).exists()]
    if held and not resuming:
        if not overwrite:
            raise CheckpointError(
                f"{out_dir} already holds a checkpoint; continue it with --resume=True, or start "
                f"over with --overwrite=True (which deletes it)"
            )
        for ckpt in held:
            if ckpt.is_dir():
                shutil.rmtree(ckpt)
            else:
                ckpt.unlink()
            print(f"warning: --overwrite=True: deleted {ckpt}, starting over", file=sys.stderr)
    return lock


def recover_sharded(out_dir):
    """Put back the checkpoint a save killed between save_sharded's two renames left as a lone
    ckpt.dcp.old (every reader already takes it for the checkpoint: checkpoint_path). Only under the
    out_dir lock: a live run between its renames would lose its save."""
    old = Path(out_dir) / OLD
    if old.is_dir() and not old.with_name(SHARDED).exists():
        old.rename(old.with_name(SHARDED))


def _torch_load(path):
    """torch.load of a file through one open file: the run may rename a new checkpoint over path
    at any moment, and torch.load(path, mmap=True) opens it twice (the archive, then the map), so
    the two could be two checkpoints. Memory-mapped through /proc/self/fd (the open file itself)
    where there is one, else read through the file object."""
    with open(path, "rb") as f:
        pinned = f"/proc/self/fd/{f.fileno()}"
        if os.path.exists(pinned):
            return torch.load(pinned, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(f, map_location="cpu", weights_only=True)


def is_torch_file(path) -> bool:
    """Whether path starts as torch.save writes (a zip archive; the legacy format, a pickle): a
    log, a config or a shard given by mistake is told apart from a damaged checkpoint."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def read_checkpoint(path, verify=None) -> dict:
    """torch.load a train.py checkpoint on the CPU and check the stored checksums of the entries in
    verify (None = all). Memory-mapped, so a large optimizer state beside the model is never read
    unless verified or used; only tensors and plain values, so the safe loader suffices."""
    path = Path(path)
    # an FSDP run's: run.pt here, the tensors in the shards
    if path.is_dir() and path.name in (SHARDED, OLD):
        ckpt = read_checkpoint(path / "run.pt", verify)
        return {**ckpt, "shards": str(path)}
    if not path.is_file():
        raise no_checkpoint(path)
    # a .pt that does not start as one is a damaged checkpoint; a log, a config or a shard is not one
    if path.suffix not in (".pt", ".pth", ".ckpt") and not is_torch_file(path):
        raise CheckpointError(f"{path} is not a checkpoint; give a train.py out_dir, its ckpt.pt "
                              f"or ckpt.dcp, or a Hugging Face folder or hub id")
    try:
        ckpt = _torch_load(path)
    except Exception as e:  # truncated, random or foreign bytes
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); "
                              f"it may be truncated or corrupt: retrain or restore it") from e
    needed = {"model_config"} if path.name == "run.pt" else {"model", "model_config"}
    if not isinstance(ckpt, dict) or not needed <= ckpt.keys():
        raise CheckpointError(
            f"{path} is a torch file but not a train.py checkpoint (no {' and '.join(needed)})"
        )
    stored = ckpt.pop("checksums", None)
    if stored is None:
        print(
            f"warning: {path} has no checksums (written before they were added); loading it unverified",
            file=sys.stderr,
        )
        return ckpt
    # older checkpoints lack newer keys
    bad = [key for key in (verify or stored) if (key in stored or key in ckpt)
           and checksums({key: ckpt.get(key)}).get(key) != stored.get(key)]
    if bad:
        raise CheckpointError(
            f"{path} is corrupt: its {', '.join(bad)} no longer match the checksums written with "
            f"it; restore the file or retrain"
        )
    return ckpt


def unfinished(folder) -> str:
    """'; X is a write that did not finish' for the temporaries a killed save left in folder, else
    ''."""
    left = sorted(p.name for p in Path(folder).glob("ckpt.*.tmp*")) if Path(folder).is_dir() else []
    return f" ({', '.join(left)}: a write that did not finish)" if left else ""


def model_from_checkpoint(ckpt: dict) -> GPT:
    """The model a train.py checkpoint describes (its stored config dict, a baseline's keys
    included), with its weights. A checkpoint from before a config field existed gets that field's
    default."""
    model = build_model(make_config(**ckpt["model_config"]))
    # an FSDP run's: torch.distributed.checkpoint reads the shards into the parameters
    if "shards" in ckpt:
        read_shards({"model": model.state_dict()}, ckpt)  # (state_dict's tensors are their storage)
    else:
        model.load_state_dict(ckpt["model"])
    return model


def read_shards(state, ckpt, rank=0, world=1):
    """Fill state's tensors from an FSDP run's ckpt.dcp folder (torch.distributed.checkpoint): whole
    tensors in one process, each rank its shards under torchrun. Every file is first checked against
    the sizes and digests run.pt recorded (verify_shards; rank r of world checks every world-th
    file), so a damaged, truncated, missing or swapped file is a CheckpointError naming it, never
    weights served."""
    import torch.distributed.checkpoint as dcp
    # a BaseException, not an Exception
    from torch.distributed.checkpoint.api import CheckpointException
    path = Path(ckpt["shards"])
    if path.name == OLD and not path.exists():  # put back since by the run's lock holder
        path = path.with_name(SHARDED)
    if "files" in ckpt:
        bad = verify_shards(path, ckpt["files"], rank, world)
        if world > 1:  # every rank hears of every rank's findings, and all stop together
            found = [None] * world
            dist.all_gather_object(found, bad)
            bad = [b for part in found for b in part]
        if bad:
            raise CheckpointError(
                f"{path} is damaged: {'; '.join(bad)}; restore the folder or retrain"
            )
    elif rank == 0:
        print(f"warning: {path} has no file checksums (written before they were added); reading it "
              f"unverified", file=sys.stderr)
    try:
        # "no process group: loading in a single process", as intended
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"{path}: the shards cannot be read ({reason(e)}); restore the folder " f"or retrain"
        ) from e


def file_digest(path, chunk=1 << 24) -> str:
    """sha256 of a file, read in 16 MiB chunks (hashlib releases the GIL: files hash in
    parallel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def digest_files(folder, names) -> dict:
    """{name: {"bytes": size, "sha256": digest}} of the named files in folder, several at once."""
    from concurrent.futures import ThreadPoolExecutor
    names = list(names)
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda n: file_digest(Path(folder) / n), names))
    return {
        n: {"bytes": (Path(folder) / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)
    }


def verify_shards(path, files, rank=0, world=1) -> list:
    """What is wrong with the files of a ckpt.dcp folder against files, run.pt's record of them
    ({name: {bytes, sha256}}): this rank's share, every world-th file from the rank-th. [] when all
    is well."""
    mine = sorted(files)[rank::world]
    missing = [n for n in mine if not (path / n).is_file()]
    resized = [
        n for n in mine if n not in missing and (path / n).stat().st_size != files[n]["bytes"]
    ]
    bad = [f"{n} is missing" for n in missing]
    bad += [
        f"{n} has {(path / n).stat().st_size} bytes, {files[n]['bytes']} were written"
        for n in resized
    ]
    rest = [n for n in mine if n not in missing and n not in resized]
    found = digest_files(path, rest) if rest else {}
    return bad + [f"{n} no longer matches its checksum" for n in rest
                  if found[n]["sha256"] != files[n]["sha256"]]


@dataclass
class Loaded:
    model: GPT            # in eval mode, on the requested device
    tokenizer: object     # encode(text, allowed_special=...), decode(ids), eot_token, name
    source: str           # the file or folder the weights came from
    step: int             # training steps behind the weights (None when unknown)


def no_checkpoint(path) -> CheckpointError:
    where = f"{path} or {path.with_name(SHARDED)}" if path.name == "ckpt.pt" else str(path)
    return CheckpointError(f"no checkpoint at {where}{unfinished(path.parent)}; train one with "
                           f"`python train.py` or check the path")


def check_source(init_from):
    """A CheckpointError now, before any slow work (lm-eval's task downloads), when init_from names
    no model: not a Hugging Face folder, not a hub id, and no checkpoint there."""
    if hf.is_hf_folder(init_from) or looks_like_hub_id(init_from):
        return
    path = checkpoint_path(init_from)
    if not path.exists():
        raise no_checkpoint(path)


def checkpoint_path(init_from) -> Path:
    """An out_dir means its checkpoint (ckpt.pt, or an FSDP run's ckpt.dcp, or a lone ckpt.dcp.old:
    a save between its two renames, or killed there); a ckpt.dcp's run.pt means the ckpt.dcp; a file
    or a ckpt.dcp is itself."""
    p = Path(init_from)
    if p.name == "run.pt" and p.parent.name in (SHARDED, OLD):  # the folder is the checkpoint
        return p.parent
    if p.is_dir() and p.name not in (SHARDED, OLD):
        if not (p / "ckpt.pt").exists():
            for name in (SHARDED, OLD):
                if (p / name).is_dir():
                    return p / name
        return p / "ckpt.pt"
    return p


def read_snapshot(find, read):
    """read(path) of the checkpoint path = find() as one snapshot. A run replaces its checkpoint by
    renames while it trains: a file is read through one open file (_torch_load), which is one
    snapshot; for a folder (ckpt.dcp: run.pt and the shards) a reader checks that path is, after the
    read, the folder it held open before (held, its inode cannot be reused by a newer one). When the
    run replaced it meanwhile, the read (or its failure: the files it was reading went) counts for
    nothing and is tried once more, and a second replacement says so."""
    for attempt in range(2):
        path = find()
        if not path.is_dir():
            return read(path)
        try:
            held = os.open(path, os.O_RDONLY)
        except OSError:  # nothing there (read says so), or gone between find and open
            if attempt:
                return read(path)
            continue
        try:
            try:
                result = read(path)
            except CheckpointError:
                if _unchanged(held, path):
                    raise
                continue
            if _unchanged(held, path):
                return result
        finally:
            os.close(held)
    raise CheckpointError(f"{path} was replaced while being read (a run is writing it); try again")


def _unchanged(held, path) -> bool:
    """Whether path still names the file or folder open as held."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    was = os.fstat(held)
    return (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino)


def load_model(init_from, device="cpu") -> Loaded:
    """The model and tokenizer behind init_from (see the module docstring), ready for inference. A
    folder, file or hub id that cannot be used is a UserError whose message names the file and the
    fix."""
    if hf.is_hf_folder(init_from) or looks_like_hub_id(init_from):
        folder = snapshot(init_from)
        model = hf.from_pretrained(folder)
        tokenizer = folder_tokenizer(folder)
        if tokenizer is None:
            raise CheckpointError(
                f"{folder} has no tokenizer.json; copy the model's tokenizer.json into it"
            )
        return Loaded(model.to(device).eval(), tokenizer, str(folder), None)
    path, ckpt, model = read_snapshot(lambda: checkpoint_path(init_from), read_model)
    return Loaded(model.to(device).eval(), from_record(ckpt), str(path), ckpt.get("step"))


def read_model(path):
    """(path, its checkpoint's entries, the model they describe), the model's entries verified (not
    the optimizer's)."""
    ckpt = read_checkpoint(path, verify=("model", "model_config", "files", *TOKENIZER_KEYS))
    try:
        return path, ckpt, model_from_checkpoint(ckpt)
    except ModelConfigError as e:  # a stored config this code cannot build
        raise CheckpointError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- sharded checkpoints

def save_sharded(model, optimizer, run, out_dir, master):
    """out_dir/ckpt.dcp: the model and optimizer through torch.distributed.checkpoint (each rank
    writes its shards; its files are synced), then every file's size and sha256 (each rank hashes
    every world-th file) in run.pt, the rest of a checkpoint (config, step, RNG...) with checksums.
    Written into ckpt.dcp.tmp and renamed into place by rank 0 once every rank is done, so a kill
    leaves the previous checkpoint or the new one, never a mix. A failure on any rank raises
    SaveError on every rank, together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    path = Path(out_dir) / SHARDED
    tmp, old = path.with_name(SHARDED + ".tmp"), path.with_name(SHARDED + ".old")
    rank, world = dist.get_rank(), dist.get_world_size()
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    except CheckpointException as e:  # raised on every rank when a rank's write failed
        raise SaveError(*shard_failure(e)) from None
    error, digests = None, {}
    try:
        digests = digest_files(tmp, sorted(p.name for p in tmp.iterdir())[rank::world])
    except OSError as e:
        error = f"rank {rank} could not read back its files ({reason(e)})"
    found, shared = [None] * world, [None]
    try:  # a peer that stopped breaks the collectives: say so, not that a write failed
        dist.all_gather_object(found, (error, digests))
        error = next((err for err, _ in found if err), None)
        if master and error is None:
            try:
                save_checkpoint({**run, "files": {k: v for _, d in found for k, v in d.items()}},
                                tmp / "run.pt")
            except OSError as e:
                error = f"could not write run.pt ({reason(e)})"
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
    except RuntimeError as e:
        raise SaveError(reason(e), peer_lost=True) from None
    if shared[0]:
        if master:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(shared[0])
    if master:
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(path.parent)
    dist.barrier()


class SaveError(CheckpointError):
    """A sharded checkpoint that could not be written, raised on every rank with the same message;
    peer_lost when a rank stopped (its peers lost their connection to it) rather than a write
    failed."""

    def __init__(self, message, peer_lost=False):
        super().__init__(message)
        self.peer_lost = peer_lost


def shard_failure(e):
    """(what a CheckpointException says went wrong: the first failing rank's own error in one line,
    whether that rank lost a peer)."""
    failures = getattr(e, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        return f"rank {rank}: {reason(failure)}", isinstance(failure, dist.DistError)
    return reason(e), False


def load_sharded(model, optimizer, ckpt):
    """Fill the (sharded) model and its optimizer from a run's ckpt.dcp folder (ckpt:
    read_checkpoint's dict of it); each rank reads what it holds, after checking its share of the
    files."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    read_shards(state, ckpt, dist.get_rank(), dist.get_world_size())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
