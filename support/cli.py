"""
The few helpers every script uses at its edges: the command-line dialect's words (the boolean words,
the range rules, the nearest name to a slip, which support/config.py's key tables and
support/argparser.py's ArgumentParser share), then error lines, optional packages, devices, tables,
sharded checkpoints' folders (never written into) and JSON files. Where a script writes its results
is support/outputs.py's.
"""
import difflib
import importlib
import json
import math
from pathlib import Path
from typing import Optional

from support.errors import ConfigError, UserError

# An FSDP run's checkpoint folder (sharded.save_sharded), and its names while a save replaces it.
SHARDED = "ckpt.dcp"
SHARDED_OLD = f"{SHARDED}.old"  # the previous ckpt.dcp between save_sharded's two renames
SHARDED_NAMES = (SHARDED, f"{SHARDED}.tmp", SHARDED_OLD)
# The end-of-text token's text: GPT-2's, the bytes tokenizer's (support/tokenizer.py) and the one a
# tokenizer.json names (support/hub.py)
EOT = "<|endoftext|>"


def reason(e) -> str:
    """An exception's first line for an error message; its class name when it has no message."""
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def table(rows, header) -> str:
    """Rows of values as aligned plain-text columns under header, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header] + rows)


class MissingPackage(UserError, ImportError):
    """An optional package that is not installed; the message names its pip line. Also an
    ImportError, so code that probes for a package with `except ImportError` keeps working."""


def require(module, purpose, pip=None):
    """import module, or a MissingPackage that names the pip line (optional packages are imported
    where used)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackage(f"{purpose} needs {module}: "
                             f"pip install {pip or module.split('.')[0]}") from e


def resolve_device(name, local_rank=None, allowed=("cpu", "cuda", "cuda:N", "mps")) -> str:
    """The device a script runs on: "auto" is the first of cuda, mps, cpu that this machine has and
    `allowed` lists; a named device must exist here. Under torchrun (local_rank given), "cuda" is
    this process's GPU. A ConfigError says what the machine has."""
    import torch  # this module stays importable without torch
    have = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(),
            "cpu": True}
    if name == "auto":
        name = next(d for d in ("cuda", "mps", "cpu") if d in allowed and have[d])
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not (kind == "cuda" and index.isdigit())):
        near = nearest(name, ("auto", *allowed))
        raise ConfigError(f"unknown device {name!r}; {f'did you mean {near}? ' if near else ''}"
                          f"use auto or one of {', '.join(allowed)}")
    if (kind + ":N" if index else kind) not in allowed:
        raise ConfigError(f"this script runs on {', '.join(allowed)} (or auto), not {name!r}")
    if not have[kind]:
        missing = ("torch sees no CUDA GPU" if kind == "cuda"
                   else "torch.backends.mps is not available")
        raise ConfigError(f"device {name!r} but {missing} here; use --device=cpu (or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} but this machine has {torch.cuda.device_count()} "
                          f"CUDA GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return f"cuda:{local_rank}" if name == "cuda" and local_rank is not None else name


def not_in_a_checkpoint(path, flag):
    """A ConfigError naming `flag` if path is or lies inside a sharded checkpoint's folder: the
    run's next save replaces that folder whole, and whatever else was written there with it."""
    for folder in [Path(path).resolve(), *Path(path).resolve().parents]:
        if folder.name in SHARDED_NAMES:
            raise ConfigError(f"{flag}={path} lies inside {folder}, a sharded checkpoint that "
                              f"the run's next save replaces whole; pick a path outside it")


def read_json_object(path, error=UserError) -> dict:
    """A JSON file that must hold an object (config.json, an index): `error` (the caller's kind of
    UserError) naming the file otherwise."""
    try:
        value = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:  # json's error and the decoder's are ValueErrors
        raise error(f"{path} is not valid JSON ({e}); the file is damaged: restore or re-create "
                    f"it") from e
    if not isinstance(value, dict):
        raise error(f"{path} holds a JSON {type(value).__name__}, not the object it should; "
                    f"restore it")
    return value


# ----------------------------------------------------------------------------- the command line

BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}  # any case, every script

# The rules check_ranges knows, each a predicate on a number; every one also requires a finite
# value. 2**63: a seed, as torch's generators take 64 signed bits.
RULES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1,
         "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1,
         "in [0, 2**63)": lambda v: 0 <= v < 2**63}


# A path or name given as "" would silently mean the current folder, or the flag's default.
EMPTY_PATH = "is empty; give a name or a path"


def nearest(word, known) -> Optional[str]:
    """The one of known that word most likely misspells: the same but for case, else difflib's
    closest in lower case; None when none is close."""
    folded = {str(k).lower(): k for k in known}
    match = difflib.get_close_matches(str(word).lower(), folded, n=1)
    return folded[match[0]] if match else None


def not_a_choice(flag, value, choices) -> ConfigError:
    """The error for a value that is none of choices: the nearest one, then all of them."""
    near = nearest(value, choices)
    hint = f"did you mean {near}? " if near is not None else ""
    return ConfigError(f"{flag}={value} is not a choice; {hint}choices: "
                       f"{', '.join(map(str, choices))}")


def boolean(key, value) -> bool:
    """A boolean key's value (a bool, 0 or 1, or one of BOOL_WORDS); a ConfigError otherwise."""
    if str(value).lower() in BOOL_WORDS:
        return BOOL_WORDS[str(value).lower()]
    raise ConfigError(f"--{key}={value}: give --{key} alone, --{key}=True or --{key}=False")


def check_ranges(cfg: dict, rules: dict):
    """Raise ConfigError for the first key outside its range, e.g. rules = {"beta1": "in [0, 1)"}.
    None (where a default allows it) passes: it means "derive this"."""
    for key, rule in rules.items():
        value = cfg[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and RULES[rule](value)):
            raise ConfigError(f"--{key} must be a finite number {rule}, got {value!r}")
