"""
The few helpers every script uses at its edges: `ArgumentParser` (the command-line dialect of the
argparse scripts), `reason` (an exception's first line), `require` (an optional package, or a
MissingPackage naming its pip line), `resolve_device` (auto = cuda, then mps, then cpu), `table`
(aligned plain-text columns), `output_file` (a result's path, checked before any work),
`not_in_a_checkpoint` (nothing is written into a sharded checkpoint's folder), the marks a script
leaves on its results (`mark`, `written_here`), `read_json_object` and `write_atomically`.
"""
import argparse
import difflib
import importlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from support.config import boolean
from support.errors import ConfigError, UserError

# An FSDP run's checkpoint folder (checkpoint.save_sharded), and its names while a save replaces it.
SHARDED = "ckpt.dcp"
SHARDED_NAMES = (SHARDED, f"{SHARDED}.tmp", f"{SHARDED}.old")

def reason(e) -> str:
    """An exception's first line for an error message; its class name when it has no message."""
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def table(rows, header) -> str:
    """Rows of values as aligned plain-text columns under header, two spaces apart (the scripts'
    printed tables)."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header] + rows)


class MissingPackage(UserError, ImportError):
    """An optional package that is not installed; the message names its pip line. Also an
    ImportError, so code that probes for a package with `except ImportError` keeps working."""


def require(module, purpose, pip=None):
    """import module, or a MissingPackage that names the pip line: optional packages are imported
    where used."""
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
        raise ConfigError(f"unknown device {name!r}; use auto or one of {', '.join(allowed)}")
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



def output_file(path, flag, written_by=None) -> Path:
    """Check before any work that `path` can be written as a file (its folder is created): a long
    evaluation or benchmark must not end in an error about where to put its result. written_by: the
    script whose earlier result (written_here) an existing file must be to be replaced, so a slip
    such as --json=out/RUN/ckpt.pt or --figure=photo.png keeps the file. Raises ConfigError naming
    `flag`."""
    p = Path(path)
    not_in_a_checkpoint(p, flag)
    if p.is_dir() or str(path).endswith(("/", "\\")):
        raise ConfigError(f"{flag}={path} is a folder; "
                          f"give a file name such as {p / 'results.json'}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        probe = p.parent / f".{p.name}.probe{os.getpid()}"
        probe.touch()
        probe.unlink()
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"cannot write {flag}={path}: part of its folder path is a file; "
                          f"pick another path") from None
    except OSError as e:
        raise ConfigError(f"cannot write {flag}={path} ({e.strerror or e}); "
                          f"pick a writable path") from None
    if written_by and p.is_file() and p.stat().st_size and not written_here(p, written_by):
        raise ConfigError(f"{flag}={path} exists and was not written by {written_by}; pick "
                          f"another path, or delete the file if it may go")
    return p


def mark(script) -> str:
    """What a script writes into its results (JSON's "written_by") and figures (their metadata),
    so that replacing one checks a fact rather than guessing from common keys. No parentheses: a
    PDF would escape them."""
    return f"{script}, Depth-Attention"


def figure_metadata(path, script) -> dict:
    """matplotlib's savefig metadata carrying mark(script) for a figure at path."""
    return {"Software" if Path(path).suffix.lower() == ".png" else "Creator": mark(script)}


def written_here(path, script) -> bool:
    """Whether the file at path is an earlier result of script: a JSON object whose "written_by"
    is mark(script), or a figure whose metadata holds it (PNG text chunks, PDF and SVG creator)."""
    p = Path(path)
    if p.stat().st_size > 1 << 26:  # an earlier result is far smaller; a larger file is not one
        return False
    data = p.read_bytes()
    if p.suffix.lower() == ".json":
        try:
            earlier = json.loads(data)
        except ValueError:  # not UTF-8, not JSON
            return False
        return isinstance(earlier, dict) and earlier.get("written_by") == mark(script)
    return mark(script).encode() in data


def stale_pid(path):
    """The pid in a temporary's name (NAME.tmp<pid>, NAME.old<pid>, train.bin.tmp<pid>) if that
    process is gone (or is this one, reborn under the same pid in a new container), else None."""
    m = re.fullmatch(r".+\.(?:tmp|old)(\d+)", Path(path).name)
    if not m:
        return None
    pid = int(m[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:  # alive, another user's
        return None
    return pid if pid == os.getpid() else None


def clean_stale(dest, hidden=False, inside=False, restorable=lambda old: True):
    """Remove what killed runs of a script left beside dest: the temporaries NAME.tmp<pid> it was
    writing and NAME.old<pid>, the dest a swap moved aside, which goes back in place first when
    dest is gone (a swap killed half-way) and restorable(it). hidden: the names start with a dot;
    inside: dest's own NAME.tmp<pid> files too."""
    dest = Path(dest)
    stem = f"{'.' if hidden else ''}{dest.name}"
    for old in dest.parent.glob(f"{stem}.old*"):
        pid = stale_pid(old)
        if pid is not None and not dest.exists() and restorable(old):
            os.rename(old, dest)
            print(f"restored {dest} from {old}, left by a killed run (pid {pid})")
    for path in [*dest.parent.glob(f"{stem}.tmp*"), *dest.parent.glob(f"{stem}.old*"),
                 *(dest.glob("*.tmp*") if inside and dest.is_dir() else [])]:
        pid = stale_pid(path)
        if pid is not None:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            print(f"removed {path}, left by a killed run (pid {pid})")


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
        raise error(f"{path} is not valid JSON ({e}); "
                    f"the file is damaged: restore or re-create it") from e
    if not isinstance(value, dict):
        raise error(f"{path} holds a JSON {type(value).__name__}, "
                    f"not the object it should; restore it")
    return value


def write_atomically(path, text):
    """Write text to path through a temporary file and a rename: an interrupted write leaves the old
    file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the command line

class _ShowDefaults(argparse.HelpFormatter):
    """An option's default in --help, unless unset (None, False, "") or named by its help."""

    def _get_help_string(self, action):
        d, text = action.default, action.help
        hide = d is None or d is False or d in ("", argparse.SUPPRESS) or "default" in text
        return text if hide else f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse in the dialect every script shares with train.py's --key=value: an option is
    --key=value or --key value; a boolean (add_flag) is a bare --flag or --flag=True/False/1/0;
    no abbreviations (--over is not --overwrite: a typo must not pick a flag); an unknown option
    names the nearest known one. An error is a ConfigError of one line (run_main prints it), so
    parse_args can check a command without running it; prog is the script's file name. --help
    shows the options' defaults (_ShowDefaults), beside what a script's formatter_class does."""

    def __init__(self, prog, formatter_class=argparse.HelpFormatter, **kwargs):
        if not issubclass(formatter_class, _ShowDefaults):
            formatter_class = type("HelpFormatter", (_ShowDefaults, formatter_class), {})
        super().__init__(prog=prog, allow_abbrev=False, formatter_class=formatter_class, **kwargs)
        self.flags = []

    def add_flag(self, name, help=None):
        """A boolean, False unless given: --name, or --name=True/False/1/0 (parse_known_args)."""
        self.flags.append(name)
        return self.add_argument(name, action="store_true", help=help)

    def parse_known_args(self, args=None, namespace=None):
        # argparse gives a store_true flag no value, and nargs="?" would take the next positional
        # as one (`--overwrite SRC OUT`): --flag=value is read here; a flag's last spelling wins
        last, rest, options = {}, [], True
        for arg in sys.argv[1:] if args is None else args:
            options = options and arg != "--"  # after --, everything is a positional
            key, eq, value = arg.partition("=")
            if options and key in self.flags:
                last[key] = boolean(key[2:], value) if eq else True
                if eq:
                    continue
            rest.append(arg)
        namespace, extras = super().parse_known_args(rest, namespace)
        for key, value in last.items():
            setattr(namespace, self._option_string_actions[key].dest, value)
        return namespace, extras

    def error(self, message):
        """One line, not argparse's usage block: the message, the nearest known option to an
        unknown one, and where the flags are listed."""
        if message.startswith("unrecognized arguments:"):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            unknown = [a.partition("=")[0] for a in message.split(":", 1)[1].split()]
            near = [m for a in unknown if a.startswith("--")
                    for m in difflib.get_close_matches(a, known, n=1)]
            message += f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(f"{message} (python {self.prog} --help lists the flags)")
