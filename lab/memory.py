"""
A per-GPU memory plan of a training run, built from the real model: what one GPU holds when train.py
runs --parallel=ddp|fsdp with or without --activation_checkpointing=True, and the largest micro
batch a card takes.

    print(report(config, micro_batch=2, block_size=2048, bf16=True))

Per GPU, in bytes (bf16: train.py's bf16 autocast on CUDA; without it everything is float32):

  weights, gradients, optimizer  float32 weights and gradients, AdamW's exp_avg and exp_avg_sq:
                 4 + 4 + 8 bytes per distinct parameter of the model built on the meta device (a
                 tied weight once); every rank holds them under DDP (gradient_as_bucket_view=True:
                 no bucket copy), 1 / world of them under FSDP.
  gathered       parameter copies that live through a step. FSDP: the unsharded parameters and
                 gradients of the root unit (embeddings, final norm, lm_head, the baselines'
                 root-level modules), which stays gathered, and of PREFETCHED_BLOCKS block units,
                 bf16 under its MixedPrecisionPolicy. DDP with bf16: the bf16 copies autocast makes
                 of the matmul weights, which the graph keeps for backward.
  activations    the storages the training forward (with targets) saves for backward, each counted
                 once, traced on the meta device with saved_tensors_hooks; the forward's outputs
                 (train.py holds the logits through backward); and the two float32 logits-sized
                 gradients that cross_entropy's backward holds while all of that is alive, the
                 step's peak. GPUEmulation makes meta save what a GPU saves: flash attention's q, k,
                 v, output and (B, H, T) float32 logsumexp instead of the math path's (B, H, T, T)
                 probabilities, and bf16 autocast, which does not act on meta tensors (DDP: float32
                 weights, so the residual stream stays float32; FSDP's bf16 parameters make a bf16
                 model). With activation checkpointing, the units train.py recomputes
                 (baselines.checkpoint_units: a decoder block, or a baseline's pieces of one): what
                 is saved outside the units, the units' inputs (a block's input hidden state and the
                 Depth-Attention source K/V records it reads), the outputs, and the larger of one
                 unit's recomputed activations and the loss's gradients.
  total          their sum, every term at its largest at once (under gradient accumulation the
                 gradients exist while a micro-step's activations do).

Left out, for largest_micro_batch's HEADROOM: the CUDA context, NCCL's buffers, allocator
fragmentation, the temporaries of an op or of a unit's backward, and torch.compile's changes to what
is saved. docs/memory.md compares the plan with CPU training steps (bench_cache.measured_peak).
"""

import os
from contextlib import ExitStack
from dataclasses import asdict, fields as dataclass_fields, replace
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from baselines import BaselineConfig, build_model, wrap_units
from configurator import ConfigError, DataError, table
from data import load_meta

GIB = 2 ** 30
PARALLEL = ("ddp", "fsdp")
# Bytes per parameter that every rank keeps under DDP, and FSDP divides by the world size.
STATE_BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}
PREFETCHED_BLOCKS = 2  # FSDP keeps the block it computes and the one it prefetched gathered
# Left free on a card: a fraction for allocator fragmentation and the temporaries of an op or a
# backward step, and a fixed part for the CUDA context (~0.5 GiB), cuBLAS workspaces and NCCL's
# buffers.
HEADROOM = (0.10, GIB)
# The ops of CUDA autocast's bf16 list (and CPU's) that these models call; the ops on its float32
# list the model already runs in float32 (model.fp32_or_wider).
AUTOCAST_BF16 = (F.linear, F.scaled_dot_product_attention, torch.matmul, torch.bmm, torch.mm,
                 torch.einsum, torch.linalg.vecdot)
# the block label of what is saved outside the decoder blocks: embeddings, logits, loss
OUTSIDE = "outside"


def meta_model(config, dtype=torch.float32):
    """The real model on the meta device: shapes and dtypes, no memory or initialisation cost."""
    with torch.device("meta"):
        return build_model(asdict(config)).to(dtype)


def storage_key(t):
    """One key per storage: views of a tensor share it, so a saved view is not counted twice."""
    return t.untyped_storage()._cdata


def param_counts(model) -> dict:
    """Distinct parameters: total, in the root FSDP unit (outside model.layers), in the largest
    block unit."""
    total = model.num_params()
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    return {"total": total, "root": total - sum(blocks), "block": max(blocks)}


