"""
Train a Depth-Attention decoder (or vanilla, or a baseline of baselines.py) on token files.

    python train.py                                    # the Shakespeare demo, minutes on a CPU
    python train.py configs/minipile_value.py --max_iters=100
    python train.py configs/minipile_value.py --resume   # continue out_dir's checkpoint exactly
    torchrun --standalone --nproc_per_node=8 train.py configs/paper_3b_value.py [--parallel=fsdp]
    python train.py --init_from=zeng123/Depth-attention-3B --dataset=pile_neox  # trained weights

The model's keys (model.ModelConfig's; baselines.BaselineConfig's once named) and the training keys
below are one namespace; config files and --key=value apply in order. Batch `step` is drawn from a
generator seeded with (seed, step) over the global batch, each rank taking its slice, so the world
size, gradient accumulation and resuming leave the losses unchanged.
"""
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import functools
import inspect
import json
import re
import math
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, get_args

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from checkpoint import SHARDED, build_model
from configurator import (CheckpointError, ConfigError, DataError, Key, UserError, nearest, parse,
                          reason, resolve_device, run_main, unknown_key, updates)
from data import load_meta, read_tokens
from model import DEPTH_MODES, Attention, ModelConfig
from outputs import (DiskFull, append_line, lock_run_folder, run_folder, save_checkpoint,
                     write_atomically)
from tokenizer import from_record, get_tokenizer, same_tokenizer, tokenizer_record

SAME = dict(result=False)  # a key that changes no number the run reports
KEYS = {  # the paper's recipe (section 3): AdamW, 2% warmup, cosine to 0.1 x peak, clip 1.0
    "dataset": Key("shakespeare", "<data_root>/<dataset>/: {train,val}.bin, meta.json", path=True),
    "data_root": Key("data", "the folder that holds the prepared datasets", path=True),
    "out_dir": Key("out/shakespeare", "the run's folder", path=True, per_invocation=True, **SAME),
    "seed": Key(1337, "model init and the batch sequence", "in [0, 2**63)"),
    "batch_tokens": Key(4096, "tokens per step, all ranks (paper: 1024 x 2048)", ">= 1"),
    "micro_batch": Key(None, "sequences per forward on a rank; None = its whole share", ">= 1", kind=int, **SAME),
    "max_iters": Key(400, "optimizer steps; the LR schedule spans exactly these", ">= 1"),
    "learning_rate": Key(3e-3, "peak LR (paper: 1e-3 at 1.5B/3B, 3e-4 at 410M)", "> 0"),
    "weight_decay": Key(0.1, "on matrices only; norms and other 1-D parameters get none", ">= 0"),
    "beta1": Key(0.9, "AdamW first-moment decay", "in [0, 1)"),
    "beta2": Key(0.95, "AdamW second-moment decay", "in [0, 1)"),
    "adam_eps": Key(1e-8, "AdamW epsilon", "> 0"),
    "grad_clip": Key(1.0, "max global grad norm; 0 = no clipping", ">= 0"),
    "lime_router_lr_mult": Key(10.0, "depth_mode=lime: the routers' LR / the LR, no decay", "> 0"),
    "warmup_frac": Key(0.02, "linear warmup over this fraction of max_iters", "in [0, 1]"),
    "min_lr_ratio": Key(0.1, "cosine floor as a fraction of the peak LR", "in [0, 1]"),
    "eval_interval": Key(100, "steps between evaluations (also at step 0 and the end)", ">= 0"),
    "eval_seqs": Key(64, "fixed validation windows, evenly spaced over val.bin", ">= 1"),
    "log_interval": Key(25, "steps between printed lines (log.jsonl: every step)", ">= 1", **SAME),
    "ckpt_interval": Key(None, "steps between checkpoints; None = each eval; 0 = the end", ">= 0", kind=int, **SAME),
    "stop_at_step": Key(0, "end after this step with a checkpoint, keeping max_iters' schedule", ">= 0", **SAME),
    "resume": Key(False, "continue out_dir's checkpoint", per_invocation=True, **SAME),
    "init_from": Key("", "start from these weights, fresh optimizer: an out_dir, a ckpt.pt, a HF folder or hub id"),
    "init_lr": Key("last", "--init_from a finished run: re-warm to its final rate, or peak", choices=("last", "peak")),
    "overwrite": Key(False, "start over where a checkpoint is, deleting it", per_invocation=True, **SAME),
    "sample_tokens": Key(200, "tokens sampled at the end; 0 = none", ">= 0", **SAME),
    "sample_prompt": Key("", "\"\" = start from end-of-text, like a new document", **SAME),
    "device": Key("auto", "auto = cuda, then mps, then cpu"),
    "dtype": Key("auto", "auto = bf16 autocast on CUDA, else float32", choices=("auto", "float32", "bfloat16")),
    "compile": Key(False, "torch.compile the training forward (slow to start on CPU)", **SAME),
    "parallel": Key("ddp", "under torchrun: ddp, or fsdp (sharded)", choices=("ddp", "fsdp"), **SAME),
    "activation_checkpointing": Key(False, "recompute each block in the backward pass", **SAME),
    "peak_flops": Key(0.0, "a device's peak FLOP/s for MFU; 0 = a known GPU's", ">= 0", **SAME),
    "memory_plan": Key(False, "print the per-GPU memory of ddp / fsdp and exit", per_invocation=True, **SAME),
    "wandb_log": Key(False, "log to Weights & Biases (pip install wandb)", **SAME),
    "wandb_project": Key("depth-attention", "the wandb project", **SAME),
    "wandb_run_name": Key("", "\"\" = the out_dir's name", **SAME),
}
DEMO = dict(block_size=256, n_layer=6, n_head=4, n_kv_head=2, head_dim=32, n_embd=128,
            mlp_hidden=384)  # the model keys' defaults: the Shakespeare demo, 1.25M parameters
