"""
How train.py spreads a model over torchrun's processes, and what it keeps of the activations.

    --parallel=ddp    every rank holds the whole model, its gradients and AdamW's state (about 16 bytes per
                      parameter); gradients are all-reduced (DistributedDataParallel). The default.
    --parallel=fsdp   each rank holds 1/world of them (FSDP2, `fully_shard` on every decoder block and on the
                      whole model); a block's parameters are gathered while it runs and freed after. On CUDA the
                      gathered parameters are bf16 and gradients are reduced in fp32 (MixedPrecisionPolicy).
    --activation_checkpointing=True   keep only each block's input and recompute the block in the backward
                      pass (torch.utils.checkpoint, non-reentrant): a second forward for much less memory.

Neither changes the run: the same batches, schedule, accumulation and clipping on the global gradient norm give
the same losses (tests/test_parallel.py). An FSDP run writes its checkpoint sharded (torch.distributed.checkpoint:
each rank its part, no rank gathers the model) into out_dir/ckpt.dcp; checkpoint.py reads it back whole for
sample.py, eval.py and the export. `python train.py CONFIG --memory_plan=True` prints what each mode needs per GPU.
Also here: the stop on Ctrl-C or SIGTERM that every rank agrees on (StopSignals), and a process's peak memory.
"""
import functools
import shutil
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from baselines import residual_of
from checkpoint import SHARDED, fsync_dir, read_shards, save_checkpoint

try:
    import resource  # peak memory on the CPU; absent on Windows
except ImportError:
    resource = None

PARALLEL = ("ddp", "fsdp")


# What is recomputed, per residual path: the block (a plain model, DenseFormer), or the pieces a baseline's
# run_layers calls in its place: AttnRes's two sublayers and their depth aggregators, mHC's two sublayers. mHC's
# connectors (its n streams and Sinkhorn) stay outside: a recomputed connector calls its sublayer through FSDP's
# hooks again inside the backward pass, which gave wrong gradients (tests/test_parallel.py).
RECOMPUTED = {"add": ("forward",), "denseformer": ("forward",),
              "attnres": ("attend", "feed_forward", "attnres_attn_aggregator", "attnres_mlp_aggregator"),
              "mhc": ("attend", "feed_forward")}


def checkpoint_units(model) -> list:
    """The (object, method name) pairs activation checkpointing recomputes (RECOMPUTED): a block's method, or the
    forward of a block's module."""
    units = []
    for block in model.layers:
        for name in RECOMPUTED[residual_of(model.config)]:
            part = getattr(block, name)
            units.append((part, "forward") if isinstance(part, nn.Module) else (block, name))
    return units


def wrap_units(model, wrap):
    """Replace every unit's method by wrap(method); returns the function that puts them back. An instance
    attribute shadows the class's method, and nn.Module.__call__ (with its hooks) and the baselines find it."""
    units = checkpoint_units(model)
    for owner, name in units:
        setattr(owner, name, wrap(getattr(owner, name)))
    return lambda: [delattr(owner, name) for owner, name in units]


def checkpointing(method):
    """A unit under activation checkpointing: only its inputs are kept, the rest recomputed in the backward pass
    (torch.utils.checkpoint, non-reentrant: it supports keyword arguments, and outputs that need no gradient)."""
    return functools.partial(checkpoint, method, use_reentrant=False)


def checkpoint_activations(model):
    """--activation_checkpointing=True."""
    wrap_units(model, checkpointing)


def shard(model, bf16):
    """FSDP2 in place: every decoder block one unit, the rest (embeddings, final norm, head, a baseline's
    model-level modules) the root unit. Returns the parameters left replicated (see below)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    # fully_shard cannot shard a 0-dim parameter (mHC's gains, AttnRes's recency biases): those stay whole on every
    # rank, and sync_replicated averages their gradients as DDP would.
    replicated = [p for p in model.parameters() if p.dim() == 0]  # in the same order on every rank
    base = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
    for block in model.layers:
        for name, child in block.named_children():
            if name not in base:  # a baseline's per-block module, called by its own forward: a unit of its own
                fully_shard(child, mp_policy=policy, ignored_params=set(replicated))
        fully_shard(block, mp_policy=policy, ignored_params=set(replicated))
        for method in ("attend", "feed_forward"):  # the baselines call these, not the block's forward
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
    """torch.nn.utils.clip_grad_norm_ for a mix of sharded (DTensor) and whole gradients: the norm of the global
    gradient, every grad scaled by min(1, max_norm / (norm + 1e-6)) as torch does. Returns the norm (float).
    The shards' squares are summed locally and all-reduced once, not once per parameter."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if hasattr(g, "to_local")]
    whole = [g for g in grads if not hasattr(g, "to_local")]  # the same on every rank after sync_replicated
    def square(g):  # the float32 norm, as torch's clip computes it, squared in float64; no copy of g
        return torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
    squares = sum(map(square, sharded), torch.zeros((), dtype=torch.float64, device=grads[0].device))
    dist.all_reduce(squares)
    total = (squares + sum(map(square, whole))).sqrt().item()
    if max_norm:
        coef = min(1.0, max_norm / (total + 1e-6))
        for g in grads:
            g.mul_(coef)
    return total