class SavedTensors:
    """What one training forward saves for backward, by storage: traced with saved_tensors_hooks,
    each storage labelled with the decoder block running when it was saved (hooks on every module of
    model.layers[i]: the baselines call a block's submodules, not the block) and with the checkpoint
    unit call it was saved in.

    nbytes: storage key -> bytes;  block: key -> block index or OUTSIDE (for saved storages);
    unit_saved / unit_inputs: per unit call, the keys saved inside it / passed to it;  outside: keys
    saved outside every unit;  outputs: the forward's. Parameters are left out (they are the
    weights), and so are autocast's weight copies (`copies`, filled by GPUEmulation)."""

    def __init__(self, model):
        self.model = model
        self.params = {storage_key(p) for p in model.parameters()}
        self.nbytes, self.block, self.unit_saved, self.unit_inputs = {}, {}, [], []
        self.outside, self.outputs, self.copies, self.copy_keys = set(), set(), {}, set()
        # every traced tensor stays alive: a freed storage's key could come back for another one
        self.keep = []
        self.here, self.depth, self.unit = OUTSIDE, 0, None

    def remember(self, t):
        key = storage_key(t)
        self.keep.append(t)
        self.nbytes.setdefault(key, t.untyped_storage().nbytes())
        return key

    def note(self, t):
        """t is saved for backward (the pack hook: returns t)."""
        if storage_key(t) not in self.params and storage_key(t) not in self.copy_keys:
            key = self.remember(t)
            self.block.setdefault(key, self.here)
            (self.outside if self.unit is None else self.unit_saved[self.unit]).add(key)
        return t

    def enter(self, i):
        self.depth += 1
        self.here = i if self.depth == 1 else self.here

    def leave(self):
        self.depth -= 1
        self.here = self.here if self.depth else OUTSIDE

    def unit_call(self, method):
        """method, recorded as one unit call: its tensor inputs, and what is saved inside it."""
        def call(*args, **kwargs):
            self.unit = len(self.unit_saved)
            self.unit_saved.append(set())
            self.unit_inputs.append({self.remember(t) for t in tensors_in((args, kwargs))
                                     if storage_key(t) not in self.params})
            try:
                return method(*args, **kwargs)
            finally:
                self.unit = None
        return call

    def run(self, idx, targets):
        """The training forward, traced; its outputs (logits, loss) stay through backward."""
        self.model.train()
        with ExitStack() as stack:
            for i, block in enumerate(self.model.layers):
                for module in block.modules():
                    enter = module.register_forward_pre_hook(lambda m, a, i=i: self.enter(i))
                    leave = module.register_forward_hook(lambda m, a, out: self.leave())
                    stack.callback(enter.remove)
                    stack.callback(leave.remove)
            stack.callback(wrap_units(self.model, self.unit_call))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.note, lambda t: t))
            outputs = self.model(idx, targets)
        for t in tensors_in(outputs):
            key = self.remember(t)
            self.block.setdefault(key, OUTSIDE)
            self.outputs.add(key)
        # cross_entropy's backward holds two float32 gradients the size of the logits (of the
        # log-probabilities and of the widened logits) while everything saved is still alive: the
        # step's largest temporary.
        logits = outputs[0]
        grad_dtype = torch.promote_types(logits.dtype, torch.float32)
        self.loss_grads = 2 * logits.numel() * grad_dtype.itemsize
        return self

    def total(self, keys) -> int:
        return sum(self.nbytes[k] for k in keys)

    def saved(self) -> set:
        """Without checkpointing: everything saved, and the outputs."""
        return self.outside | self.outputs | set().union(*self.unit_saved)

    def checkpointed(self) -> tuple:
        """With checkpointing: (bytes kept through the forward, each unit call's recomputed)."""
        kept = self.outside | self.outputs | set().union(*self.unit_inputs)
        return self.total(kept), tuple(self.total(s - kept) for s in self.unit_saved)

    def by_block(self) -> dict:
        """saved()'s bytes by the block that saved each storage first."""
        parts = {}
        for key in self.saved():
            parts[self.block[key]] = parts.get(self.block[key], 0) + self.nbytes[key]
        return parts

    def copy_bytes(self) -> int:
        return sum(c.untyped_storage().nbytes() for c in self.copies.values())


