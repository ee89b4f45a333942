"""
The runs of an ablate.py sweep in its --out folder: where each lives, what train.py recorded of it, and whether
it is the run asked for. A run is reused (finished) or resumed (a checkpoint) only when the config train.py
would resolve for the new command equals the one it recorded, through every resume; anything else, or a record
that cannot be read, is "stale" with the reason.
"""
import ast
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

from support.checkpoint import CheckpointError, read_checkpoint
from support.cli import ConfigError, fail
from support.config import parse_config

ROOT = Path(__file__).resolve().parent.parent  # the repository: train.py runs there
# train.py keys that decide no number a run reports, so a run recorded with other values of them is still the run
# asked for: where it is written and how one command treats it (out_dir, resume, overwrite); where it pauses and
# how often it saves (stop_at_step keeps max_iters' schedule, and a resume continues a run exactly); how the same
# computation is laid out (micro_batch, compile, parallel, activation_checkpointing: equal up to float rounding,
# as on another GPU of the same kind); the memory plan that trains nothing (memory_plan);
# what it prints or mirrors (log_interval, the text sample after the last checkpoint, wandb). Every other key
# must match: eval_interval and eval_seqs too, as they make the curves and the losses.
NOT_RESULT_KEYS = {"out_dir", "resume", "overwrite", "stop_at_step", "ckpt_interval", "micro_batch", "compile",
                   "parallel", "activation_checkpointing", "memory_plan", "log_interval", "sample_tokens",
                   "sample_prompt", "wandb_log", "wandb_project", "wandb_run_name"}
def read_record(path, parse, valid, what):
    """parse(the text of path) when valid(it) holds, else a ConfigError naming the file: a run's record in --out
    cut short by a kill, or edited."""
    try:
        value = parse(path.read_text())
        if valid(value):
            return value
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        pass
    raise ConfigError(f"{path} is not {what} (cut short or edited)")


def valid_history(history):
    """train.py's list of resumes: [{"step": s, "changed": {key: [before, after]}}, ...]."""
    return isinstance(history, list) and all(isinstance(r, dict) and isinstance(r.get("changed"), dict) and all(
        isinstance(v, list) and len(v) == 2 for v in r["changed"].values()) for r in history)


def read_log(run_dir):
    path = run_dir / "log.jsonl"
    return read_record(path, lambda text: [json.loads(line) for line in text.splitlines()], lambda log: all(
        isinstance(r, dict) and isinstance(r.get("step"), int) and "kind" in r and (
            r["kind"] != "eval" or isinstance(r.get("val_loss"), (int, float))) for r in log),
        "a train.py log") if path.exists() else []


def read_config(run_dir):
    """The config.json train.py wrote: the run's resolved config and its "resumes"."""
    return read_record(run_dir / "config.json", json.loads, lambda c: isinstance(c, dict) and isinstance(
        c.get("max_iters"), int) and valid_history(c.get("resumes", [])), "a train.py config")


def final_val_loss(run_dir):
    """The last evaluation's loss if the run finished (evaluated at max_iters), else None."""
    evals = [r for r in read_log(run_dir) if r["kind"] == "eval"]
    if not (run_dir / "config.json").exists() or not evals or evals[-1]["step"] != read_config(run_dir)["max_iters"]:
        return None
    return evals[-1]["val_loss"]


def run_dir(out, name, seed, lr=None, factor=1):
    """out/<run>/seed<s> at the base's own rate (the shared protocol); out/<run>/lr<rate>/seed<s> at an
    explicit peak rate; out/<run>/long<f>x_lr<rate>/seed<s> for f times the steps."""
    d = out / name
    if lr is not None:
        d = d / (f"long{factor}x_lr{lr:g}" if factor > 1 else f"lr{lr:g}")
    return d / f"seed{seed}"


@functools.cache
def train_defaults() -> dict:
    """train.py's keys and defaults, read from its --help (a script is run, never imported)."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True,
                          cwd=ROOT)
    try:  # `  --key=repr(default)  comment`, one line a key
        defaults = {k: ast.literal_eval(v) for k, v in re.findall(r"^  --(\w+)=(.+?)(?:  |$)", proc.stdout, re.M)}
    except (ValueError, SyntaxError):
        defaults = {}
    if not defaults:
        fail(f"could not read train.py's keys from `python train.py --help` (exit {proc.returncode}: "
             f"{proc.stderr.strip()[-200:]}); check that train.py runs")
    return defaults


def unset_key(cfg, defaults):
    """The first key set to None whose default is not None (parse_config takes None for any number), else None."""
    return next((k for k, v in cfg.items() if v is None and defaults[k] is not None), None)


def train_config(args) -> dict:
    """The config train.py resolves from these arguments for a fresh run: its defaults, the config files, then
    the --key=value overrides (a ConfigError for an unknown key or a value of the wrong type)."""
    return parse_config(train_defaults(), args)


def differences(recorded, history, asked) -> str:
    """How the config a run was trained with (train.py's record of it and of its resumes) differs from the one
    asked for, as `key old -> new` items; "" for the same run."""
    before = {**train_defaults(), **recorded}  # a key added to train.py since the run: its default, as on resume
    diff = [f"{k} {before[k]!r} -> {v!r}" for k, v in asked.items() if k not in NOT_RESULT_KEYS and before[k] != v
            and not (k == "vocab_size" and v is None)]  # None follows the data, which dataset and data_root name
    diff += [f"resumed at step {r.get('step')} with {k} {a!r} -> {b!r}" for r in history
             for k, (a, b) in r["changed"].items() if k not in NOT_RESULT_KEYS]
    return ", ".join(diff)


def survey(where, args, figure=False):
    """(state, why) of a job's folder: "done" (finished), "resume" (a checkpoint), "new" (nothing to reuse), each
    with the config asked for through every resume; else "stale" and what differs or cannot be read. figure: the
    report draws from a finished run's checkpoint too, so it is read now rather than after the sweep."""
    ckpt = where / "ckpt.pt"
    try:
        loss = final_val_loss(where)
        if loss is None and ckpt.exists():
            saved = read_checkpoint(ckpt)
            if not isinstance(saved.get("config"), dict) or not valid_history(saved.get("config_history", [])):
                raise ConfigError(f"{ckpt} holds a model but not a train.py run to continue")
            what, recorded, history = f"checkpoint at step {saved.get('step')}", saved["config"], \
                saved.get("config_history", [])
        elif (where / "config.json").exists():
            recorded = read_config(where)
            what, history = "finished" if loss is not None else "unfinished", recorded.get("resumes", [])
        else:
            return "new", None
        if figure and loss is not None and ckpt.exists():
            read_checkpoint(ckpt, verify=("model", "model_config"))
    except (ConfigError, CheckpointError) as e:
        return "stale", str(e)
    diff = differences(recorded, history, train_config(args))
    if diff:
        return "stale", f"{what}; {diff}"
    return ("done" if loss is not None else "resume" if ckpt.exists() else "new"), None
