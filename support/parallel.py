"""
How train.py spreads a model over torchrun's processes, and what it keeps of the activations.

    --parallel=ddp   every rank holds the whole model, its gradients and AdamW's state (about 16
                     bytes per parameter); gradients are all-reduced (DistributedDataParallel).
    --parallel=fsdp  each rank holds 1/world of them (FSDP2, `fully_shard` on every decoder block
                     and on the whole model); a block's parameters are gathered while it runs and
                     freed after. On CUDA they are gathered in bf16 and gradients reduced in fp32.
    --activation_checkpointing=True  keep only each block's input and recompute the block in the
                     backward pass: a second forward for much less memory.

Neither changes the run: the same batches, schedule, accumulation and clipping on the global
gradient norm give the same losses (tests/test_parallel.py). An FSDP run writes its checkpoint
sharded (torch.distributed.checkpoint: each rank its part, no rank gathers the model) into
out_dir/ckpt.dcp (sharded.save_sharded), read back whole for sample.py, eval.py and export.py.
`python train.py CONFIG --memory_plan=True` prints what each mode needs per GPU (memory.py).
"""
import functools
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

# what activation checkpointing recomputes: baselines.py's, so an export's code shares it
from support.variants import wrap_units
from support.cli import resolve_device
from support.errors import ConfigError

PARALLEL = ("ddp", "fsdp")


def checkpointing(method):
    """A unit under activation checkpointing: only its inputs are kept, the rest recomputed in the
    backward pass (torch.utils.checkpoint, non-reentrant: it supports keyword arguments, and outputs
    that need no gradient)."""
    return functools.partial(checkpoint, method, use_reentrant=False)


def checkpoint_activations(model):
    """--activation_checkpointing=True."""
    wrap_units(model, checkpointing)


def shard(model, bf16):
    """FSDP2 in place: every decoder block one unit, the rest (embeddings, final norm, head, a
    baseline's model-level modules) the root unit. Returns the parameters left replicated (see
    below)."""
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


class Parallel:
    """The model as train.py trains it: `.forward` is what the training step calls (the DDP wrapper,
    or the model itself, sharded in place under FSDP); the rest are where the modes differ."""

    def __init__(self, model, mode, distributed, device, bf16):
        self.model, self.mode = model, mode if distributed else "single"
        self.replicated = shard(model, bf16) if self.mode == "fsdp" else []
        self.forward = model
        if self.mode == "ddp":  # gradients as views of the all-reduce buckets: no second copy
            from torch.nn.parallel import DistributedDataParallel
            ids = [torch.cuda.current_device()] if device.startswith("cuda") else None
            self.forward = DistributedDataParallel(model, device_ids=ids,
                                                   gradient_as_bucket_view=True)

    @property
    def sharded(self):
        return self.mode == "fsdp"

    def gradient_sync(self, sync):
        """A context for one micro-step's backward: gradients are reduced only on the last one."""
        if self.mode == "ddp" and not sync:
            return self.forward.no_sync()
        if self.sharded:
            self.model.set_requires_gradient_sync(sync)
        return nullcontext()

    def clip(self, max_norm) -> float:
        """Clip to max_norm (0: no clipping) on the global gradient norm, which it returns."""
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  max_norm or float("inf")).item()
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


@dataclass
class Process:
    """Where this process runs: its rank among `world` processes (torchrun), its device, bf16."""
    rank: int
    world: int
    device: str
    bf16: bool
    distributed: bool

    @property
    def master(self) -> bool:
        return self.rank == 0

    def autocast(self):
        return (torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16) if self.bf16
                else nullcontext())


def setup_process(cfg) -> Process:
    """Join torchrun's process group when RANK is set; pick this process's device, precision."""
    distributed = "RANK" in os.environ  # set by torchrun
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if distributed else None
    device = resolve_device(cfg["device"], local_rank)
    if distributed and device == "mps":
        raise ConfigError("multi-process training on mps is not supported; use --device=cpu or a "
                          "single process")
    if cfg["parallel"] == "fsdp" and not distributed:
        raise ConfigError("--parallel=fsdp shards the model over torchrun's processes: launch with "
                          "`torchrun --standalone --nproc_per_node=N train.py ...` (N = 1 works "
                          "too)")
    if distributed:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast may use TF32
    bf16 = cfg["dtype"] == "bfloat16" or (cfg["dtype"] == "auto" and device.startswith("cuda")
                                          and torch.cuda.is_bf16_supported())
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return Process(rank, world, device, bf16, distributed)