def tensors_in(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class GPUEmulation(TorchFunctionMode):
    """Makes a meta-device forward save what a CUDA forward saves, recording into `saved`:
    - flash attention: the kernel saves q, k, v (GQA's unexpanded K/V), its output, laid out
      (B, T, H, D), and a (B, H, T) float32 logsumexp; meta takes the math path, whose (B, H, T, T)
      probabilities and expanded copies are muted here;
    - bf16 autocast, which does not act on meta tensors: floating inputs of AUTOCAST_BF16 ops are
      cast to bf16, a weight once per forward (autocast's cache; the copy goes in saved.copies)."""

    def __init__(self, saved: SavedTensors, autocast: bool, flash: bool = True):
        super().__init__()
        self.saved, self.autocast, self.flash = saved, autocast, flash

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.autocast and func in AUTOCAST_BF16:
            args, kwargs = tree_map(self.to_bf16, (args, kwargs))
        if self.flash and func is F.scaled_dot_product_attention:
            return self.flash_attention(func, args, kwargs)
        return func(*args, **kwargs)

    def to_bf16(self, x):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()) or x.dtype == torch.bfloat16:
            return x
        if not isinstance(x, torch.nn.Parameter):
            return x.to(torch.bfloat16)
        if id(x) not in self.saved.copies:
            copy = self.saved.copies[id(x)] = x.to(torch.bfloat16)
            self.saved.copy_keys.add(storage_key(copy))
        return self.saved.copies[id(x)]

    def flash_attention(self, sdpa, args, kwargs):
        q, k, v = args[:3]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # mutes math's
            y = sdpa(*args, **kwargs)
        y = y.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # logsumexp: (B, H, T)
        for t in (q, k, v, y, lse):
            self.saved.note(t)
        return y


def trace(config, micro_batch, block_size, parallel="ddp", bf16=False, flash=True) -> SavedTensors:
    """The training forward of `config` at (micro_batch, block_size) on the meta device, as GPU
    `parallel` training runs it: under FSDP with bf16 the parameters are bf16, under DDP they stay
    float32 with autocast."""
    model = meta_model(replace(config, block_size=block_size),
                       torch.bfloat16 if bf16 and parallel == "fsdp" else torch.float32)
    idx = torch.zeros(micro_batch, block_size, dtype=torch.long, device="meta")
    saved = SavedTensors(model)
    with GPUEmulation(saved, autocast=bf16, flash=flash):
        return saved.run(idx, idx)


@lru_cache(maxsize=None)
def _traced(config_type, fields, micro_batch, block_size, parallel, bf16) -> tuple:
    saved = trace(config_type(**dict(fields)), micro_batch, block_size, parallel, bf16)
    return (param_counts(saved.model), saved.total(saved.saved()), *saved.checkpointed(),
            saved.loss_grads, saved.copy_bytes())


def traced(config, micro_batch, block_size, parallel, bf16) -> dict:
    """trace's totals, cached: params (param_counts); saved (bytes, no checkpointing); kept and
    recomputes (per unit call) with checkpointing (SavedTensors.checkpointed); loss_grads; copies
    (autocast's weight copies). Beyond two sequences they are extrapolated from the traces of one
    and two: every storage either has the micro batch as a dimension or does not, so each term is
    affine in it (tests/test_memory.py checks this)."""
    def at(mb):  # without bf16, DDP and FSDP run the same float32 forward: one trace serves both
        values = _traced(type(config), tuple(asdict(config).items()), mb, block_size,
                         parallel if bf16 else "ddp", bf16)
        return dict(zip(("params", "saved", "kept", "recomputes", "loss_grads", "copies"), values))

    if micro_batch <= 2:
        return at(micro_batch)
    one, two = at(1), at(2)

    def grow(a, b):
        return a + (b - a) * (micro_batch - 1)
    return {**{k: grow(one[k], two[k]) for k in ("saved", "kept", "loss_grads", "copies")},
            "params": one["params"],
            "recomputes": tuple(map(grow, one["recomputes"], two["recomputes"]))}


