"""
Whether a train.py command is a valid run, in one place: the table of its keys (TRAIN_KEYS: each
key's default, valid range or choices, whether it changes the run's results, and its help), the
command line resolved against a checkpoint on --resume, and the checks that the model, the data and
the batch layout must pass. Everything here raises support.errors types; train.py prints them.

--help, the range checks, the warnings about keys a run ignores and ablate.py's "is this the run
asked for" (support/sweep.py) all read TRAIN_KEYS.
"""
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Optional, get_args

import torch

from model import DEPTH_MODES
from support.cli import SHARDED, resolve_device
from support.config import Key, argument_updates, key_table, parse_config
from support.config import check_keys as check_table  # run_config's check_keys calls it
from support.errors import CheckpointError, ConfigError
from support.parallel import PARALLEL
from support.run_dir import run_folder
from support.variants import (ATTENTIONS, KNOBS, RESIDUALS, BaselineConfig, build_model,
                              depth_modes, make_config)


def _model_keys() -> dict:
    """BaselineConfig's fields (model.ModelConfig's among them), sized for the Shakespeare demo
    (1.25M parameters); their help is each field's own (model.knob), their choices the configs',
    a None default's kind its annotation's (Optional[int]: int)."""
    demo = BaselineConfig(block_size=256, n_layer=6, n_head=4, n_kv_head=2, head_dim=32,
                          n_embd=128, mlp_hidden=384, depth_mode="value")
    choices = {"depth_mode": depth_modes(), "residual": RESIDUALS, "attention": ATTENTIONS}
    keys = {f.name: Key(getattr(demo, f.name), f.metadata["help"], choices=choices.get(f.name),
                        kind=(get_args(f.type) or (None,))[0])
            for f in fields(BaselineConfig)}
    keys["vocab_size"] = Key(None, "None = the tokenizer's vocabulary (meta.json); larger values "
                             "pad it", kind=int)
    return keys


