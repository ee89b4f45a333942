"""
Every file a script writes, by one rule: only into a folder that is new, empty or carries its
manifest, `.written_by.json`, naming the script and the files it wrote there (`claim`); --overwrite
removes only those, any other file is the user's, never deleted; never into a folder the command
reads. A file is written whole or not at all (a temporary, then a rename), and a full disk is one
error naming the path and the space it needs (DiskFull).
"""
import errno
import json
import math
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from checkpoint import checkpoint_path, checksums, read_checkpoint
from configurator import CheckpointError, ConfigError, UserError

MANIFEST = ".written_by.json"
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # a full disk, quota or file-size limit
# what train.py writes into its out_dir; train.out is the console log lab/ablate.py keeps there
RUN_FILES = ("train.lock", "config.json", "log.jsonl", "ckpt.pt", "ckpt.dcp", "train.out")


class DiskFull(UserError):
    def __init__(self, path, need, more=False):
        self.free = f"free {'more than ' if more else ''}{max(1, math.ceil(need / 1e6))} MB"
        super().__init__(f"cannot write {path}: no space left on device; {self.free} or pick "
                         f"another path")


def mark(script) -> str:  # a script's results ("written_by") and manifests carry it
    return f"{script}, Depth-Attention"


@contextmanager
def room_for(path, need, more=False):
    """A write inside that found no room is DiskFull naming path and need() bytes (more: at
    least). torch.save wraps the OSError; safetensors' Rust errors end "(os error N)"."""
    try:
        yield
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, KeyboardInterrupt):
            rust = re.search(r"\(os error (\d+)\)", str(cause))
            if getattr(cause, "errno", None) in NO_ROOM or rust and int(rust[1]) in NO_ROOM:
                raise DiskFull(path, need(), more) from None
            cause = cause.__cause__ or cause.__context__
        raise cause or e  # a Ctrl-C that torch.save's writer wrapped goes on as itself


def write_atomically(path, data):
    """Text or bytes to path through a temporary and a rename: a kill leaves the old file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    data = data.encode() if isinstance(data, str) else data
    try:
        with room_for(path, lambda: len(data)):
            tmp.write_bytes(data)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_line(path, line):
    """One line appended whole or not at all: a full disk cuts the file back (no torn line)."""
    data = (line + "\n").encode()
    with open(path, "ab", buffering=0) as f:
        end = os.fstat(f.fileno()).st_size
        try:
            with room_for(path, lambda: len(data)):
                done = 0
                while done < len(data):  # a write(2) may write part and fail on the next
                    done += f.write(data[done:])
        except DiskFull:
            f.truncate(end)
            raise


def save_checkpoint(obj, path):
    """torch.save obj and its checksums to a synced temporary beside path, then rename: a kill
    leaves the previous checkpoint or the new one, never a torn file."""
    path, tmp = Path(path), Path(path).with_name(f"{Path(path).name}.tmp{os.getpid()}")
    obj = {**obj, "checksums": checksums(obj)}

    class Count:  # what torch.save writes, counted without a file: the space it needs
        n, flush = 0, lambda self: None  # (torch.save flushes the file it is given)

        def write(self, data):
            self.n += len(data)
            return len(data)
    try:
        with room_for(path, lambda: torch.save(obj, count := Count()) or count.n), \
                open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # a full disk or an interrupt: the old checkpoint stays, the partial goes
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(folder):  # a rename inside it, durable
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def not_in_a_checkpoint(path, flag):
    for folder in [Path(path).resolve(), *Path(path).resolve().parents]:
        if folder.name.startswith("ckpt.dcp"):
            raise ConfigError(f"{flag}={path} lies inside {folder}, a sharded checkpoint that the "
                              f"run's next save replaces whole; pick a path outside it")


def manifest(folder) -> dict:
    """The folder's manifest, {} for none or one not of this form (a plain file of relative paths
    down the folder: a forged one reaches nothing outside it)."""
    f = Path(folder) / MANIFEST
    try:
        data = {} if f.is_symlink() else json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    plain = isinstance(files, list) and all(isinstance(n, str) and "\\" not in n and not {
        "", ".", ".."} & set(n.split("/")) for n in files)
    return data if plain and isinstance(data.get("written_by"), str) else {}


def listing(names, most=4) -> str:
    return ", ".join(names[:most]) + f" and {len(names) - most} more" * (len(names) > most)


class Folder:
    """A folder claim() let script write; names: its manifest's files and folders, its own with
    their killed writes (NAME.tmp<pid>, NAME.old<pid>); foreign: every other file, at any depth."""

    def __init__(self, path: Path, script, flag, names):
        self.path, self.script, self.flag, self.names = path, script, flag, sorted(set(names))
        self.foreign = self.unlisted(path) if path.is_dir() else []

    def unlisted(self, folder, rel="") -> list:
        return [f for p in sorted(folder.iterdir()) if not self.owns(n := rel + p.name) for f in (
            self.unlisted(p, n + "/") if p.is_dir() and not p.is_symlink() else [n])]

    def owns(self, name) -> bool:
        stem, _, rest = name.lstrip(".").rpartition(".")
        killed = rest.startswith(("tmp", "old")) and stem in [*self.names, MANIFEST[1:]]
        return name in (*self.names, MANIFEST) or killed

    def record(self):
        """Create the folder and write the manifest, before any file it names."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path / MANIFEST, json.dumps(
                {"written_by": mark(self.script), "files": self.names}, indent=1) + "\n")
        except OSError as e:  # a file on its path, a read-only folder (a full disk is DiskFull)
            raise ConfigError(f"cannot write {self.flag}={self.path} ({e.strerror or e}): part of "
                              f"its path is a file or not writable; pick another path") from None

    def clear(self, keep=()):
        """--overwrite in place: delete its top-level names (never through a link), but keep."""
        for p in (self.path / n for n in self.names if n not in keep and "/" not in n):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        if self.foreign:
            print(f"--overwrite kept {listing(self.foreign)} in {self.path}: {self.script} did "
                  f"not write {'it' if len(self.foreign) == 1 else 'them'}")

    def refuse_foreign(self):  # a folder replaced whole holds nothing but its own files
        if self.foreign:
            raise ConfigError(f"{self.flag}={self.path} holds {listing(self.foreign)}, which "
                              f"{self.script} did not write; move those out first")


