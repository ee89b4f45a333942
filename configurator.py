"""
Every script's command line, in one dialect, and the errors a user can fix.

    python train.py configs/minipile_value.py --n_layer=8 --depth_mode vanilla --compile
    python prepare_data.py text --input a.txt b.txt --name=mine

A script's keys are a table {name: Key}: `--key=value`, `--key value`, a bare `--flag`, a list up
to the next option; positionals fill positional keys, or are config files (assignments, applied in
order; `base_config = "base.py"` starts from another). A value takes its default's type; anything
else is a ConfigError naming the nearest key or choice. `run_main` prints a UserError as one line,
`error: ...`, exit 2 (anything else is a bug: a traceback), and Ctrl-C as `interrupted`, exit 130,
from a script's first line (`interruptible`). Standard library only: prepare_data.py needs no torch.
"""
import ast
import difflib
import importlib
import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional


class UserError(Exception):
    """Bad input, a missing file, a damaged folder: the message names the fix. Its kinds: a
    command line or config (ConfigError), a run folder, checkpoint or model folder
    (CheckpointError), a dataset, corpus or tokenizer (DataError), a package to install."""


class ConfigError(UserError, ValueError): pass
class CheckpointError(UserError): pass
class DataError(UserError): pass
class MissingPackage(UserError, ImportError): pass
class ShowHelp(Exception): pass  # --help: run_main prints it and exits 0


def require(module, purpose, pip=None):
    """import module, or a MissingPackage naming the pip line (optional packages, where used)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackage(f"{purpose} needs {module}: pip install {pip or module.split('.')[0]}"
                             ) from e


def reason(e) -> str:
    """An exception's first line, or its class's name."""
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


# ----------------------------------------------------------------------------- Ctrl-C and exits

def say(line):
    """One line on stderr, from rank 0 only: under torchrun every rank stops alike."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _stop(signum, frame):
    say("interrupted")
    os._exit(130)  # 128 + SIGINT; an exception could be swallowed by an import's `except`


def interruptible():
    """Ctrl-C, from here to the exit, is one line and exit 130 (a script's first line: its imports
    take seconds). A background job's ignored SIGINT stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop)


def run_main(main, argv=None) -> int:
    """main(argv)'s exit status: a user error (a model.ConfigError too) or Ctrl-C is one line on
    stderr, a closed pipe (`| head`) silence, anything else a traceback."""
    ours = signal.getsignal(signal.SIGINT) is _stop
    if ours:  # inside main Ctrl-C is a KeyboardInterrupt, which its own handlers may take
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return 0
    except ShowHelp as e:
        print(e)
        return 0
    except KeyboardInterrupt as e:
        say(f"interrupted{f'; {e}' if str(e) else ''}")
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except Exception as e:
        model = sys.modules.get("model")
        if not isinstance(e, (UserError, model.ConfigError if model else UserError)):
            raise
        say(f"error: {e}")
        return 2  # argparse's usage error; 1 is a bug's traceback
    finally:
        if ours:
            signal.signal(signal.SIGINT, _stop)


# ----------------------------------------------------------------------------- keys

RULES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1,
         "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1,
         "in (0, 0.5]": lambda v: 0 < v <= 0.5, "in [0, 2**63)": lambda v: 0 <= v < 2**63}
BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}  # any case


@dataclass(frozen=True)
class Key:
    """One key of a script's table."""
    default: object
    help: str = ""
    check: Optional[str] = None      # a rule of RULES, e.g. "> 0" (and finite)
    choices: Optional[tuple] = None  # the values it takes
    kind: Optional[type] = None      # a None default's type
    path: bool = False               # a file or folder: "" and "None" refused, ~ expanded
    positional: bool = False         # given without --key=, in the table's order
    result: bool = True              # train.py's: False = changes no number a run reports
    per_invocation: bool = False     # train.py's: how this command runs, never from a checkpoint


