"""
What a train.py run writes besides its checkpoints, and the errors that stop it: config.json,
log.jsonl (cut back to the checkpoint's step on resume) and wandb; a divergence, a checkpoint that
could not be written. Every rank raises them; run_main prints rank 0's.
"""
import json
import sys
from pathlib import Path

import torch.distributed as dist

from support.cli import reason, require
from support.errors import CheckpointError, ConfigError, DiskFull, UserError
from support.atomic import append_line, write_atomically


class Diverged(UserError):
    """The loss, the gradients or the weights stopped being finite at step; nothing of it was
    saved (saved: the step of the last checkpoint, or None)."""

    def __init__(self, step, what, lr, saved):
        fix = (f"its last checkpoint (step {saved}) is kept: lower --learning_rate and continue "
               f"it with --resume=True, or start over with --overwrite=True" if saved is not None
               else "rerun with a lower --learning_rate")
        super().__init__(f"training diverged at step {step} ({what}, lr {lr:.3g}); {fix}")


def start_log(cfg, history, out_dir, step):
    """config.json, and log.jsonl cut back to the steps done: lines a killed run wrote after its
    checkpoint go. Returns wandb when --wandb_log, else None."""
    write_atomically(out_dir / "config.json", json.dumps({**cfg, "resumes": history}, indent=1)
                     + "\n")
    kept = [r for r in read_log(out_dir) if r["step"] <= step] if step else []
    write_atomically(out_dir / "log.jsonl", "".join(json.dumps(r) + "\n" for r in kept))
    if not cfg["wandb_log"]:
        return None
    try:
        wandb = require("wandb", "--wandb_log=True")
    except ImportError as e:
        raise ConfigError(f"{e} (or leave wandb_log off)") from None
    try:
        wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or out_dir.name,
                   config=cfg)
    except Exception as e:  # wandb's own: no login and no terminal to ask for one (UsageError)
        if not type(e).__module__.startswith("wandb"):
            raise
        raise ConfigError(f"wandb did not start ({reason(e)}): run `wandb login` once, or set "
                          f"WANDB_MODE=offline to log here and `wandb sync` later") from None
    return wandb


def read_log(out_dir) -> list:
    """The records of out_dir/log.jsonl ([] without one), as --resume and ablate.py --curves read
    it: a last line cut short (a kill mid-write, or a live run's line being written) is dropped with
    a warning; any other line that is not a record is a CheckpointError."""
    path = Path(out_dir) / "log.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = [whole(line) for line in lines]
    if records and records[-1] is None:  # after the checkpoint by construction: lose nothing kept
        print(f"warning: {path}'s last line was cut short (a kill or a full disk mid-write); "
              f"dropped it", file=sys.stderr)
        records.pop()
    if None in records:
        raise CheckpointError(f"{path} line {records.index(None) + 1} is not a train.py record "
                              f"(edited?); restore it or delete the line")
    return records


def whole(line):
    """A line's record, None for a line cut short or not a record."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "step" in record else None


def log(record, out_dir, wandb):
    """One line of log.jsonl (and wandb); the master process writes them, each whole or not at
    all."""
    append_line(out_dir / "log.jsonl", json.dumps(record))
    if wandb:
        flat = {f"depth_weight/{e}/{c}": w for e, row in record.get("depth_weights", {}).items()
                for c, w in row.items()}  # layer e's weight on candidate c
        plain = {k: v for k, v in record.items() if k not in ("step", "depth_weights")}
        wandb.log({**plain, **flat}, step=record["step"])


class SaveFailed(CheckpointError):
    """A checkpoint that could not be written, in one line that says why and what is kept: a rank
    that stopped mid-write (its peers lose their connection to it), or a write that failed."""

    def __init__(self, path, step, e, saved):
        kept, then = ((f"the checkpoint of step {saved} is kept", "--resume=True")
                      if saved is not None else ("no checkpoint was written", "rerun"))
        if isinstance(e, dist.DistError) or getattr(e, "peer_lost", False):
            super().__init__(f"a rank stopped while {path} of step {step} was written "
                             f"({reason(e)}); {kept}: {then}")
        elif isinstance(e, DiskFull):
            super().__init__(f"could not write {path} at step {step}: no space left on device; "
                             f"{kept}: {e.free}, then {then}")
        else:
            super().__init__(f"could not write {path} at step {step} ({reason(e)}); {kept}: free "
                             f"space or make --out_dir writable, then {then}")