GPU_PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H100 PCIe": 756e12, "H200": 989e12,
                  "B200": 2250e12, "L4": 121e12, "L40S": 362e12}  # bf16 dense, datasheets


# ----------------------------------------------------------------------------- the run's config

def dataclass_keys(cls, **defaults) -> dict:
    """A config dataclass's fields as keys: the default (or defaults'), the field's one-line
    comment as the help, an Optional field's type as its kind."""
    comments = {}
    for c in reversed(cls.__mro__[:-1]):
        comments.update(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(c), re.M))
    return {f.name: Key(defaults.get(f.name, f.default), comments.get(f.name, ""),
                        kind=(get_args(f.type) or (None,))[0]) for f in fields(cls)}


def read_config_file(path, known, _seen=()) -> dict:
    """The assignments of a config file (after its base_config's), each a key of known: configs/
    holds train.py's (bench_cache.py and lab/ablate.py read them too)."""
    path = Path(path).expanduser()
    if not os.path.isfile(path):  # (False for a name too long, where Path's raises)
        near = nearest(path.name, [p.name for p in path.parent.glob("*.py")])
        raise ConfigError(f"config file {path} not found; " + (
            f"did you mean {path.with_name(near)}?" if near else "configs/ holds the shipped ones"))
    if path.resolve() in _seen:
        raise ConfigError(f"config file {path} includes itself through base_config")
    scope = {}
    try:
        exec(compile((raw := path.read_bytes()).decode("utf-8"), str(path), "exec"), {}, scope)
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}, line {raw.count(10, 0, e.start) + 1}: not UTF-8 "
                          f"(byte {raw[e.start]:#04x}); save it as UTF-8") from None
    except Exception as e:  # a syntax error or a failing expression: the file's line
        tb = e.__traceback__
        while tb and tb.tb_frame.f_code.co_filename != str(path):
            tb = tb.tb_next
        line = e.lineno if isinstance(e, SyntaxError) else tb and tb.tb_lineno
        raise ConfigError(f"config file {path}, line {line or '?'}: {type(e).__name__}: {e}; "
                          f"config files hold assignments such as `n_layer = 12`") from None
    base = scope.pop("base_config", None)
    own = {k: v for k, v in scope.items() if not k.startswith("_")}
    if unknown := sorted(own.keys() - set(known)):
        raise unknown_key(unknown[0], known, f"config file {path}: ")
    if base is not None and not (isinstance(base, str) and base.strip()):
        raise ConfigError(f"config file {path}: base_config names a file in quotes, such as "
                          f"base_config = \"base.py\", not {base!r}")
    return {**read_config_file(path.parent / base, known, (*_seen, path.resolve())),
            **own} if base else own


@functools.lru_cache(maxsize=None)
def table(baselines=False) -> dict:
    """Every key: the model's (BaselineConfig's with baselines) at the demo's sizes, then KEYS."""
    cls = __import__("baselines").BaselineConfig if baselines else ModelConfig
    model = dataclass_keys(cls, **DEMO)
    model["vocab_size"] = Key(None, "None = the data's vocabulary (meta.json)", kind=int)
    model["depth_mode"] = Key("value", model["depth_mode"].help, choices=tuple(DEPTH_MODES))
    if baselines:
        from baselines import ATTENTIONS, BASELINES
        for name, choices in (("residual", ("add", *BASELINES)), ("attention", tuple(ATTENTIONS))):
            model[name] = Key(model[name].default, model[name].help, choices=choices)
    return {**model, **KEYS}


