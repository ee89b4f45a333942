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
import math
import os
import signal
import sys
import time
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
from support.cli import ConfigError, fail, not_in_a_checkpoint, resolve_device
from support.config import check_ranges, parse_config
from support.batches import get_batch, open_data, train_offsets
from support.depth_weights import as_record, capture, weight_sums
from support.parallel import (PARALLEL, Parallel, Process, checkpoint_activations,
                              setup_process)
from support.runlog import diverged, log, save_failed, start_log, stop
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


def lr_at(step, cfg):
    """Linear warmup over warmup_frac of max_iters, then cosine from the peak to min_lr_ratio x
    the peak."""
    peak, warmup = cfg["learning_rate"], round(cfg["warmup_frac"] * cfg["max_iters"])
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg["max_iters"] - warmup)
    floor = peak * cfg["min_lr_ratio"]
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- the run's pieces

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
    for i in range(0, math.ceil(len(offsets) / proc.world), mb):
        chunk = mine[i:i + mb]
        x, y = get_batch(val, chunk if len(chunk) else offsets[:1], T, proc.device,
                         model.config.vocab_size)
        with proc.autocast(), capture(model) as alphas:
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

@dataclass
class Run:
    """What the training loop works on (start() sets it up): the model as trained (par: DDP or
    FSDP around it; fwd: par's forward, compiled or not), the data and the batch layout, where
    the run stands, and where it writes."""
    cfg: dict
    proc: Process
    model: GPT
    par: Parallel
    optimizer: torch.optim.Optimizer
    fwd: object
    train: np.ndarray
    val: np.ndarray
    val_offsets: np.ndarray  # the fixed validation windows: every eval, run and world size
    mb: int                  # micro_batch
    accum: int               # micro-steps per step
    rows: int                # sequences in the global batch
    step: int
    best_val: float
    last_ckpt: object        # the step of the last checkpoint written, or None
    record: dict             # saved with every checkpoint: what describes the whole run
    out_dir: Path
    wandb: object
    enc: object              # the end-of-run sample's tokenizer, or None


