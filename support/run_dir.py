"""
A training run's folder, which train.py writes: the lock that makes it the folder's one writer
(claim_out_dir), ckpt.pt written atomically with its checksums (save_checkpoint; an FSDP run's
ckpt.dcp is support/sharded.py's), and the RNG states a checkpoint carries. Reading a checkpoint,
for every script, is support/checkpoint.py's.
"""
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from support.checksums import checksums
from support.cli import SHARDED, SHARDED_OLD
from support.errors import CheckpointError
from support.atomic import room_for
from support.folders import MANIFEST, claim

try:
    import fcntl  # the out_dir lock; absent on Windows, where runs go unlocked
except ImportError:
    fcntl = None


def save_checkpoint(obj, path):
    """Write obj with its checksums to a temporary file in the same folder, sync it, then rename: a
    kill at any moment leaves either the previous checkpoint or the new one, never a torn file."""
    path, obj = Path(path), {**obj, "checksums": checksums(obj)}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with room_for(path, lambda: serialized_bytes(obj)), open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk (DiskFull), an interrupt: the old checkpoint stays, the
        # partial goes
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def serialized_bytes(obj) -> int:
    """What torch.save writes for obj, counted without a file: the space a checkpoint needs."""
    class Count:  # the file-like object torch.save needs
        n = 0

        def write(self, data):
            self.n += len(data)
            return len(data)

        def flush(self):
            pass
    count = Count()
    torch.save(obj, count)
    return count.n


def fsync_dir(folder):
    """Make a rename inside folder durable."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state():
    """Every generator a run draws from (Python, numpy, torch, CUDA), as tensors and values."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": [kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# What train.py writes into its out_dir, its manifest (support/folders.py); train.out is the console
# log ablate.py keeps beside each run it starts
RUN_FILES = ("train.lock", "config.json", "log.jsonl", "ckpt.pt", SHARDED, "train.out")


def run_folder(out_dir, resuming, init_from=""):
    """out_dir as a folder train.py may write (support.folders.claim), checked before any work:
    new, empty or an earlier run's (one from before manifests has a lock or a checkpoint), and
    never the --init_from it starts from."""
    return claim(out_dir, "train.py", "--out_dir", RUN_FILES,
                 sources=[] if resuming else [("--init_from", init_from)],
                 legacy=earlier_run)


def earlier_run(folder):
    """What train.py wrote into a run folder made before manifests, known by its lock or its
    checkpoint ([] for any other folder)."""
    held = [n for n in RUN_FILES if (folder / n).exists()]
    return held if {"train.lock", "ckpt.pt", SHARDED} & set(held) else []


def claim_out_dir(out_dir, resuming, overwrite, init_from=""):
    """Create out_dir with its manifest and lock it for the life of this process (flock: the kernel
    releases it when the process dies, so a killed run never blocks the next one). A second run
    into the folder is refused rather than mixed with this one, and a fresh start over a checkpoint
    needs --overwrite, which deletes only the files train.py wrote. Returns the open lock file."""
    folder = run_folder(out_dir, resuming, init_from)
    out_dir = folder.path
    folder.record()
    try:
        lock = open(out_dir / "train.lock", "a+")
    except OSError as e:
        raise CheckpointError(f"cannot write to --out_dir={out_dir} ({e.strerror}); pick a "
                              f"writable folder") from e
    if fcntl:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise CheckpointError(f"another train.py ({lock.read().strip() or 'pid unknown'}) is "
                                  f"writing to {out_dir}; wait for it to finish or pick another "
                                  f"--out_dir") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    # a write cut short by a kill; no other writer holds the lock
    for torn in out_dir.glob("ckpt.pt.tmp*"):
        torn.unlink()
    shutil.rmtree(out_dir / f"{SHARDED}.tmp", ignore_errors=True)
    recover_sharded(out_dir)
    shutil.rmtree(out_dir / SHARDED_OLD, ignore_errors=True)  # ckpt.dcp is whole: the old one goes
    held = [out_dir / name for name in ("ckpt.pt", SHARDED) if (out_dir / name).exists()]
    if held and not resuming:
        if not overwrite:
            raise CheckpointError(f"{out_dir} already holds a checkpoint; continue it with "
                                  f"--resume=True, or start over with --overwrite=True (which "
                                  f"deletes the files train.py wrote there)")
        print(f"warning: --overwrite=True: deleting {', '.join(n.name for n in held)} and the "
              f"log of {out_dir}, starting over", file=sys.stderr)
        folder.clear(keep=["train.lock", MANIFEST])
    return lock


def recover_sharded(out_dir):
    """Put back the checkpoint a save killed between save_sharded's two renames left as a lone
    ckpt.dcp.old (every reader already takes it for the checkpoint: checkpoint_path). Only under the
    out_dir lock: a live run between its renames would lose its save."""
    old = Path(out_dir) / SHARDED_OLD
    if old.is_dir() and not old.with_name(SHARDED).exists():
        old.rename(old.with_name(SHARDED))
