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
out_dir/ckpt.dcp (sharded.save_sharded), read back whole for sample.py, eval.py and export.py;
support/sharded.py also holds how the model is sharded (shard) and its gradient clipped.
`python train.py CONFIG --memory_plan=True` prints what each mode needs per GPU (memory.py).
"""
import functools
import os
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


class Parallel:
    """The model as train.py trains it: `.forward` is what the training step calls (the DDP wrapper,
    or the model itself, sharded in place under FSDP); the rest are where the modes differ."""

    def __init__(self, model, mode, distributed, device, bf16):
        self.model, self.mode = model, mode if distributed else "single"
        self.replicated = []
        if self.mode == "fsdp":
            from support.sharded import shard  # FSDP's, only for it
            self.replicated = shard(model, bf16)
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
        from support.sharded import clip_grad_norm, sync_replicated
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