def parse_args(argv, base=None) -> dict:
    """The config argv asks for (over base: a resumed run's), checked before anything is read;
    baselines.py's keys and rows join the table once the command names one."""
    try:
        cfg = parse(argv, table("-h" in argv or "--help" in argv), __doc__, base, read_config_file)
        if not (base or {}).keys() - table().keys():
            return cfg
    except ConfigError:
        pass  # a key or depth_mode of baselines.py's, or the same error once more below
    return parse(argv, table(baselines=True), __doc__, base, read_config_file)


def resolve(argv, master=True):
    """(cfg, ckpt, init): the run argv asks for, and the checkpoint it continues (--resume) or the
    weights it starts from (--init_from): lab/continued.py."""
    cfg = parse_args(argv)
    run_folder(cfg["out_dir"], cfg["resume"], cfg["init_from"])  # before anything is read
    ckpt = init = None
    if cfg["resume"]:
        from lab.continued import resume  # only for --resume
        cfg, ckpt = resume(cfg, argv, table(True), parse_args)
    elif cfg["init_from"]:
        from lab.continued import start_from  # only for --init_from
        init = start_from(cfg, {k for k, _ in updates(argv, table(True), read_config_file)},
                          master)
    resolve_device(cfg["device"])
    batch_layout(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # and the model's shape: before
    with torch.device("meta"):  # any file is written (vocab_size None: the data's, later)
        build_model({k: v for k, v in cfg.items() if k not in KEYS} | {
            "vocab_size": cfg["vocab_size"] or 1})
    return cfg, ckpt, init


def main(argv):
    cfg, ckpt, init = resolve(argv, master=os.environ.get("RANK", "0") == "0")
    if cfg["memory_plan"]:
        from lab.memory import print_plan
        return print_plan(cfg)
    proc = setup_process(cfg)
    lock = lock_run_folder(cfg["out_dir"], ckpt is not None, cfg["overwrite"],
                           cfg["init_from"]) if proc.master else None  # held until the exit
    if proc.master and ckpt is None:  # as nanoGPT: the keys off their defaults
        keys = table(cfg.keys() != table().keys())  # once: not for every key
        print("\n".join(f"{k} = {v!r}" for k, v in cfg.items() if v != keys[k].default))
    run = start(cfg, ckpt, init, proc)
    del ckpt, init
    stopped_by = train_loop(run)
    finish(run, stopped_by)
    if proc.distributed:  # free FSDP's state (its mesh holds the group) while the interpreter is
        del run           # whole, then leave together: a rank that leaves first aborts the others
        dist.barrier()
        dist.destroy_process_group()
    del lock
    if stopped_by:
        sys.exit(128 + stopped_by)  # the shell's "ended by a signal": the run is not finished


# ----------------------------------------------------------------------------- data and model

def open_data(cfg, master):
    """train.bin and val.bin memory-mapped; the embedded Shakespeare prepared on first use."""
    data_dir = Path(cfg["data_root"]) / cfg["dataset"]
    if not (data_dir / "meta.json").exists():
        if cfg["dataset"] != "shakespeare":
            near = nearest(cfg["dataset"], {d.parent.name for d in Path(cfg["data_root"])
                                            .glob("*/meta.json")} | {"shakespeare"})
            hint = f"did you mean --dataset={near}? else " if near else ""
            raise DataError(f"no prepared data at {data_dir}: {hint}run `python prepare_data.py "
                            f"SOURCE --name {data_dir.name} --out_dir {data_dir.parent}` first")
        if master:  # the README's first command, in a child (its pool never forks torch)
            heard, handler = [], signal.getsignal(signal.SIGINT)  # the child says its Ctrl-C:
            if handler != signal.SIG_IGN:  # a handler, unlike SIG_IGN, is not inherited
                signal.signal(signal.SIGINT, lambda signum, frame: heard.append(1))
            code = subprocess.run([sys.executable, Path(__file__).with_name("prepare_data.py"),
                                   "shakespeare", f"--out_dir={cfg['data_root']}"]).returncode
            signal.signal(signal.SIGINT, handler)
            if code or heard:  # its own line said, or a Ctrl-C before its first line (unheard)
                raise SystemExit(code) if code not in (0, -signal.SIGINT) else KeyboardInterrupt
        if dist.is_initialized():
            dist.barrier()
    meta = load_meta(data_dir)
    train, val = (read_tokens(data_dir, split, meta) for split in ("train", "val"))
    for split, data in (("train", train), ("val", val)):
        if len(data) <= cfg["block_size"]:
            raise DataError(f"{data_dir}/{split}.bin has {len(data)} tokens, but a window needs "
                            f"block_size + 1 = {cfg['block_size'] + 1}; lower --block_size")
    return data_dir, meta, train, val


def train_offsets(seed, step, n_rows, n_tokens, T):
    """The global batch of `step`: n_rows window starts, a function of (seed, step) alone."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - T, size=n_rows)


def get_batch(data, offsets, T, device, vocab_size):
    """Inputs and next-token targets of the windows at offsets, two (len(offsets), T) tensors; an
    id beyond the vocabulary (a .bin that does not match its meta.json) is a DataError."""
    windows = np.stack([data[o:o + T + 1] for o in offsets]).astype(np.int64)  # (B, T + 1)
    if windows.max() >= vocab_size:
        raise DataError(f"{data.filename} holds token id {windows.max()}, beyond vocab_size "
                        f"{vocab_size}: it does not match its meta.json; rebuild it with --force")
    x, y = torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])
    if device.startswith("cuda"):
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def build(cfg, meta, data_dir, ckpt, init):
    """The model from the seed, or with init's weights; the data in the weights' tokenizer."""
    enc = init.tokenizer if init else from_record(ckpt) if ckpt else None
    if enc is not None and not same_tokenizer(get_tokenizer(meta["tokenizer"]), enc):
        raise DataError(f"{data_dir} was tokenized with {meta['tokenizer']}, but the model reads "
                        f"{enc.name}: prepare the data with the model's tokenizer, or give the "
                        f"run's own --dataset")
    cfg["vocab_size"] = cfg["vocab_size"] or meta["vocab_size"]
    needed = max(meta["vocab_size"], meta.get("max_token_id", -1) + 1)
    if cfg["vocab_size"] < needed:
        raise DataError(f"{data_dir} holds token ids up to {needed - 1}, beyond vocab_size="
                        f"{cfg['vocab_size']}: " + ("continue the run on its own data" if ckpt
                                                    else f"set --vocab_size={needed} or None"))
    torch.manual_seed(cfg["seed"])
    model = build_model({k: v for k, v in cfg.items() if k not in KEYS})
    if init is not None:
        model.load_state_dict(init.model.state_dict())  # into this model's float32 parameters
    return model


def make_optimizer(model, cfg, device):
    """AdamW, decay on matrices only; a module's `optimizer_group` (LIMe's routers) is a group of
    its own: its options, and lr_mult, a multiple of the scheduled lr (a number, or a key of cfg)."""
    declared = {}  # the declaration (as a key) -> its parameters, in the modules' order
    for module in model.modules():
        if hasattr(module, "optimizer_group"):
            key = tuple(sorted(module.optimizer_group.items()))
            declared.setdefault(key, []).extend(module.parameters())
    claimed = {id(p) for params in declared.values() for p in params}
    rest = [p for p in model.parameters() if id(p) not in claimed]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    mults = [1, 1]
    for key, params in declared.items():
        options = dict(key)
        mults.append(options.pop("lr_mult", 1))
        groups.append({"params": list({id(p): p for p in params}.values()), **options})
    optimizer = torch.optim.AdamW(groups, lr=cfg["learning_rate"], betas=(cfg["beta1"],
                                  cfg["beta2"]), eps=cfg["adam_eps"], fused=device.startswith("cuda"))
    optimizer.lr_mults = mults  # from cfg on every start, so a resume may change them
    return optimizer


def lr_at(step, cfg):
    """Linear warmup over warmup_frac of max_iters, then a cosine to min_lr_ratio x the peak."""
    peak, warmup = cfg["learning_rate"], round(cfg["warmup_frac"] * cfg["max_iters"])
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg["max_iters"] - warmup)
    floor = peak * cfg["min_lr_ratio"]
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- processes

@dataclass
class Process:
    """Where this process runs: its rank of `world` (torchrun), its device, bf16 autocast."""
    rank: int
    world: int
    device: str
    bf16: bool
    distributed: bool
    master = property(lambda self: self.rank == 0)

    def autocast(self):
        return torch.autocast(self.device.split(":")[0], torch.bfloat16) if self.bf16 else nullcontext()


def setup_process(cfg) -> Process:
    """Join torchrun's process group (RANK set); this process's device and precision."""
    distributed = "RANK" in os.environ
    device = resolve_device(cfg["device"], int(os.environ.get("LOCAL_RANK", 0)) if distributed
                            else None)
    if cfg["parallel"] == "fsdp" and not distributed:
        raise ConfigError("--parallel=fsdp shards the model over torchrun's processes: launch "
                          "`torchrun --standalone --nproc_per_node=N train.py ...` (N = 1 too)")
    if distributed and device == "mps":
        raise ConfigError("multi-process training runs on cuda or cpu; use --device=cpu")
    if distributed:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast
    bf16 = cfg["dtype"] == "bfloat16" or (cfg["dtype"] == "auto" and device.startswith("cuda")
                                          and torch.cuda.is_bf16_supported())
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return Process(rank, world, device, bf16, distributed)


class Parallel:
    """The model as trained: `forward` is what a step calls (the model, or DDP's wrapper; FSDP
    shards it in place: lab/fsdp.py); gradients reduced on a step's last micro-step, clipped."""

    def __init__(self, model, mode, proc: Process):
        self.model, self.mode, self.forward = model, mode if proc.distributed else "single", model
        if self.mode == "fsdp":
            from lab.fsdp import Sharded
            self.sharded = Sharded(model, proc.bf16)
        if self.mode == "ddp":  # gradients as views of the all-reduce buckets: no second copy
            ids = [torch.cuda.current_device()] if proc.device.startswith("cuda") else None
            self.forward = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=ids, gradient_as_bucket_view=True)

    def gradient_sync(self, sync):
        if self.mode == "fsdp":
            self.model.set_requires_gradient_sync(sync)
        return self.forward.no_sync() if self.mode == "ddp" and not sync else nullcontext()

    def clip(self, max_norm) -> float:  # the global norm, before clipping (0: none)
        if self.mode == "fsdp":
            return self.sharded.clip(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              max_norm or float("inf")).item()