def seal(tmp, script):  # the manifest of a folder written whole at tmp, before its rename
    Folder(Path(tmp), script, "", Folder(Path(tmp), script, "", []).foreign).record()


def claim(path, script, flag, names=(), sources=(), legacy=lambda folder: []) -> Folder:
    """The folder at path, checked before any work to be one script may write: not a file, not
    the current folder, not a source of this command (sources: (flag, path)) nor holding one;
    new, empty or marked by script (legacy(folder): what an earlier version of script wrote there
    before manifests). names: the files script writes there."""
    p, where = Path(path), Path(path).resolve()
    not_in_a_checkpoint(p, flag)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag}={path} is a file; give a folder")
    for source_flag, source in sources:  # cleared or replaced, the folder would take it along
        src = Path(source).resolve() if source and Path(source).exists() else None
        if src and (src == where or where in src.parents):
            raise ConfigError(f"{flag}={path} {'is' if src == where else 'holds'} {source_flag}="
                              f"{source}, which this command reads; write into another folder")
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise ConfigError(f"{flag}={path} is the current folder or holds it; name a new folder "
                          f"inside it, e.g. {p / 'out'}")
    entries, found = [e.name for e in p.iterdir()] if p.is_dir() else [], manifest(p)
    if found.get("written_by") == mark(script):
        return Folder(p, script, flag, [*names, *found["files"]])
    if found and entries:
        raise ConfigError(f"{flag}={path} was written by {found['written_by'].split(',')[0]}, "
                          f"not {script}; write into a new folder")
    earlier = legacy(p) if entries else []
    if entries and not earlier:
        raise ConfigError(f"{flag}={path} holds {listing(sorted(entries))} and was not written by "
                          f"{script} (no {MANIFEST} of it); write into a new or empty folder")
    return Folder(p, script, flag, [*names, *earlier])