NO_RESULT = dict(result=False)
TRAIN_KEYS = {
    **_model_keys(),
    # data and output
    "dataset": Key("shakespeare", "<data_root>/<dataset>/: {train,val}.bin, meta.json "
                   "(prepare_data)", path=True),
    "data_root": Key("data", "the folder that holds the prepared datasets", path=True),
    "out_dir": Key("out/shakespeare", "ckpt.pt, config.json, log.jsonl", result=False,
                   per_invocation=True, path=True),
    "seed": Key(1337, "model init and the batch sequence", "in [0, 2**63)"),
    # batch: gradient accumulation = batch_tokens / (micro_batch * block_size * world_size)
    "batch_tokens": Key(4096, "tokens per optimizer step, all ranks together (paper: 1024 x "
                        "2048)", ">= 1"),
    "micro_batch": Key(None, "sequences per forward pass on one rank; None = the rank's share",
                       ">= 1", result=False, kind=int),
    # the paper's recipe (section 3): AdamW, 2% warmup, cosine to 0.1 x peak, clip 1.0
    "max_iters": Key(400, "optimizer steps; the LR schedule spans exactly these", ">= 1"),
    "learning_rate": Key(3e-3, "peak LR (paper: 1e-3 at 1.5B/3B, 3e-4 at 410M)", "> 0"),
    "weight_decay": Key(0.1, "on matrices only; norms and other 1-D parameters get none", ">= 0"),
    "beta1": Key(0.9, "AdamW first-moment decay", "in [0, 1)"),
    "beta2": Key(0.95, "AdamW second-moment decay", "in [0, 1)"),
    "adam_eps": Key(1e-8, "AdamW epsilon", "> 0"),
    "grad_clip": Key(1.0, "max global grad norm; 0 = no clipping", ">= 0"),
    "lime_router_lr_mult": Key(10.0, "depth_mode=lime: the routers' LR / the scheduled LR, no "
                               "decay (LIMe: 1e-2 at 1e-3)", "> 0"),
    "warmup_frac": Key(0.02, "linear warmup over this fraction of max_iters", "in [0, 1]"),
    "min_lr_ratio": Key(0.1, "cosine floor as a fraction of the peak LR", "in [0, 1]"),
    # evaluation, logging, checkpoints
    "eval_interval": Key(100, "steps between evaluations (also at step 0 and at the end)",
                         ">= 0"),
    "eval_seqs": Key(64, "fixed validation windows, evenly spaced over val.bin", ">= 1"),
    "log_interval": Key(25, "steps between printed train lines (log.jsonl gets every step)",
                        ">= 1", **NO_RESULT),
    "ckpt_interval": Key(None, "steps between checkpoints; None = at every evaluation; 0 = at "
                         "the end only", ">= 0", kind=int, **NO_RESULT),
    "stop_at_step": Key(0, "end early after this step with a checkpoint, keeping max_iters' "
                        "schedule; 0 = off", ">= 0", **NO_RESULT),
    "resume": Key(False, "continue from out_dir/ckpt.pt", result=False, per_invocation=True),
    "init_from": Key("", "start from these weights, fresh optimizer: an out_dir, a ckpt.pt, a HF "
                     "folder or a hub id"),
    "init_lr": Key("last", "--init_from a finished run, no --learning_rate: last = re-warm to its "
                   "final rate, peak = learning_rate as a new run", choices=("last", "peak")),
    "overwrite": Key(False, "start over in an out_dir that holds a checkpoint, deleting it",
                     result=False, per_invocation=True),
    "sample_tokens": Key(200, "tokens of text sampled at the end of the run; 0 = none", ">= 0",
                         **NO_RESULT),
    "sample_prompt": Key("", "\"\" = start from the end-of-text token, like a new document",
                         **NO_RESULT),
    # hardware
    "device": Key("auto", "auto = cuda, then mps, then cpu"),
    "dtype": Key("auto", "auto = bfloat16 autocast on CUDA where supported, else float32",
                 choices=("auto", "float32", "bfloat16")),
    "compile": Key(False, "torch.compile the training forward (slow to start on CPU)",
                   **NO_RESULT),
    "parallel": Key("ddp", "under torchrun: ddp (each GPU the whole model) | fsdp (sharded: "
                    "support/parallel.py)", choices=PARALLEL, **NO_RESULT),
    "activation_checkpointing": Key(False, "recompute each block in the backward pass: less "
                                    "memory, ~1/3 more compute", **NO_RESULT),
    "peak_flops": Key(0.0, "one device's peak FLOP/s for the printed MFU, e.g. 989e12; 0 = a known "
                      "GPU's bf16 peak (support/speed.py), none on a CPU", ">= 0", **NO_RESULT),
    "memory_plan": Key(False, "print the per-GPU memory of ddp / fsdp, with and without "
                       "checkpointing, and exit", result=False, per_invocation=True),
    # experiment tracking
    "wandb_log": Key(False, "log to Weights & Biases (pip install wandb)", **NO_RESULT),
    "wandb_project": Key("depth-attention", "the wandb project", **NO_RESULT),
    "wandb_run_name": Key("", "\"\" = the out_dir's name", **NO_RESULT),
}
DEFAULTS, HELP, _, CHOICES = key_table(TRAIN_KEYS)
MODEL_KEYS = [f.name for f in fields(BaselineConfig)]  # the decoder's, the method's, the baselines'


def parse_args(argv, doc="") -> dict:
    """The config a command line asks for on a fresh run: DEFAULTS <- config files <- --key=value,
    every key typed and in its range or choices. Reads no checkpoint and no data."""
    cfg = parse_config(DEFAULTS, argv, doc, helps=HELP, choices=CHOICES)
    check_keys(cfg)
    return cfg


def check_keys(cfg):
    """Every value as TRAIN_KEYS takes it (support.config.check_keys), before anything reads one:
    a model key's choices too, so a typo gets the nearest choice, not a KeyError."""
    check_table(cfg, TRAIN_KEYS)


def resolve(argv, doc="", master=True):
    """(cfg, ckpt, init): the run this command asks for, with --resume its checkpoint, and on a
    fresh run with --init_from the weights to start from (checkpoint.Loaded). With resume, the
    checkpoint's config replaces DEFAULTS, so `--out_dir=X --resume=True` alone continues the run,
    and a repeated command line changes nothing."""
    cfg = parse_args(argv, doc)
    # before anything is read: a folder train.py may write (not inside a checkpoint, not its source)
    run_folder(cfg["out_dir"], cfg["resume"], cfg["init_from"])
    ckpt = None
    if cfg["resume"]:
        ckpt = resumable_checkpoint(cfg["out_dir"])
        inherited = {k: v for k, v in ckpt["config"].items()
                     if k in DEFAULTS and not TRAIN_KEYS[k].per_invocation}
        cfg = parse_config({**DEFAULTS, **inherited}, argv)
        check_keys(cfg)
        check_same_model(cfg, ckpt)
        check_same_start(cfg, ckpt)
        if ("shards" in ckpt) != (cfg["parallel"] == "fsdp"):
            written = "fsdp" if "shards" in ckpt else "ddp"
            raise ConfigError(f"{cfg['out_dir']} holds a checkpoint written with --parallel="
                              f"{written}; continue it with that --parallel (a checkpoint does "
                              f"not convert between the two)")
        if cfg["overwrite"]:
            raise ConfigError("--resume=True continues the checkpoint and --overwrite=True "
                              "deletes it; pass one of them")
    init = None
    if cfg["init_from"] and ckpt is None:  # a resumed run's weights are its checkpoint's
        from support.checkpoint import load_model
        init = load_model(cfg["init_from"])
        asked = typed_keys(argv)
        switched = adopt_init_model(cfg, init.model.config, cfg["init_from"], asked)
        if switched and master:
            print(switched)
        from support.continued import continue_schedule
        continue_schedule(cfg, init, "learning_rate" in asked, master)
    resolve_device(cfg["device"])
    if master:
        for key, why in ignored_keys(cfg).items():
            print(f"warning: --{key}={cfg[key]!r} does nothing in this run: {why}",
                  file=sys.stderr)
    return cfg, ckpt, init


