"""
Where a script writes its results: a result file checked before any work (`output_file`), the mark
a script leaves on its results (`mark`, from support/folders.py; `figure_metadata`, `written_here`)
so that replacing one checks a fact, a figure written whole or not at all (`save_figure`; text is
support/atomic.py's), and the temporaries that killed runs left behind (`clean_stale`).
"""
import io
import json
import os
import re
import shutil
from pathlib import Path

from support.atomic import write_atomically
from support.cli import not_in_a_checkpoint
from support.errors import ConfigError
from support.folders import mark


def output_file(path, flag, written_by=None) -> Path:
    """Check before any work that `path` can be written as a file (its folder is created): a long
    evaluation must not end in an error about where to put its result. written_by: the script whose
    earlier result (written_here) an existing file must be to be replaced, so a slip such as
    --json=out/RUN/ckpt.pt keeps the file. Raises ConfigError naming `flag`."""
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


def figure_metadata(path, script) -> dict:
    """matplotlib's savefig metadata carrying mark(script)."""
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


def save_figure(fig, path, script, **savefig):
    """A matplotlib figure drawn in memory, then written as write_atomically writes text (a full
    disk leaves no 0-byte figure), marked as script's (figure_metadata); the figure is closed."""
    import matplotlib.pyplot as plt  # the caller drew fig: matplotlib is here
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=Path(path).suffix[1:].lower() or None,
                    metadata=figure_metadata(path, script), **savefig)
    finally:
        plt.close(fig)
    write_atomically(path, buffer.getvalue())