class StopSignals:
    """Ctrl-C or SIGTERM (a scheduler's) stops the run after the step in flight, with a checkpoint,
    exit 128 + the signal; a second Ctrl-C at once (KeyboardInterrupt: the last checkpoint stays)."""

    def __init__(self):
        self.received = 0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt("the last checkpoint is intact: continue with --resume=True")
        self.received = self.received or signum

    def agreed(self, proc) -> int:
        """The signal any rank received (0: none): every rank stops after the same step."""
        if not proc.distributed:
            return self.received
        flag = torch.tensor(self.received, device=proc.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


# ----------------------------------------------------------------------------- the loop

@dataclass
class Run:
    """What the loop works on. par: the model's DDP/FSDP form, fwd its forward (maybe compiled);
    mb, accum, rows: the micro batch, micro-steps and sequences a step; record: what describes the
    run in every checkpoint; t0: when it began; first: (step, time) of this invocation's first."""
    cfg: dict
    proc: Process
    model: torch.nn.Module
    par: Parallel
    optimizer: torch.optim.Optimizer
    fwd: object
    train: np.ndarray
    val: np.ndarray
    val_offsets: np.ndarray
    mb: int
    accum: int
    rows: int
    record: dict
    mfu: float  # MFU per token a second: 6N + attention's FLOPs / the devices' peak (0: unknown)
    t0: float
    wandb: object = None
    step: int = 0
    best_val: float = float("inf")
    last_ckpt: Optional[int] = None
    first: tuple = ()
    log_kept: str = ""  # a resumed run's log.jsonl, up to its checkpoint's step

    @property
    def ckpt_path(self) -> Path:
        return Path(self.cfg["out_dir"]) / (SHARDED if self.par.mode == "fsdp" else "ckpt.pt")


def batch_layout(cfg, world):
    """(micro_batch, micro-steps, rows): rows = batch_tokens / block_size sequences a step, a rank
    rows / world in passes of micro_batch (any layout: the same run, to float rounding)."""
    T, tokens = cfg["block_size"], cfg["batch_tokens"]
    if tokens % (T * world):
        near = max(1, round(tokens / (T * world))) * T * world
        raise ConfigError(f"batch_tokens={tokens} must be a multiple of block_size * world_size = "
                          f"{T} * {world}; --batch_tokens={near} is the nearest (another run)")
    share = tokens // T // world
    mb = cfg["micro_batch"] or share
    if share % mb:
        fits = max(d for d in range(1, min(mb, share) + 1) if share % d == 0)
        raise ConfigError(f"micro_batch={mb} must divide this rank's share of the batch, {share} "
                          f"sequences; --micro_batch={fits} keeps the run, to float rounding")
    return mb, share // mb, tokens // T


def start(cfg, ckpt, init, proc) -> Run:
    """The data, the model in its parallel form, the optimizer, a resumed run's state, the log."""
    mb, accum, rows = batch_layout(cfg, proc.world)
    data_dir, meta, train, val = open_data(cfg, proc.master)
    model = build(cfg, meta, data_dir, ckpt, init).to(proc.device)
    c, T = model.config, cfg["block_size"]  # (before FSDP shards it: the whole model)
    name = torch.cuda.get_device_name(proc.device) if proc.device.startswith("cuda") else ""
    peak = cfg["peak_flops"] or max(((len(k), v) for k, v in GPU_PEAK_FLOPS.items() if k in name),
                                    default=(0, 0))[1]  # the longest name that matches
    flops = 6 * model.num_params() * c.n_loops + 12 * c.n_eff_layer * c.n_head * c.head_dim * T
    if cfg["activation_checkpointing"]:  # each unit recomputed in the backward pass
        from baselines import wrap_units
        wrap_units(model)
    par = Parallel(model, cfg["parallel"], proc)
    run = Run(cfg, proc, model, par, make_optimizer(model, cfg, proc.device),
              torch.compile(par.forward) if cfg["compile"] else par.forward, train, val,
              np.linspace(0, len(val) - T - 1, cfg["eval_seqs"]).round().astype(np.int64), mb,
              accum, rows, {"config": {**cfg, "resumes": ckpt["resumes"] if ckpt else []},
                            "model_config": asdict(c), **tokenizer_record(meta["tokenizer"]),
                            "data_dir": str(data_dir)}, flops / (peak * proc.world) if peak else 0,
              time.monotonic())
    if ckpt is not None:
        from lab.continued import restore
        restore(run, ckpt)
    if proc.master:
        run.wandb = start_log(run)
        print(f"{model.num_params() / 1e6:.2f}M parameters | {proc.device} "
              f"{'bf16' if proc.bf16 else 'fp32'} | world {proc.world} | {accum} micro-steps of "
              f"{mb} x {T} tokens per rank | data {data_dir} ({len(train)} train / {len(val)} "
              f"val tokens)")
    return run


def train_loop(run: Run) -> int:
    """Steps to max_iters, evaluating and saving as cfg says; the signal that stopped it, else 0."""
    cfg, proc = run.cfg, run.proc
    every_ckpt = cfg["eval_interval"] if cfg["ckpt_interval"] is None else cfg["ckpt_interval"]
    if run.step == 0 and cfg["eval_interval"] > 0:
        evaluation(run)
    bar = tqdm(total=cfg["max_iters"], initial=run.step, unit="step",
               disable=not proc.master or None)
    signals, stopped_by = StopSignals(), 0
    try:  # the handlers go back however the loop ends
        while run.step < cfg["max_iters"]:
            lr = one_step(run)
            bar.update()
            step, last = run.step, run.step == cfg["max_iters"]
            if last or (cfg["eval_interval"] > 0 and step % cfg["eval_interval"] == 0):
                evaluation(run)
            stopped_by = signals.agreed(proc) if not last else 0  # a finished run is just done
            stopping = step == cfg["stop_at_step"] or stopped_by
            if (every_ckpt and step % every_ckpt == 0) or last or stopping:
                save(run, lr)
            if stopping:
                if proc.master and not stopped_by:
                    tqdm.write(f"stopping at step {step} (stop_at_step); continue with "
                               f"--resume=True")
                break
    finally:
        bar.close()
        for s, handler in signals.previous.items():
            signal.signal(s, handler)
    return stopped_by


def one_step(run: Run) -> float:
    """One optimizer step on the global batch of run.step (this rank's rows), logged with its
    speed (MFU where a peak is known, the ETA). Returns its learning rate."""
    cfg, proc, T = run.cfg, run.proc, run.cfg["block_size"]
    t0, lr = time.perf_counter(), lr_at(run.step, cfg)
    for group, mult in zip(run.optimizer.param_groups, run.optimizer.lr_mults):
        group["lr"] = lr * (cfg[mult] if isinstance(mult, str) else mult)
    mine = slice(proc.rank * run.mb * run.accum, (proc.rank + 1) * run.mb * run.accum)
    offsets = train_offsets(cfg["seed"], run.step, run.rows, len(run.train), T)[mine]
    batches = (get_batch(run.train, offsets[m * run.mb:(m + 1) * run.mb], T, proc.device,
                         run.model.config.vocab_size) for m in range(run.accum))
    loss, grad_norm = train_step(run.fwd, run.par, batches, run.accum, cfg["grad_clip"], proc)
    if not math.isfinite(loss + grad_norm):  # before the update reaches the weights
        raise diverged(run.step + 1, f"train_loss {loss}, grad_norm {grad_norm}", lr,
                       run.last_ckpt)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    now = time.perf_counter()  # the .item()s above waited for the device: no sync here
    run.first = run.first or (run.step, now)
    pace = (now - run.first[1]) / (run.step - run.first[0]) if run.step > run.first[0] else now - t0
    record = {"kind": "train", "step": run.step, "train_loss": loss, "lr": lr,
              "grad_norm": grad_norm, "tok_per_s": cfg["batch_tokens"] / (now - t0),
              "elapsed_s": time.monotonic() - run.t0, "eta_s": pace * (cfg["max_iters"] - run.step)}
    if run.mfu:
        record["mfu"] = run.mfu * record["tok_per_s"]
    if proc.master:
        log(run, record)
        if run.step % cfg["log_interval"] == 0 or run.step == cfg["max_iters"]:
            mfu = f" | mfu {100 * record['mfu']:.1f}%" if run.mfu else ""
            tqdm.write(f"step {run.step}/{cfg['max_iters']} | train_loss {loss:.4f} | lr "
                       f"{lr:.2e} | grad_norm {grad_norm:.3f} | tok/s {record['tok_per_s']:.0f}"
                       f"{mfu} | eta {clock(record['eta_s'])}")
    return lr


def train_step(fwd, par, batches, accum, grad_clip, proc):
    """Forward and backward over the micro-batches, gradients reduced on the last, clipped.
    Returns (the mean loss over all ranks, the global grad norm before clipping)."""
    loss_sum = torch.zeros((), device=proc.device)
    for micro, (x, y) in enumerate(batches):
        with par.gradient_sync(micro == accum - 1):
            with proc.autocast():
                _, loss = fwd(x, y)
            (loss / accum).backward()
        loss_sum += loss.detach()
    if proc.distributed:
        dist.all_reduce(loss_sum)
    return loss_sum.item() / (accum * proc.world), par.clip(grad_clip)


def diverged(step, what, lr, saved) -> UserError:
    return UserError(f"training diverged at step {step} ({what}, lr {lr:.3g}); " + (
        f"its last checkpoint (step {saved}) is kept: lower --learning_rate and continue it with "
        f"--resume=True, or start over with --overwrite=True" if saved is not None
        else "rerun with a lower --learning_rate"))


def clock(seconds) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@torch.no_grad()
def evaluation(run: Run):
    """The mean validation loss over the fixed windows (each rank its slice, summed in float64) and
    each layer's mean depth weight on each candidate (Figure 3), logged. Every rank runs as many
    forwards (FSDP gathers with all): one short of windows rescores one, uncounted."""
    proc, model, offsets, T = run.proc, run.model, run.val_offsets, run.cfg["block_size"]
    model.eval()
    mine = np.array_split(offsets, proc.world)[proc.rank]
    sums, weights = [0.0, 0], {}  # (sum of token losses, tokens); {(e, c): sum over windows}
    for i in range(0, math.ceil(len(offsets) / proc.world), run.mb):
        chunk = mine[i:i + run.mb]
        x, y = get_batch(run.val, chunk if len(chunk) else offsets[:1], T, proc.device,
                         model.config.vocab_size)
        with proc.autocast(), capture_depth_weights(model) as alphas:
            _, loss = model(x, y)
        if len(chunk):
            sums = [sums[0] + loss.item() * y.numel(), sums[1] + y.numel()]
        for e, (src, alpha) in sorted(alphas.items()):  # every rank every key, in order
            means = alpha[:len(chunk)].double().mean(dim=(1, 3)).sum(0).tolist()  # per candidate
            for c, w in zip(src + [e], means):
                weights[e, c] = weights.get((e, c), 0.0) + w
    if proc.distributed:
        total = torch.tensor(sums + list(weights.values()), dtype=torch.float64, device=proc.device)
        dist.all_reduce(total)
        sums, weights = total[:2].tolist(), dict(zip(weights, total[2:].tolist()))
    model.train()
    val_loss = sums[0] / sums[1]
    run.best_val = min(run.best_val, val_loss)
    if proc.master:
        record = {"kind": "eval", "step": run.step, "val_loss": val_loss,
                  "elapsed_s": time.monotonic() - run.t0}
        for (e, c), w in weights.items():  # {"layer": {"candidate": mean weight}}
            record.setdefault("depth_weights", {}).setdefault(str(e), {})[str(c)] = \
                round(w / len(offsets), 5)
        log(run, record)
        tqdm.write(f"eval step {run.step} | val_loss {val_loss:.4f}")


@contextmanager
def capture_depth_weights(model):
    """Within: {effective layer e: (S(e), alpha (B, n_kv_head, C, T) float32)} of every forward
    (the decode kernel, which computes none, off); empty for a model without per-token weights."""
    sink, attns = {}, [m for m in model.modules() if isinstance(m, Attention)]
    for m in attns:
        m.weights_sink = lambda e, alpha: sink.__setitem__(e, (model.depth_sources[e], alpha.detach()))
    try:
        yield sink
    finally:
        for m in attns:
            m.weights_sink = None


# ----------------------------------------------------------------------------- logs, checkpoints

def start_log(run: Run):
    """config.json, log.jsonl cut back to the checkpoint's step; wandb with --wandb_log."""
    out = Path(run.cfg["out_dir"])
    kept = run.log_kept if run.step else ""  # a resumed run's: lab/continued.py
    write_atomically(out / "config.json", json.dumps(run.record["config"], indent=1) + "\n")
    write_atomically(out / "log.jsonl", kept)
    if run.cfg["wandb_log"]:
        from lab.tracking import Wandb
        return Wandb(run.cfg)


def log(run: Run, record):
    """One line of log.jsonl, whole or not at all (and wandb's)."""
    append_line(Path(run.cfg["out_dir"]) / "log.jsonl", json.dumps(record))
    if run.wandb:
        run.wandb.log(record)


def save(run: Run, lr):
    """The checkpoint of run.step, never of a diverged model: ckpt.pt from rank 0, or under FSDP
    ckpt.dcp, each rank its shards (lab/fsdp.py)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in run.model.parameters()]
    finite = torch.stack([p.isfinite().all() for p in local]).all().to(torch.int32)
    if run.proc.distributed:  # every rank's shard
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite:
        raise diverged(run.step, "non-finite weights", lr, run.last_ckpt)
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"step": run.step, "best_val_loss": run.best_val, **run.record,
             "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                     "numpy": [kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss],
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
             "elapsed_s": time.monotonic() - run.t0}
    try:
        if run.par.mode == "fsdp":
            run.par.sharded.save(run.optimizer, state, run.cfg["out_dir"], run.proc.master)
        elif run.proc.master:
            save_checkpoint({"model": run.model.state_dict(),
                             "optimizer": run.optimizer.state_dict(), **state}, run.ckpt_path)
    except (OSError, RuntimeError, UserError) as e:  # a full disk, a lost rank (lab.fsdp's)
        kept, then = ((f"the checkpoint of step {run.last_ckpt} is kept", "continue with "
                       "--resume=True") if run.last_ckpt is not None else ("none is kept", "rerun"))
        why = "a rank stopped meanwhile" if getattr(e, "peer_lost", False) else reason(e)
        raise CheckpointError(f"could not write {run.ckpt_path} at step {run.step} ({why}); {kept}: "
                              f"{f'{e.free}, then ' if isinstance(e, DiskFull) else ''}{then}") from None
    run.last_ckpt = run.step


def finish(run: Run, stopped_by):
    """A finished run's sample (FSDP: every rank generates, a bf16 cache under mixed precision),
    and the last line: where the checkpoint is."""
    cfg, proc, device = run.cfg, run.proc, run.proc.device
    if cfg["sample_tokens"] and run.step == cfg["max_iters"] and (proc.master or
                                                                  run.par.mode == "fsdp"):
        enc = from_record(run.record)
        prompt = enc.encode(cfg["sample_prompt"], allowed_special="all") or [enc.eot_token]
        n_new = min(cfg["sample_tokens"], cfg["block_size"] - len(prompt))
        if n_new > 0:
            out = run.model.generate(
                torch.tensor([prompt], device=device), n_new, temperature=0.8, top_k=200,
                generator=torch.Generator(device=device).manual_seed(cfg["seed"]),
                cache_dtype=torch.bfloat16 if run.par.mode == "fsdp" and proc.bf16 else None)
            if proc.master:
                print(f"sample ({n_new} tokens):\n{enc.decode(out[0].tolist())}")
    if proc.master and stopped_by:
        print(f"stopped by {signal.Signals(stopped_by).name} after step {run.step}, saved to "
              f"{run.ckpt_path}; continue with the same command and --resume=True", file=sys.stderr)
    elif proc.master:
        peak = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated on the GPU"
                if device.startswith("cuda") else
                f"{__import__('resource').getrusage(0).ru_maxrss / 2**20:.2f} GiB resident")
        print(f"done: step {run.step} in {clock(time.monotonic() - run.t0)} | best val_loss "
              f"{run.best_val:.4f} | checkpoint {run.ckpt_path} | peak {peak}")
    if run.wandb:
        run.wandb.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
