"""
train.py --init_from: a run that starts from trained weights (a train.py run, a released model, a
Qwen3 folder) with a fresh optimizer. The weights fix the model; a command may switch only what
keeps exactly their parameters (SWITCHABLE: vanilla -> value and back, the sources, the context
length, whose positions RoPE computes), and --init_lr says where the rate starts: a finished run
has decayed to its floor, and re-warming to a new run's peak undoes part of what that decay gained
(docs/results.md measures it).
"""
import sys
from dataclasses import asdict

import torch

from baselines import KNOBS, BaselineConfig, build_model
from checkpoint import load_model
from configurator import ConfigError

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
