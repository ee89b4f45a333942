"""
train.py --resume and --init_from: continuing training. --resume continues a run exactly: the same
model, its optimizer, its generators' states and its place; the training keys a command changes are
named and recorded. --init_from starts a new run from trained weights (a train.py run, a released
model, a Qwen3 folder) with a fresh optimizer: the weights fix the model; a command may switch only what
keeps exactly their parameters (SWITCHABLE: vanilla -> value and back, the sources, the context
length, whose positions RoPE computes), and --init_lr says where the rate starts: a finished run
has decayed to its floor, and re-warming to a new run's peak undoes part of what that decay gained
(docs/results.md measures it).
"""
import json
import os
import random
import sys
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch

from baselines import KNOBS, BaselineConfig, build_model
from checkpoint import checkpoint_path, load_model, read_checkpoint
from configurator import CheckpointError, ConfigError

SWITCHABLE = ("depth_mode", "depth_stride", "depth_recent_window", "block_size")


def parameters(keys) -> dict:
    """{name: shape} of the state dict of the model keys name, built on the meta device."""
    with torch.device("meta"):
        model = build_model({k: v for k, v in keys.items() if k in asdict(BaselineConfig())})
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def start_from(cfg, asked, master=True):
    """The weights of cfg["init_from"] (checkpoint.Loaded), cfg's model keys set to theirs and its
    learning rate to where the run continues. asked: the keys the command typed; one that differs
    from the weights' is a ConfigError unless SWITCHABLE and the parameters stay the same."""
    init, src = load_model(cfg["init_from"]), cfg["init_from"]
    theirs = asdict(BaselineConfig()) | asdict(init.model.config)  # a plain model: defaults
    shaping = [k for k in theirs if k not in KNOBS or theirs["residual"] != "add"
               or cfg.get("residual", "add") != "add"]
    clash = {k: (theirs[k], cfg[k]) for k in shaping
             if k in asked and cfg.get(k) is not None and cfg[k] != theirs[k]}
    switch = {k: clash.pop(k) for k in SWITCHABLE if k in clash}
    if clash:
        raise ConfigError(f"--init_from={src} fixes the model, and these settings differ from it: "
                          f"{clash} (as (model, asked)); drop them")
    cfg.update({k: theirs[k] for k in shaping if k not in switch})
    if switch and parameters(theirs) != parameters(cfg):  # LIMe's routers: no silent random init
        raise ConfigError(f"--init_from={src}: --depth_mode={cfg['depth_mode']} has other "
                          f"parameters than the checkpoint; switch only between modes without "
                          f"parameters of their own: vanilla, value, uniform, key, kv")
    if switch and master:
        changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in switch.items())
        print(f"--init_from={src}: switched {changes}; no parameter added (the model's are the "
              f"checkpoint's)")
    run = init.config or {}
    if "learning_rate" in asked:
        return init
    if cfg["init_lr"] == "last" and (init.step or 0) >= run.get("max_iters", float("inf")):
        cfg["learning_rate"] = run["learning_rate"] * run["min_lr_ratio"]
        if master:
            print(f"--init_from={src} finished its schedule: the rate re-warms to its final "
                  f"{cfg['learning_rate']:.3g} (--init_lr=last); --init_lr=peak or "
                  f"--learning_rate sets another peak")
    elif init.step is None and master:
        print(f"warning: --init_from={src} has no schedule here to continue: it trains at a new "
              f"run's peak, {cfg['learning_rate']:g}; give --learning_rate (a fraction of its "
              f"pretraining rate)", file=sys.stderr)
    return init


