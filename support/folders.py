"""
Which folders a script may write. A script that writes a folder (train.py's run, export.py's export,
prepare_data.py's dataset, course/make.py's student copy, ablate.py's sweep) writes only into one
that is new, empty, or carries its own manifest, `.written_by.json`, naming the script and the files
it writes there. --overwrite removes only those files; any other file is the user's, kept (a run
folder) or named in a refusal (a folder replaced whole), never deleted. A folder the same command
reads (its --init_from, the run an export reads, a corpus) is never its target, nor a folder
holding one.

    folder = claim(out_dir, "train.py", "--out_dir", RUN_FILES, [("--init_from", init_from)])
    folder.record()  # the manifest first, then the files it names
"""
import json
import shutil
from pathlib import Path

from support.cli import not_in_a_checkpoint
from support.errors import ConfigError
from support.atomic import write_atomically

MANIFEST = ".written_by.json"


def mark(script) -> str:
    """What a script writes into its results (JSON's "written_by"), figures (their metadata) and
    folders (support/folders.py's manifest), so that replacing one checks a fact rather than
    guessing from common keys. No parentheses: a PDF would escape them."""
    return f"{script}, Depth-Attention"


class Folder:
    """A folder claim() let script write. names: the files its manifest lists; they and their
    killed writes (NAME.tmp<pid>, NAME.old<pid>) are its own; foreign: every other name in it."""

    def __init__(self, path: Path, script, flag, names):
        self.path, self.script, self.flag, self.names = path, script, flag, sorted(set(names))
        entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        self.foreign = [n for n in entries if not self.owns(n)]

    def owns(self, name) -> bool:
        stem, _, rest = name.lstrip(".").rpartition(".")
        killed_write = rest.startswith(("tmp", "old")) and stem in [*self.names, MANIFEST[1:]]
        return name in (*self.names, MANIFEST) or killed_write

    def record(self):
        """Create the folder and write the manifest, before any file it names."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path / MANIFEST, json.dumps(
                {"written_by": mark(self.script), "files": self.names}, indent=1) + "\n")
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(f"cannot write {self.flag}={self.path}: part of its folder path is a "
                              f"file; pick another path") from None
        except OSError as e:  # a read-only folder or file system (a full disk is DiskFull)
            raise ConfigError(f"cannot write {self.flag}={self.path} ({e.strerror or e}); pick a "
                              f"folder you can write to") from None

    def clear(self, keep=()):
        """--overwrite in place: delete the files the manifest lists, but keep; the user's stay."""
        for p in (self.path / n for n in self.names if n not in keep):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        if self.foreign:
            print(f"--overwrite kept {listing(self.foreign)} in {self.path}: {self.script} did "
                  f"not write {'it' if len(self.foreign) == 1 else 'them'}")

    def refuse_foreign(self):
        """A folder replaced whole must hold nothing but its own files."""
        if self.foreign:
            raise ConfigError(
                f"{self.flag}={self.path} holds {listing(self.foreign)}, which {self.script} did "
                f"not write; --overwrite replaces only its own files: move those out first")


def seal(tmp, script):
    """The manifest of a folder written whole at tmp, before it is renamed into place."""
    Folder(Path(tmp), script, "", [p.name for p in Path(tmp).iterdir()]).record()


def listing(names, most=4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def manifest(folder) -> dict:
    """The folder's manifest, {} for none or one not of this form: a plain file listing plain
    names, so a forged one reaches nothing outside the folder."""
    f = Path(folder) / MANIFEST
    try:
        data = {} if f.is_symlink() else json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    plain = isinstance(files, list) and all(
        isinstance(n, str) and n not in ("", ".", "..") and not {"/", "\\"} & set(n) for n in files)
    return data if plain and isinstance(data.get("written_by"), str) else {}


def claim(path, script, flag, names=(), sources=(), legacy=lambda folder: []) -> Folder:
    """The folder at path, checked before any work to be one script may write: named, not a file,
    not the current folder, a source of this command (sources: (flag, path) pairs) or a folder
    holding one, and new, empty or marked by script (legacy(folder): the names an earlier version
    of script wrote into a folder before manifests, [] for any other). names: the files script
    writes there. Raises ConfigError naming flag and the fix."""
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty; name a folder")
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