def output_file(path, flag, written_by=None) -> Path:
    """A result file checked writable before any work (its folder made); written_by: the script
    whose earlier result (JSON "written_by", or a figure's metadata) a file must be to go."""
    p = Path(path)
    not_in_a_checkpoint(p, flag)
    if p.is_dir() or str(path).endswith(("/", "\\")):
        raise ConfigError(f"{flag}={path} is a folder; give a file name, e.g. {p / 'results.json'}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        probe = p.parent / f".{p.name}.probe{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write {flag}={path} ({e.strerror or e}); pick a writable "
                          f"path") from None
    if written_by and p.is_file() and p.stat().st_size:
        data = p.read_bytes() if p.stat().st_size < 1 << 26 else b""  # a result is far smaller
        try:
            ours = json.loads(data).get("written_by") == mark(written_by)
        except (ValueError, AttributeError):  # not JSON, or not an object: maybe a figure
            ours = p.suffix.lower() != ".json" and mark(written_by).encode() in data
        if not ours:
            raise ConfigError(f"{flag}={path} exists and was not written by {written_by}; pick "
                              f"another path, or delete the file if it may go")
    return p


def stale_pid(path):
    """The pid in a temporary's name (NAME.tmp<pid>, NAME.old<pid>) if that process is gone (or
    is this one, reborn under the same pid in a new container), else None."""
    m = re.fullmatch(r".+\.(?:tmp|old)(\d+)", Path(path).name)
    if not m:
        return None
    try:
        os.kill(int(m[1]), 0)
    except ProcessLookupError:
        return int(m[1])
    except PermissionError:  # alive, another user's
        return None
    return int(m[1]) if int(m[1]) == os.getpid() else None


def clean_stale(dest, hidden=False, inside=False, restorable=lambda old: True):
    """Remove what killed runs left beside dest: NAME.tmp<pid> and NAME.old<pid> (the dest a swap
    moved aside, put back first when dest is gone and restorable(it)); hidden: the names start
    with a dot; inside: dest's own NAME.tmp<pid> files too."""
    dest = Path(dest)
    stem = f"{'.' if hidden else ''}{dest.name}"
    for old in dest.parent.glob(f"{stem}.old*"):
        if stale_pid(old) is not None and not dest.exists() and restorable(old):
            os.rename(old, dest)
            print(f"restored {dest} from {old}, left by a killed run")
    for path in [*dest.parent.glob(f"{stem}.tmp*"), *dest.parent.glob(f"{stem}.old*"),
                 *(dest.glob("*.tmp*") if inside and dest.is_dir() else [])]:
        if stale_pid(path) is not None:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            print(f"removed {path}, left by a killed run")


def run_folder(out_dir, resuming, init_from=""):
    """out_dir as a folder train.py may write, checked before any work: new, empty or an earlier
    run's (one from before manifests: by what its checkpoint holds), never the --init_from read."""
    def earlier_run(folder):  # (a file's name proves nothing: a nanoGPT out_dir has a ckpt.pt)
        try:
            return read_checkpoint(checkpoint_path(folder), ("model_config",)) and list(RUN_FILES)
        except CheckpointError:
            return []
    return claim(out_dir, "train.py", "--out_dir", RUN_FILES, legacy=earlier_run,
                 sources=[] if resuming else [("--init_from", init_from)])


def lock_run_folder(out_dir, resuming, overwrite, init_from=""):
    """out_dir with its manifest, locked for this process's life (flock: released when the process
    dies, so a killed run never blocks the next; a second run is refused); a fresh start over a
    checkpoint needs overwrite, which deletes only train.py's files. Returns the open lock."""
    import fcntl  # POSIX, as train.py
    folder = run_folder(out_dir, resuming, init_from)
    out, path = folder.path, folder.path / "train.lock"
    held = [n for n in ("ckpt.pt", "ckpt.dcp", "ckpt.dcp.old") if (out / n).exists()]
    if held and not resuming and not overwrite:  # before any write: a refusal writes nothing
        raise CheckpointError(f"{out} already holds a checkpoint; continue it with --resume=True, "
                              f"or start over with --overwrite=True (deleting train.py's files)")
    folder.record()
    try:  # never written, nor opened through a link: a link, symbolic or hard, is refused
        lock = open(os.open(path, os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644))
        if os.fstat(lock.fileno()).st_nlink != 1 or not path.is_file():  # (O_NOFOLLOW: no link)
            raise OSError(errno.ELOOP, "")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:  # EAGAIN: another run holds it; ELOOP: a link (O_NOFOLLOW's, or ours)
        why = {errno.EAGAIN: "another train.py is writing there; wait for it",
               errno.ELOOP: "a link or not a plain file; remove it"}.get(e.errno, e.strerror)
        raise CheckpointError(f"cannot lock {path}: {why}, or pick another --out_dir") from None
    for torn in out.glob("ckpt.pt.tmp*"):  # a write cut short by a kill; no other writer
        torn.unlink()
    shutil.rmtree(out / "ckpt.dcp.tmp", ignore_errors=True)
    if (out / "ckpt.dcp.old").is_dir() and not (out / "ckpt.dcp").exists():
        (out / "ckpt.dcp.old").rename(out / "ckpt.dcp")  # a sharded save killed between renames
    shutil.rmtree(out / "ckpt.dcp.old", ignore_errors=True)
    if held and not resuming:
        print(f"warning: --overwrite=True: deleting {held[0]} and the log of {out}")
        folder.clear(keep=["train.lock", MANIFEST])
    return lock