def table(rows, header) -> str:
    """Rows of values as aligned plain-text columns under header (a script's report)."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header] + rows)


def nearest(word, known) -> Optional[str]:
    """The one of known that word most likely misspells (another case first), or None."""
    folded = {str(k).lower(): k for k in known}
    match = difflib.get_close_matches(str(word).lower(), folded, n=1)
    return folded[match[0]] if match else None


def unknown_key(key, known, where=""):
    near = nearest(key, known)
    return ConfigError(f"{where}unknown key {key!r}; " + (
        f"did you mean {'--' * (not where)}{near}? (--help lists every key)" if near
        else f"known keys: {', '.join(sorted(known))}"))


def not_a_choice(flag, value, choices) -> ConfigError:
    near = nearest(value, choices)
    return ConfigError(f"{flag}={value} is not a choice; {f'did you mean {near}? ' if near else ''}"
                       f"choices: {', '.join(map(str, choices))}")


# ----------------------------------------------------------------------------- parsing

def updates(argv, keys, files=None) -> list:
    """[(key, raw value)] in argv's order: positionals, options, and the assignments of config
    files, a positional of a script without positional keys read by files(path, keys)."""
    slots, out, i = [k for k, key in keys.items() if key.positional], [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg == "--":
            raise ConfigError("a bare -- ends nothing here: arguments and options come in any "
                              "order; drop it")
        if not arg.startswith("-") or arg == "-":
            if not (slots or files):
                raise ConfigError(f"unexpected argument {arg!r}; --help lists the keys")
            out += [(slots.pop(0), arg)] if slots else files(arg, keys).items()
            continue
        name, eq, text = arg.lstrip("-").partition("=")
        if not arg.startswith("--") or name not in keys:
            raise unknown_key(name, keys) if arg.startswith("--") else ConfigError(
                f"{arg}: options take two dashes, as --{nearest(name, keys) or 'key'}{eq}{text}")
        default = keys[name].default
        if not eq and isinstance(default, bool):  # a bare flag, or --flag true
            eq = i < len(argv) and argv[i].lower() in BOOL_WORDS
            text, i = (argv[i], i + 1) if eq else ("True", i)
        elif not eq and isinstance(default, tuple):
            text = []
            while i < len(argv) and not argv[i].startswith("--"):
                text, i = text + [argv[i]], i + 1
        elif not eq:
            if i == len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"--{name} needs a value: --{name}=VALUE or --{name} VALUE")
            text, i = argv[i], i + 1
        out.append((name, text))
    return out


def coerce(value, key: Key):
    """A raw value (argv's text, a config file's value) as key takes it; check() refuses a wrong
    type. A string key takes the text as typed; None is a value where the default is None."""
    if value == "None" and key.default is None:
        return None
    if isinstance(key.default, tuple):
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if isinstance(value, str) and not isinstance(key.default, str) and key.kind is not str:
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # a bare word: a wrong type, named by check()
            pass
    if bool in (type(key.default), key.kind) and str(value).lower() in BOOL_WORDS:
        value = BOOL_WORDS[str(value).lower()]
    return os.path.expanduser(value) if key.path and isinstance(value, str) else value


def check(cfg: dict, keys: dict):
    """A ConfigError for the first value its key does not take."""
    for name, key in keys.items():
        value, kind = cfg[name], key.kind or type(key.default)
        if value is None and key.default is not None:
            raise ConfigError(f"--{name}=None: give a value, e.g. the default "
                              f"--{name}={key.default!r}")
        if value is None:
            continue
        if kind is float and type(value) is int:
            value = cfg[name] = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise ConfigError(f"--{name}={value}: give --{name} alone, --{name}=True or "
                              f"--{name}=False" if kind is bool else f"--{name}: expected "
                              f"{kind.__name__} like the default {key.default!r}, got {value!r}")
        if key.path and (not value.strip() or value == "None"):
            raise ConfigError(f"--{name}={value!r} names no file or folder; give one, e.g. "
                              f"--{name}={key.default or 'PATH'}")
        if key.path and max(len(os.fsencode(part)) for part in value.split(os.sep)) > 255:
            raise ConfigError(f"--{name}: a name in it is over 255 bytes, too long for a file")
        if key.choices and value not in key.choices:
            raise not_a_choice(f"--{name}", value, key.choices)
        if key.check and not (math.isfinite(value) and RULES[key.check](value)):
            raise ConfigError(f"--{name} must be a finite number {key.check}, got {value!r}")


def parse(argv, keys: dict, doc="", base=None, files=None) -> dict:
    """The config argv asks for: base (the defaults, or a resumed run's) <- positionals, options
    and config files (updates) in argv's order, every value checked. --help: ShowHelp."""
    if "-h" in argv or "--help" in argv:
        raise ShowHelp(doc.strip() + "\n\nkeys (--key=value or --key value; a bare --flag sets a "
                       "boolean):\n" + "\n".join(
                           f"  {k.upper() if key.positional else f'--{k}={key.default!r}':<34}  "
                           f"{key.help}{f'; one of {key.choices}' * bool(key.choices)}".rstrip()
                           for k, key in keys.items()))
    cfg = {name: key.default for name, key in keys.items()} if base is None else dict(base)
    for name, value in updates(argv, keys, files):
        cfg[name] = coerce(value, keys[name])
    if missing := [k for k, key in keys.items() if key.positional and cfg[k] is None]:
        raise ConfigError(f"missing {missing[0].upper()}: --help says what to give")
    check(cfg, keys)
    return cfg


def resolve_device(name, local_rank=None) -> str:
    """The device a script runs on: auto is the first of cuda, mps, cpu this machine has (cuda:N
    names a GPU); under torchrun (local_rank) cuda is this rank's GPU."""
    import torch  # only the scripts that run a model call this
    have = [d for d, ok in (("cuda", torch.cuda.is_available()),
                            ("mps", torch.backends.mps.is_available()), ("cpu", True)) if ok]
    kind, _, index = (have[0] if name == "auto" else name).partition(":")
    if kind not in have or index and not (kind == "cuda" and index.isdigit()
                                          and int(index) < torch.cuda.device_count()):
        raise not_a_choice("--device", name, ("auto", *have))
    name = f"{kind}:{index}" if index else kind
    return f"cuda:{local_rank}" if name == "cuda" and local_rank is not None else name
