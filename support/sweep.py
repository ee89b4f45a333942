"""
The runs of an ablate.py sweep in its --out folder: where each lives, what train.py recorded of it,
and whether it is the run asked for. A run is reused (finished) or resumed (a checkpoint) only when
the config train.py would resolve for the new command equals the one it recorded, through every
resume, in every key that changes a number the run reports (support.run_config's table says which);
anything else, or a record that cannot be read, is "stale" with the reason.
"""
import json

from support.checkpoint import read_checkpoint
from support.config import parse_config
from support.errors import CheckpointError, ConfigError
from support.run_config import DEFAULTS, TRAIN_KEYS


def changes_results(key) -> bool:
    """Whether a run recorded with another value of train.py's key is another run. The key table
    says so for each key (TRAIN_KEYS[key].result: not where a run is written, how it is laid out or
    what it prints); a key train.py no longer has counts, as nothing says it changed no number."""
    return key not in TRAIN_KEYS or TRAIN_KEYS[key].result


def read_record(path, parse, valid, what):
    """parse(the text of path) when valid(it) holds, else a ConfigError naming the file: a run's
    record in --out cut short by a kill, or edited."""
    try:
        value = parse(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):  # unreadable, not UTF-8, not JSON
        value = None
    if value is not None and valid(value):
        return value
    raise ConfigError(f"{path} is not {what} (cut short or edited)")


def valid_history(history):
    """train.py's list of resumes: [{"step": s, "changed": {key: [before, after]}}, ...]."""
    return isinstance(history, list) and all(
        isinstance(r, dict) and isinstance(r.get("changed"), dict)
        and all(isinstance(v, list) and len(v) == 2 for v in r["changed"].values())
        for r in history)


def valid_log(log):
    """train.py's log.jsonl: a record a line, each with its step and kind, an eval with its loss."""
    return all(isinstance(r, dict) and isinstance(r.get("step"), int) and "kind" in r
               and (r["kind"] != "eval" or isinstance(r.get("val_loss"), (int, float)))
               for r in log)


def read_log(run_dir):
    path = run_dir / "log.jsonl"
    return read_record(path, lambda text: [*map(json.loads, text.splitlines())], valid_log,
                       "a train.py log") if path.exists() else []


def read_config(run_dir):
    """The config.json train.py wrote: the run's resolved config and its "resumes"."""
    return read_record(run_dir / "config.json", json.loads,
                       lambda c: isinstance(c, dict) and isinstance(c.get("max_iters"), int)
                       and valid_history(c.get("resumes", [])), "a train.py config")


def final_val_loss(run_dir):
    """The last evaluation's loss if the run finished (evaluated at max_iters), else None."""
    evals = [r for r in read_log(run_dir) if r["kind"] == "eval"]
    finished = (evals and (run_dir / "config.json").exists()
                and evals[-1]["step"] == read_config(run_dir)["max_iters"])
    return evals[-1]["val_loss"] if finished else None


def run_dir(out, name, seed, lr=None, factor=1):
    """out/<run>/seed<s> at the base's own rate (the shared protocol); out/<run>/lr<rate>/seed<s> at
    an explicit peak rate; out/<run>/long<f>x_lr<rate>/seed<s> for f times the steps."""
    d = out / name
    if lr is not None:
        d = d / (f"long{factor}x_lr{lr:g}" if factor > 1 else f"lr{lr:g}")
    return d / f"seed{seed}"


def train_config(args) -> dict:
    """The config train.py resolves from these arguments for a fresh run: its defaults, the config
    files, then the overrides (a ConfigError for an unknown key or a wrongly typed value)."""
    return parse_config(DEFAULTS, args)


def differences(recorded, history, asked) -> str:
    """How the config a run was trained with (train.py's record of it and of its resumes) differs
    from the one asked for, as `key old -> new` items; "" for the same run."""
    # a key added to train.py since the run: its default, as on resume
    before = {**DEFAULTS, **recorded}
    # vocab_size None follows the data, which dataset and data_root name
    diff = [f"{k} {before[k]!r} -> {v!r}" for k, v in asked.items()
            if changes_results(k) and before[k] != v and not (k == "vocab_size" and v is None)]
    diff += [f"resumed at step {r.get('step')} with {k} {a!r} -> {b!r}" for r in history
             for k, (a, b) in r["changed"].items() if changes_results(k)]
    return ", ".join(diff)


def survey(where, args, figure=False):
    """(state, why) of a job's folder: "done" (finished), "resume" (a checkpoint), "new" (nothing to
    reuse), each with the config asked for through every resume; else "stale" and what differs or
    cannot be read. figure: the report draws from a finished run's checkpoint too, so it is read now
    rather than after the sweep."""
    ckpt = where / "ckpt.pt"
    try:
        loss = final_val_loss(where)
        if loss is None and ckpt.exists():
            saved = read_checkpoint(ckpt)
            history = saved.get("config_history", [])
            if not isinstance(saved.get("config"), dict) or not valid_history(history):
                raise ConfigError(f"{ckpt} holds a model but not a train.py run to continue")
            what, recorded = f"checkpoint at step {saved.get('step')}", saved["config"]
        elif (where / "config.json").exists():
            recorded = read_config(where)
            what = "finished" if loss is not None else "unfinished"
            history = recorded.get("resumes", [])
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
