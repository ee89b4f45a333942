"""
train.py --parallel=fsdp: each rank holds 1/world of the weights, gradients and AdamW's state
(FSDP2, `fully_shard` on every decoder block and on the whole model); a block's parameters are
gathered while it runs and freed after, in bf16 on CUDA with gradients reduced in fp32. The same
batches, schedule, accumulation and clipping on the global gradient norm give the losses of one
process (tests/test_parallel.py).

Its checkpoint is the folder out_dir/ckpt.dcp: the shards through torch.distributed.checkpoint (each
rank its part; no rank gathers the model) and run.pt, the rest of a checkpoint with every file's
size and sha256 (lab/shards.py reads it, whole or sharded). `python train.py CONFIG
--memory_plan=True` says what each mode needs per GPU (lab/memory.py).
"""
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from checkpoint import SHARDED
from configurator import CheckpointError, reason
from lab.shards import digest_files, read_shards
from outputs import fsync_dir, save_checkpoint


class Sharded:
    """A model sharded in place: every decoder block a unit (and a baseline's own per-block
    modules), the rest (embeddings, final norm, head, a baseline's model-level modules) the root."""

    def __init__(self, model, bf16):
        # FSDP2 warns of every view a unit returns (an in-place op on it would lose the unit's
        # pre-backward hook). A block returns its record, a view of its K and V; the depth step
        # only reads records, so no hook is lost and the gradients are one process's.
        warnings.filterwarnings("ignore",
                                message=r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor")
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if bf16 else MixedPrecisionPolicy())
        # fully_shard cannot shard a 0-dim parameter (mHC's gains, AttnRes's recency biases): they
        # stay whole on every rank, their gradients averaged as DDP would (clip)
        self.model, self.replicated = model, [p for p in model.parameters() if p.dim() == 0]
        skip = set(self.replicated)
        base = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
        for block in model.layers:
            for name, child in block.named_children():
                if name not in base:  # a baseline's per-block module, called by its forward
                    fully_shard(child, mp_policy=policy, ignored_params=skip)
            fully_shard(block, mp_policy=policy, ignored_params=skip)
            for method in ("attend", "feed_forward"):  # the baselines call these, not forward
                register_fsdp_forward_method(block, method)
        fully_shard(model, mp_policy=policy, ignored_params=skip)

    def clip(self, max_norm) -> float:
        """torch's clip_grad_norm_ on sharded (DTensor) and whole gradients: the global norm (the
        shards' squares summed locally, all-reduced once), every grad scaled by min(1, max_norm /
        (norm + 1e-6)). Returns the norm."""
        world = dist.get_world_size()
        if grads := [p.grad for p in self.replicated if p.grad is not None]:
            flat = torch.stack([g.reshape(()) for g in grads])
            dist.all_reduce(flat)
            for g, v in zip(grads, flat / world):
                g.copy_(v)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]

        def square(g):  # the float32 norm, as torch's clip computes it, squared in float64
            return torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
        zero = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        squares = sum((square(g.to_local()) for g in grads if hasattr(g, "to_local")), zero)
        dist.all_reduce(squares)
        total = (squares + sum(square(g) for g in grads if not hasattr(g, "to_local"))) \
            .sqrt().item()
        if max_norm:
            for g in grads:
                g.mul_(min(1.0, max_norm / (total + 1e-6)))
        return total

    def save(self, optimizer, run, out_dir, master):
        """out_dir/ckpt.dcp: the shards (each rank its own, synced), then run.pt with every file's
        size and sha256 (each rank hashes every world-th file), written into ckpt.dcp.tmp and
        renamed into place once every rank is done: a kill leaves the previous checkpoint or the
        new one. A failure on any rank raises SaveError on every rank, together."""
        path = Path(out_dir) / SHARDED
        tmp, old = path.with_name(SHARDED + ".tmp"), path.with_name(SHARDED + ".old")
        rank, world = dist.get_rank(), dist.get_world_size()
        if master:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        except CheckpointException as e:  # raised on every rank when a rank's write failed
            failed = sorted((getattr(e, "failures", None) or {}).items())
            # each failure is (the exception, its stack summary)
            rank, error = failed[0] if failed else (None, e)
            error = error[0] if isinstance(error, tuple) else error
            raise SaveError(f"rank {rank}: {reason(error)}" if failed else reason(e),
                            isinstance(error, dist.DistError))
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
                state = {**run, "files": {k: v for _, d in found for k, v in d.items()}}
                try:
                    save_checkpoint(state, tmp / "run.pt")
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

    def load(self, optimizer, ckpt):
        """The model and optimizer from a run's ckpt.dcp: each rank reads what it holds, after
        checking its share of the files."""
        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        read_shards(state, ckpt, dist.get_rank(), dist.get_world_size())
        set_state_dict(self.model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


class SaveError(CheckpointError):
    """A sharded checkpoint that could not be written, raised on every rank with one message;
    peer_lost: a rank stopped (its peers lost it) rather than a write failed."""

    def __init__(self, message, peer_lost=False):
        super().__init__(message)
        self.peer_lost = peer_lost