def resume(cfg, argv, keys, parse):
    """(cfg, ckpt): the run in cfg's out_dir and its checkpoint, whose config replaces the defaults
    of keys (train.py's table; parse: its parse_args), so `--out_dir=X --resume` alone continues it;
    argv may change training keys, never the model, the weights it began from or the --parallel
    that wrote it. ckpt["resumes"]: the resumes behind the run, [{"step": s, "changed": {key:
    [before, after]}}], with this one."""
    ckpt = read_checkpoint(checkpoint_path(cfg["out_dir"]))
    if not {"config", "step", "rng"} <= ckpt.keys():
        raise CheckpointError(f"{cfg['out_dir']} holds a model but not a run to continue; train a "
                              f"new --out_dir with --init_from")
    cfg = parse(argv, {k: key.default for k, key in keys.items()} | {
        k: v for k, v in ckpt["config"].items() if k in keys and not keys[k].per_invocation})
    model_keys = {f.name for f in fields(BaselineConfig)}
    training = {k: key for k, key in keys.items() if k not in model_keys}
    saved, began = ckpt["model_config"], ckpt["config"].get("init_from", "")
    cfg["vocab_size"] = cfg["vocab_size"] or saved["vocab_size"]
    with torch.device("meta"):  # the model asked for, in no time
        now = asdict(build_model({k: v for k, v in cfg.items() if k in model_keys}).config)
    if changed := {k: (saved.get(k, v), v) for k, v in now.items() if saved.get(k, v) != v}:
        raise ConfigError(f"the checkpoint's model differs from the one asked for ({changed}, as "
                          f"(checkpoint, now)); drop those or train into a new --out_dir")
    start = f"from --init_from={began}" if began else "from scratch"
    same = cfg["init_from"] == began or began and Path(cfg["init_from"]).resolve() == \
        Path(began).resolve()  # the same weights, however spelled
    for wrong, why in ((not same, f"began {start}: drop --init_from"),
                       (("shards" in ckpt) != (cfg["parallel"] == "fsdp"), "was written with "
                        f"--parallel={'fsdp' if 'shards' in ckpt else 'ddp'}: resume with it"),
                       (cfg["overwrite"], "would be deleted by --overwrite: pass one of them")):
        if wrong:
            raise ConfigError(f"--resume=True continues {cfg['out_dir']}, which {why}")
    before = {k: key.default for k, key in training.items()} | ckpt["config"]
    changed = {k: [before[k], cfg[k]] for k, key in training.items()
               if not key.per_invocation and before[k] != cfg[k]}
    if changed and os.environ.get("RANK", "0") == "0":  # a new max_iters re-stretches the schedule
        print(f"warning: resuming at step {ckpt['step']} with changed settings: "
              f"{', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changed.items())}; config.json "
              f"records them under \"resumes\"", file=sys.stderr)
    ckpt["resumes"] = [*ckpt["config"].get("resumes", ckpt.get("config_history", [])),
                       {"step": ckpt["step"], "changed": changed}]
    return cfg, ckpt


def restore(run, ckpt):
    """A resumed run's weights, optimizer, RNG states, place (batch `step` is (seed, step)'s) and
    log."""
    if run.par.mode == "fsdp":
        run.par.sharded.load(run.optimizer, ckpt)
    else:
        run.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt["rng"]
    random.setstate(rng["python"])
    kind, key, *rest = rng["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    run.step = run.last_ckpt = ckpt["step"]
    run.best_val = ckpt["best_val_loss"]
    run.t0 -= ckpt.get("elapsed_s", 0.0)
    # a killed run's lines after its checkpoint go; the log is checked before anything is written
    run.log_kept = "".join(json.dumps(r) + "\n" for r in read_log(run.cfg["out_dir"])
                           if r["step"] <= run.step)


def read_log(out_dir) -> list:
    """out_dir/log.jsonl's records: a last line cut short (a kill mid-write) is dropped with a
    warning; any other line that is not a record is a CheckpointError."""
    path, records = Path(out_dir) / "log.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append(None)
        if not isinstance(records[-1], dict) or "step" not in records[-1]:
            records[-1] = None
    if records and records[-1] is None:
        print(f"warning: {path}'s last line was cut short (a kill mid-write); dropped it",
              file=sys.stderr)
        records.pop()
    if None in records:
        raise CheckpointError(f"{path} line {records.index(None) + 1} is not a train.py record "
                              f"(edited?); restore it or delete the line")
    return records