class Parallel:
    """The model as train.py trains it: `.forward` is what the training step calls (the DDP wrapper, or the model
    itself, sharded in place under FSDP); the rest are the few places where the modes differ."""

    def __init__(self, model, mode, distributed, device, bf16):
        self.model, self.mode = model, mode if distributed else "single"
        self.replicated = shard(model, bf16) if self.mode == "fsdp" else []
        self.forward = model
        if self.mode == "ddp":  # gradients as views of the all-reduce buckets: no second copy of them
            from torch.nn.parallel import DistributedDataParallel
            self.forward = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()]
                                                   if device.startswith("cuda") else None, gradient_as_bucket_view=True)

    @property
    def sharded(self):
        return self.mode == "fsdp"

    def gradient_sync(self, sync):
        """A context for one micro-step's backward: gradients are reduced only on the last of the accumulation."""
        if self.mode == "ddp" and not sync:
            return self.forward.no_sync()
        if self.sharded:
            self.model.set_requires_gradient_sync(sync)
        return nullcontext()

    def clip(self, max_norm) -> float:
        """Clip to max_norm (0: no clipping) on the global gradient norm, which it returns."""
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm or float("inf")).item()
        sync_replicated(self.replicated, dist.get_world_size())
        return clip_grad_norm(list(self.model.parameters()), max_norm)

    def weights_finite(self) -> bool:
        """Every weight finite, on every rank's shard."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        ok = torch.stack([p.isfinite().all() for p in local]).all()
        if self.sharded:
            ok = ok.to(torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok)


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (what a scheduler sends before preemption) ask the run to stop: the step in
    flight finishes, a checkpoint is written, and the process exits with 128 + the signal's number. A second
    Ctrl-C stops at once (KeyboardInterrupt: the last checkpoint stays)."""

    def __init__(self):
        self.received = 0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signum

    def agreed(self, proc) -> int:
        """The signal any rank received, 0 for none: under torchrun every rank stops after the same step (one
        that stopped alone would leave the others waiting in a collective), often only some got the signal."""
        if not proc.distributed:
            return self.received
        flag = torch.tensor(self.received, device=proc.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def peak_memory(device) -> str:
    """This process's peak memory: what torch allocated on the GPU, or the resident size on the CPU."""
    if device.startswith("cuda"):
        return f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated on the GPU"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if resource else 0
    kib = kib / 1024 if sys.platform == "darwin" else kib  # macOS counts bytes, Linux KiB
    return f"peak {kib / 2**20:.2f} GiB resident" if kib else "peak memory unknown"


# ----------------------------------------------------------------------------- sharded checkpoints

def save_sharded(model, optimizer, run, out_dir, master):
    """out_dir/ckpt.dcp: the model and optimizer through torch.distributed.checkpoint (each rank writes its
    shards; its files are synced) plus run.pt, the rest of a checkpoint (config, step, RNG...) with checksums.
    Written into ckpt.dcp.tmp and renamed into place by rank 0 once every rank is done, so a kill leaves the
    previous checkpoint or the new one, never a mix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    path = Path(out_dir) / SHARDED
    tmp, old = path.with_name(SHARDED + ".tmp"), path.with_name(SHARDED + ".old")
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    if master:
        save_checkpoint(run, tmp / "run.pt")
    dist.barrier()  # every shard and run.pt are on disk
    if master:
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(path.parent)
    dist.barrier()


def load_sharded(model, optimizer, path):
    """Fill the (sharded) model and its optimizer from a ckpt.dcp folder; each rank reads what it holds."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    read_shards(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