def resumable_checkpoint(out_dir) -> dict:
    """The checkpoint --resume continues: it must exist and hold a whole run."""
    from support.checkpoint import checkpoint_path, read_checkpoint, unfinished
    path = checkpoint_path(out_dir)
    if not path.exists():
        where = f"{path} or {path.with_name(SHARDED)}" if path.name == "ckpt.pt" else path
        raise CheckpointError(f"--resume=True but there is no checkpoint at {where}"
                              f"{unfinished(path.parent)}; check --out_dir, or drop --resume to "
                              f"start anew")
    ckpt = read_checkpoint(path)
    # (an FSDP run's optimizer state is in its shards)
    missing = [k for k in ("config", "optimizer", "step", "best_val_loss", "rng")
               if k not in ckpt and not (k == "optimizer" and "shards" in ckpt)]
    if missing:
        raise CheckpointError(f"{path} holds a model but not a run to continue (no "
                              f"{', '.join(missing)}); train into a new --out_dir")
    return ckpt


def check_same_model(cfg, ckpt):
    """A resumed run keeps its model; vocab_size None ("follow the data") is the checkpoint's."""
    saved = {**DEFAULTS, **ckpt["model_config"]}  # a field added since: its default
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = saved["vocab_size"]
    changed = {k: (saved[k], cfg[k]) for k in shaping(saved, cfg) if cfg[k] != saved[k]}
    if changed:
        raise ConfigError(f"the checkpoint's model differs from the one asked for ({changed}, as "
                          f"(checkpoint, now)); drop those overrides or train into a new "
                          f"--out_dir")


def check_same_start(cfg, ckpt):
    """--init_from on resume must name the weights the run began from (they are never loaded)."""
    started, asked = ckpt["config"].get("init_from", ""), cfg["init_from"]
    if asked != started and not (asked and Path(asked).exists()
                                 and Path(asked).resolve() == Path(started).resolve()):
        began = f"from --init_from={started}" if started else "from scratch"
        raise ConfigError(f"--resume=True continues the run in {cfg['out_dir']}, which "
                          f"began {began}; --init_from={cfg['init_from']} would not be loaded: "
                          f"drop it, or start a new --out_dir from those weights")


def ignored_keys(cfg) -> dict:
    """{key: why} for the keys set away from their default that this run's model has no use for."""
    row = DEPTH_MODES.get(cfg["depth_mode"])  # LIMe's (not loaded here) and a typo's: checked later
    no_step = (row is not None and not row.mixes,
               f"depth_mode={cfg['depth_mode']} has no depth step")
    why = {"lime_router_lr_mult": (cfg["depth_mode"] != "lime", "only depth_mode=lime has routers"),
           "depth_stride": no_step, "depth_recent_window": no_step,
           "k_norm_after_rope": (not cfg["qk_norm"], "--qk_norm=False has no k_norm"),
           "init_lr": (not cfg["init_from"], "only --init_from reads it")}
    for knob in KNOBS:  # a baseline's own knobs, named after it
        baseline = knob.split("_")[0]
        why[knob] = (cfg["residual"] != baseline, f"only --residual={baseline} reads it")
    return {k: text for k, (unused, text) in why.items() if unused and cfg[k] != DEFAULTS[k]}


def shaping(*configs) -> list:
    """The model keys that shape the models these flat dicts describe: a plain model (residual add)
    stores no baseline knobs, and another value of them changes nothing."""
    return [k for k in MODEL_KEYS if k not in KNOBS or any(c["residual"] != "add" for c in configs)]


