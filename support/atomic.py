"""
A file written whole or not at all, on the train path: text through a temporary and a rename
(`write_atomically`), a log's line appended whole (`append_line`), and a full disk, a full quota or a
file-size limit as one error naming the path and the space needed (`room_for`, DiskFull).
"""
import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path

from support.errors import DiskFull

# a write that found no room: a full disk, a full quota, a file-size limit (RLIMIT_FSIZE)
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def no_room(e) -> bool:
    """Whether e, or an error it wraps, is a write that found no room. torch.save raises a
    RuntimeError over the OSError; safetensors an error of its own whose text ends as Rust's io
    errors do, "(os error N)"."""
    while e is not None:
        if isinstance(e, OSError):
            code = e.errno
        else:
            rust = re.search(r"\(os error (\d+)\)", str(e))
            code = rust and int(rust[1])
        if code in NO_ROOM:
            return True
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def room_for(path, need, more=False):
    """The one place a full disk becomes a user error: a write inside the block that found no room
    raises DiskFull naming path and need() bytes (called only then; more: a lower bound). The
    caller removes what it had written."""
    try:
        yield
    except Exception as e:
        if not no_room(e):
            raise
        raise DiskFull(path, need(), more) from None


def write_atomically(path, data):
    """Write text or bytes to path through a temporary file and a rename: an interrupted write
    leaves the old file, a full disk the old file and DiskFull."""
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
    """Append line to the file at path whole or not at all: a full disk cuts the file back to its
    length before (no torn last line) and raises DiskFull. A log grows by a line a step, so it is
    appended to, not rewritten."""
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