def plan(model_config, micro_batch, block_size, world, parallel, activation_checkpointing,
         bf16) -> dict:
    """Per-GPU bytes of a training step: weights, gradients, optimizer, gathered, activations and
    their total, for `world` GPUs under `parallel` (ddp or fsdp), micro batches of micro_batch x
    block_size tokens, with bf16 on CUDA (train.py's default there) or float32. The module docstring
    gives the model."""
    if parallel not in PARALLEL:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if world < 1 or micro_batch < 1:
        raise ConfigError(f"world and micro_batch must be positive, got {world} and {micro_batch}")
    t = traced(model_config, micro_batch, block_size, parallel, bf16)
    n = t["params"]
    shards = world if parallel == "fsdp" else 1
    out = {name: -(-n["total"] * b // shards) for name, b in STATE_BYTES.items()}  # ceil: FSDP pads
    if parallel == "fsdp":
        unsharded = (torch.bfloat16 if bf16 else torch.float32).itemsize  # a parameter, a gradient
        blocks = min(PREFETCHED_BLOCKS, model_config.n_layer)
        out["gathered"] = 2 * unsharded * (n["root"] + blocks * n["block"])
    else:
        out["gathered"] = t["copies"]
    # The peak: at the loss's backward, or with checkpointing possibly at a unit's recomputation.
    out["activations"] = (t["kept"] + max((*t["recomputes"], t["loss_grads"]))
                          if activation_checkpointing else t["saved"] + t["loss_grads"])
    out["total"] = sum(out.values())
    return out


def largest_micro_batch(model_config, block_size, world, parallel, ac, bf16, gpu_bytes,
                        headroom=HEADROOM) -> int:
    """The largest micro batch whose plan fits gpu_bytes with headroom = (fraction, bytes) left
    free; 0 when none does. A doubling then a bisection: the plan grows with the micro batch and
    costs no trace beyond two sequences."""
    budget = gpu_bytes * (1 - headroom[0]) - headroom[1]

    def fits(mb):
        return plan(model_config, mb, block_size, world, parallel, ac, bf16)["total"] <= budget
    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low), and high is to be tested
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


COLUMNS = ("weights", "gradients", "optimizer", "gathered", "activations", "total")


def report(model_config, micro_batch, block_size, bf16, gpu_gbs=(24, 40, 80), worlds=(1, 8)) -> str:
    """A plain-text table: for each world size, DDP and FSDP, activation checkpointing off and on,
    the per-GPU GiB of every term of the plan, and the largest micro batch that fits each card ('-'
    where even the states and a one-sequence micro batch do not)."""
    params = traced(model_config, 1, block_size, "ddp", bf16)["params"]["total"]
    header = ["world", "parallel", "act_ckpt", *COLUMNS, *(f"mb@{g}" for g in gpu_gbs)]
    plans = [(world, parallel, ac,
              plan(model_config, micro_batch, block_size, world, parallel, ac, bf16),
              [largest_micro_batch(model_config, block_size, world, parallel, ac, bf16, g * GIB)
               for g in gpu_gbs])
             for world in worlds for parallel in PARALLEL for ac in (False, True)]
    # the unit that shows the largest term with a digit before the point: a tiny model's is KiB
    unit, size = next((u, b) for u, b in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                      if max(p["total"] for *_, p, _ in plans) >= b or b == 1)
    rows = [[world, parallel, "on" if ac else "off", *(f"{p[k] / size:.2f}" for k in COLUMNS),
             *(m or "-" for m in largest)] for world, parallel, ac, p, largest in plans]
    fraction, fixed = HEADROOM
    count = f"{params / 1e6:.1f}M" if params >= 1e5 else f"{params:,}"
    title = (f"{count} parameters, micro batch {micro_batch} x {block_size} tokens, "
             f"{'bf16' if bf16 else 'float32'}; {unit} per GPU; mb@N: the largest micro batch for "
             f"an N GiB card with {fraction:.0%} + {fixed / GIB:g} GiB left free (the configured "
             f"one fits where it is >= {micro_batch})")
    return title + "\n" + table(rows, header)


def print_plan(cfg):
    """`python train.py CONFIG --memory_plan=True`: report() for train.py's resolved config on GPUs
    (bf16 unless --dtype=float32); nothing trains. Under torchrun, rank 0 alone prints it."""
    if os.environ.get("RANK", "0") != "0":
        return
    fields = {f.name for f in dataclass_fields(BaselineConfig)}
    if cfg["micro_batch"] is None:
        raise ConfigError("--memory_plan needs --micro_batch (the sequences of one forward pass on "
                          "one GPU)")
    if cfg["vocab_size"] is None:
        try:
            cfg["vocab_size"] = load_meta(Path(cfg["data_root"]) / cfg["dataset"])["vocab_size"]
        except DataError as e:
            raise ConfigError(f"--memory_plan needs --vocab_size, or the prepared data of "
                              f"--dataset={cfg['dataset']} to read it") from e
    with torch.device("meta"):  # a bad shape: model.ConfigError
        config = build_model({k: v for k, v in cfg.items() if k in fields}).config
    print(report(config, cfg["micro_batch"], cfg["block_size"], bf16=cfg["dtype"] != "float32"))