def main(argv):
    cfg, ckpt = resolve_config(argv)
    if cfg["memory_plan"]:  # the micro batch as train.py would take it, at this launch's world size
        if cfg["micro_batch"] is not None:
            batch_layout(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        return memory.print_plan(cfg, MODEL_KEYS)
    proc = setup_process(cfg)
    lock = claim(cfg, ckpt) if proc.master else None  # held until the process exits
    run = start(cfg, ckpt, proc)
    del ckpt
    stopped_by = train_loop(run)
    finish(run, stopped_by)
    if proc.distributed:
        # Free the model, its optimizer and FSDP's state (its device mesh holds the process group)
        # while the interpreter is whole: left to the exit, the group's threads end in teardown,
        # the likely cause of a finished run aborting once under load ("terminate called without
        # an active exception" after done:).
        del run
        gc.collect()
        dist.barrier()  # under gloo, a rank that leaves first can abort the others
        dist.destroy_process_group()
    if stopped_by:
        sys.exit(128 + stopped_by)  # the shell's "ended by a signal": the run is not finished


def start(cfg, ckpt, proc) -> Run:
    """The data, the model (--init_from sets the model keys) on its device and in its parallel
    wrapper, the optimizer, the state of a resumed run, config.json and the log."""
    history = config_history(cfg, ckpt, proc.master)
    data_dir, meta, train, val = open_data(cfg, proc.master)
    model, model_config, enc, tokenizer = build(cfg, meta, data_dir, ckpt, proc.master)
    model.to(proc.device)
    mb, accum, rows = batch_layout(cfg, proc.world)
    if cfg["activation_checkpointing"]:
        checkpoint_activations(model)
    par = Parallel(model, cfg["parallel"], proc.distributed, proc.device,
                   proc.bf16)  # FSDP: in place
    optimizer = make_optimizer(model, cfg, proc.device)
    step, best_val, last_ckpt = restore(par, optimizer, ckpt)
    out_dir = Path(cfg["out_dir"])
    record = {"config": cfg, "model_config": asdict(model_config), **tokenizer,
              "data_dir": str(data_dir), "config_history": history}
    wandb = start_log(cfg, history, out_dir, step) if proc.master else None
    T = cfg["block_size"]
    if proc.master:
        print(f"{model.num_params() / 1e6:.2f}M parameters | {proc.device} "
              f"{'bf16' if proc.bf16 else 'fp32'} | world {proc.world} | {accum} micro-steps of "
              f"{mb} x {T} tokens per rank per step | data {data_dir} ({len(train)} train / "
              f"{len(val)} val tokens)")
    val_offsets = np.linspace(0, len(val) - T - 1, cfg["eval_seqs"]).round().astype(np.int64)
    fwd = torch.compile(par.forward) if cfg["compile"] else par.forward
    return Run(cfg, proc, model, par, optimizer, fwd, train, val, val_offsets, mb, accum, rows,
               step, best_val, last_ckpt, record, out_dir, wandb, enc)


def train_loop(run: Run) -> int:
    """Steps up to max_iters: evaluate, checkpoint and stop as the config says. Returns the
    signal that stopped the run (SIGINT, SIGTERM: the checkpoint of the step reached), else 0."""
    cfg, proc = run.cfg, run.proc
    every_ckpt = cfg["eval_interval"] if cfg["ckpt_interval"] is None else cfg["ckpt_interval"]
    if run.step == 0 and cfg["eval_interval"] > 0:
        evaluation(run)
    bar = tqdm(total=cfg["max_iters"], initial=run.step, unit="step",
               disable=not proc.master or None)
    signals, stopped_by = StopSignals(), 0
    try:  # the handlers go back however the loop ends: a divergence's exit, an error, a test
        while run.step < cfg["max_iters"]:
            lr = one_step(run)
            bar.update()
            step, last = run.step, run.step == cfg["max_iters"]
            if last or (cfg["eval_interval"] > 0 and step % cfg["eval_interval"] == 0):
                evaluation(run)
            # a finished run is just done: no signal can stop it any more
            stopped_by = signals.agreed(proc) if not last else 0
            stopping = step == cfg["stop_at_step"] or stopped_by
            if (every_ckpt and step % every_ckpt == 0) or last or stopping:
                save(run.par, run.optimizer, step, run.best_val, lr, run.record, run.out_dir,
                     run.last_ckpt, proc.master)
                run.last_ckpt = step
            if stopping:
                if proc.master and not stopped_by:
                    tqdm.write(f"stopping at step {step} (stop_at_step); continue with "
                               f"--resume=True")
                break
    finally:
        bar.close()
        signals.restore()
    return stopped_by


def one_step(run: Run) -> float:
    """One optimizer step on the global batch of run.step (this rank's rows), logged. Returns its
    learning rate."""
    cfg, proc, T = run.cfg, run.proc, run.cfg["block_size"]
    t0 = time.perf_counter()
    lr = lr_at(run.step, cfg)
    set_lr(run.optimizer, lr, cfg)
    mine = slice(proc.rank * run.mb * run.accum, (proc.rank + 1) * run.mb * run.accum)
    offsets = train_offsets(cfg["seed"], run.step, run.rows, len(run.train), T)[mine]
    batches = (get_batch(run.train, offsets[m * run.mb:(m + 1) * run.mb], T, proc.device,
                         run.model.config.vocab_size) for m in range(run.accum))
    train_loss, grad_norm = train_step(run.fwd, run.par, batches, run.accum, cfg["grad_clip"],
                                       proc)
    if not math.isfinite(train_loss + grad_norm):  # before the update reaches the weights
        diverged(run.step + 1, f"train_loss {train_loss}, grad_norm {grad_norm}", lr,
                 run.last_ckpt)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    dt = time.perf_counter() - t0
    if proc.master:
        log({"kind": "train", "step": run.step, "train_loss": train_loss, "lr": lr,
             "grad_norm": grad_norm, "tok_per_s": cfg["batch_tokens"] / dt}, run.out_dir,
            run.wandb)
        if run.step % cfg["log_interval"] == 0 or run.step == cfg["max_iters"]:
            tqdm.write(f"step {run.step} | train_loss {train_loss:.4f} | lr {lr:.2e} | "
                       f"grad_norm {grad_norm:.3f} | tok/s {cfg['batch_tokens'] / dt:.0f}")
    return lr


def evaluation(run: Run):
    """eval_and_log at run.step; the best validation loss so far follows."""
    val_loss = eval_and_log(run.model, run.val, run.val_offsets, run.mb, run.cfg["block_size"],
                            run.proc, run.step, run.out_dir, run.wandb)
    run.best_val = min(run.best_val, val_loss)


def finish(run: Run, stopped_by):
    """The end-of-run sample of a finished run, and the last line: where the checkpoint is."""
    proc, saved_to = run.proc, run.out_dir / (SHARDED if run.par.sharded else "ckpt.pt")
    if run.enc is not None and run.step == run.cfg["max_iters"]:  # FSDP: every rank generates
        cache_dtype = torch.bfloat16 if run.par.sharded and proc.bf16 else None
        sample_preview(run.model, run.enc, run.cfg, proc.device, proc.master, cache_dtype)
    if proc.master and stopped_by:
        print(f"stopped by {signal.Signals(stopped_by).name} after step {run.step}, saved to "
              f"{saved_to}; continue with the same command and --resume=True", file=sys.stderr)
    elif proc.master:
        print(f"done: step {run.step} | best val_loss {run.best_val:.4f} | checkpoint {saved_to} | "
              f"{peak_memory(proc.device)}")
    if run.wandb:
        run.wandb.finish()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # before training began, or a second Ctrl-C: the checkpoint stays
        fail("interrupted; the last checkpoint written (if any) is intact: continue with "
             "--resume=True")