def overrides(cfg) -> str:
    """The first lines of a run: `key = value` for each key off its default, as nanoGPT prints."""
    return "\n".join(f"{k} = {cfg[k]!r}" for k in DEFAULTS if cfg[k] != DEFAULTS[k])


def changed_settings(cfg, ckpt) -> dict:
    """{key: [before, after]} for the run's keys a resume changes (per-invocation ones aside)."""
    before = {**DEFAULTS, **ckpt["config"]}
    return {k: [before[k], cfg[k]] for k in DEFAULTS
            if not TRAIN_KEYS[k].per_invocation and before[k] != cfg[k]}


def typed_keys(argv) -> set:
    """The keys a command line sets (its config files' and its --key=value's), whatever their
    values: --n_layer=6 is asked for even where 6 is the default."""
    return {key for updates in argument_updates(argv, DEFAULTS) for key in updates}


# What --init_from may change: the depth step, where the checkpoint's parameters are exactly the
# new model's (vanilla -> value, uniform, key, kv and back): a vanilla checkpoint starts a
# Depth-Attention run (issue 39); and the context length, whose positions RoPE computes (a released
# model's 40,960 is more than one GPU trains on).
SWITCHABLE = ("depth_mode", "depth_stride", "depth_recent_window", "block_size")


def adopt_init_model(cfg, init_config, init_from, asked) -> Optional[str]:
    """--init_from fixes the model keys: cfg takes init_config's, and a model setting asked for
    (asked: typed_keys) that differs from them is a ConfigError, but for SWITCHABLE ones whose model
    has exactly the checkpoint's parameters. Returns the one-line notice of a switch, or None."""
    theirs = {**asdict(BaselineConfig()), **asdict(init_config)}  # a plain model: defaults
    clash = {k: (theirs[k], cfg[k]) for k in shaping(theirs, cfg)
             if k in asked and cfg[k] is not None and cfg[k] != theirs[k]}
    switch = {k: clash.pop(k) for k in SWITCHABLE if k in clash}
    if clash:
        raise ConfigError(f"--init_from={init_from} fixes the model, and these settings differ "
                          f"from it: {clash} (as (model, asked)); drop them")
    cfg.update({k: theirs[k] for k in shaping(theirs) if k not in switch})
    if not switch:
        return None
    # LIMe's routers: no identity-preserving init here yet, so no silent random ones
    if changed := parameters_changed(theirs, cfg):
        raise ConfigError(f"--init_from={init_from}: --depth_mode={cfg['depth_mode']} has other "
                          f"parameters than the checkpoint ({', '.join(changed[:2])}, ...); "
                          f"switch only between modes without parameters of their own: vanilla, "
                          f"value, uniform, key, kv")
    changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in switch.items())
    return (f"--init_from={init_from}: switched {changes}; no parameter added (the model's "
            f"parameters are the checkpoint's)")


def parameters_changed(before: dict, after: dict) -> list:
    """The state-dict entries (names and shapes) one model has and the other lacks or shapes
    otherwise, both built on the meta device (no memory, no time)."""
    def entries(keys):
        with torch.device("meta"):
            model = build_model(make_config(**{k: keys[k] for k in MODEL_KEYS}))
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}
    old, new = entries(before), entries(after)
    return sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))


def batch_layout(cfg, world):
    """(micro_batch, accumulation steps, rows): the global batch is rows = batch_tokens / block_size
    sequences, each rank rows / world in passes of micro_batch. Any layout gives the same run to
    float rounding, not bit for bit: the micro-batches' gradients are summed in another order, so
    the losses differ by about 1e-6 (tests/test_train.py measures it)."""
    T, tokens, mb = cfg["block_size"], cfg["batch_tokens"], cfg["micro_batch"]
    if tokens % (T * world):
        nearest = max(1, round(tokens / (T * world))) * T * world
        raise ConfigError(f"batch_tokens={tokens} must be a multiple of block_size * world_size = "
                          f"{T} * {world}; --batch_tokens={nearest} is the nearest (a different "
                          f"run)")
    rows = tokens // T
    share = rows // world
    mb = mb or share
    if share % mb:
        fits = max(d for d in range(1, min(mb, share) + 1) if share % d == 0)
        raise ConfigError(f"micro_batch={mb} must divide this rank's share of the batch, "
                          f"batch_tokens / block_size / world_size = {tokens} / {T} / {world} = "
                          f"{share} sequences; --micro_batch={fits} keeps the run, to float "
                          f"rounding")
    return mb, share // mb, rows
