"""
An FSDP run: its model sharded over the ranks (shard, and the global gradient norm and the
replicated parameters' sync that a sharded gradient needs), and its checkpoint, the folder ckpt.dcp:
the model and optimizer shards through torch.distributed.checkpoint, plus run.pt, the rest of a
checkpoint (config, step, RNG, and every file's size and sha256). train.py --parallel=fsdp writes
and resumes it (save_sharded, load_sharded); any reader of a model gets whole tensors from it
(read_shards). Only a run or a checkpoint that is sharded imports this.
"""
import hashlib
import os
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from model import DEPTH_MODES
from support.cli import SHARDED, SHARDED_OLD, reason
from support.errors import CheckpointError, ConfigError
from support.run_dir import fsync_dir, save_checkpoint


def shard(model, bf16):
    """FSDP2 in place: every decoder block one unit, the rest (embeddings, final norm, head, a
    baseline's model-level modules) the root unit. Returns the parameters left replicated (see
    below)."""
    mode = model.config.depth_mode
    if DEPTH_MODES[mode].shared:  # one module in every block would be in every block's unit
        raise ConfigError(f"--parallel=fsdp shards each block apart, and {mode} shares its "
                          f"parameters across the blocks (DepthMode.shared); use --parallel=ddp")
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)
    # FSDP2 warns of every view a unit returns: an in-place op on it would lose the unit's
    # pre-backward hook. A block returns its record, its K and V for later layers' depth steps, a
    # view (of the V projection, or of the cache slots); depth_mix and lime_mix only read records
    # (stack, vecdot, matmul, an addcmul_ into a new tensor), so no hook is lost, and the gradients
    # equal one process's (tests/test_parallel.py): the warning would be a false alarm.
    warnings.filterwarnings("ignore",
                            message=r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    # fully_shard cannot shard a 0-dim parameter (mHC's gains, AttnRes's recency biases): those stay
    # whole on every rank, and sync_replicated averages their gradients as DDP would.
    replicated = [p for p in model.parameters() if p.dim() == 0]  # in the same order on every rank
    base = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
    for block in model.layers:
        for name, child in block.named_children():
            if name not in base:  # a baseline's per-block module, called by its forward: a unit
                fully_shard(child, mp_policy=policy, ignored_params=set(replicated))
        fully_shard(block, mp_policy=policy, ignored_params=set(replicated))
        for method in ("attend", "feed_forward"):  # the baselines call these, not its forward
            register_fsdp_forward_method(block, method)
    fully_shard(model, mp_policy=policy, ignored_params=set(replicated))
    return replicated


def sync_replicated(params, world):
    """Average the gradients of the parameters FSDP left whole, in one all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        flat = torch.stack([g.reshape(()) for g in grads])
        dist.all_reduce(flat)
        for g, v in zip(grads, flat / world):
            g.copy_(v)


def clip_grad_norm(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ for a mix of sharded (DTensor) and whole gradients: the norm
    of the global gradient, every grad scaled by min(1, max_norm / (norm + 1e-6)) as torch does.
    Returns the norm (float). The shards' squares are summed locally and all-reduced once, not once
    per parameter."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if hasattr(g, "to_local")]
    whole = [g for g in grads if not hasattr(g, "to_local")]  # alike on every rank (synced)

    def square(g):  # the float32 norm, as torch's clip computes it, squared in float64; no copy
        return torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
    zero = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    squares = sum(map(square, sharded), zero)
    dist.all_reduce(squares)
    total = (squares + sum(map(square, whole))).sqrt().item()
    if max_norm:
        coef = min(1.0, max_norm / (total + 1e-6))
        for g in grads:
            g.mul_(coef)
    return total


def read_shards(state, ckpt, rank=0, world=1):
    """Fill state's tensors from an FSDP run's ckpt.dcp folder: whole tensors in one process, each
    rank its shards under torchrun. Every file is first checked against the sizes and digests run.pt
    recorded (verify_shards), so a damaged, truncated, missing or swapped file is a CheckpointError
    naming it, never weights served."""
    path = Path(ckpt["shards"])
    if path.name == SHARDED_OLD and not path.exists():  # put back since by the run's lock holder
        path = path.with_name(SHARDED)
    if "files" in ckpt:
        bad = verify_shards(path, ckpt["files"], rank, world)
        if world > 1:  # every rank hears of every rank's findings, and all stop together
            found = [None] * world
            dist.all_gather_object(found, bad)
            bad = [b for part in found for b in part]
        if bad:
            raise CheckpointError(f"{path} is damaged: {'; '.join(bad)}; restore the folder or "
                                  f"retrain")
    elif rank == 0:
        print(f"warning: {path} has no file checksums (written before they were added); reading it "
              f"unverified", file=sys.stderr)
    try:
        # "no process group: loading in a single process", as intended
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(state, checkpoint_id=path)
    except (CheckpointException, OSError) as e:  # a bug of ours stays a traceback
        raise CheckpointError(f"{path}: the shards cannot be read ({reason(e)}); restore the "
                              f"folder or retrain") from e


def file_digest(path, chunk=1 << 24) -> str:
    """sha256 of a file, read in 16 MiB chunks (hashlib frees the GIL: files hash in parallel)."""
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
    """What is wrong with this rank's share (every world-th file from the rank-th) of a ckpt.dcp
    folder against run.pt's record of its files ({name: {bytes, sha256}}); [] when all is well."""
    mine = sorted(files)[rank::world]
    missing = [n for n in mine if not (path / n).is_file()]
    resized = [n for n in mine if n not in missing
               and (path / n).stat().st_size != files[n]["bytes"]]
    bad = [f"{n} is missing" for n in missing]
    bad += [f"{n} has {(path / n).stat().st_size} bytes, {files[n]['bytes']} were written"
            for n in resized]
    rest = [n for n in mine if n not in missing and n not in resized]
    found = digest_files(path, rest) if rest else {}
    return bad + [f"{n} no longer matches its checksum" for n in rest
                  if found[n]["sha256"] != files[n]["sha256"]]


def save_sharded(model, optimizer, run, out_dir, master):
    """out_dir/ckpt.dcp: the model and optimizer through torch.distributed.checkpoint (each rank
    writes its shards; its files are synced), then every file's size and sha256 (each rank hashes
    every world-th file) in run.pt, the rest of a checkpoint (config, step, RNG...) with checksums.
    Written into ckpt.dcp.tmp and renamed into place by rank 0 once every rank is done, so a kill
    leaves the previous checkpoint or the new one, never a mix. A failure on any rank raises
    SaveError on every rank, together."""
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
    """(the first failing rank's own error in one line, whether that rank lost a peer)."""
    failures = getattr(e, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        return f"rank {rank}: {reason(failure)}", isinstance(failure, dist.DistError)
    return reason(e), False


def load_sharded(model, optimizer, ckpt):
    """Fill the (sharded) model and its optimizer from a run's ckpt.dcp (ckpt: read_checkpoint's
    dict of it); each rank reads what it holds, after checking its share of the files."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    read_shards(state, ckpt, dist.get_rank(), dist.get_world_size())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
