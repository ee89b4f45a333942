"""
The OS sandbox a graded child runs in, made by bubblewrap (0.7 or later): every namespace new, a
read-only view of the system's libraries and of the Python environment wherever it lives, model.py
passed by value, no host path in it. Bounded as a whole everywhere by a seccomp filter, hard limits
and small read-only tmpfs; where a cgroup can be made, also by one memory budget and a task count.
"""
import errno
import io
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import zipfile
from functools import cache
from pathlib import Path

FIX = ("install bubblewrap 0.7 or later (apt-get install bubblewrap) and allow user namespaces "
       "(sysctl kernel.unprivileged_userns_clone=1), or practise unsandboxed with --no_sandbox "
       "(not for credit)")
MEMORY, TASKS = 2 << 30, 64  # the whole sandbox, where a cgroup holds it
ADDRESS_SPACE, FILES = 6 << 30, 128  # each process: torch maps ~2 GiB at import
TMPFS = 1 << 20  # every tmpfs's size: read-only once model.py is in /work
WORK, SOURCE_LIMIT = "/work", 4 << 20  # where the child starts; the largest model.py it runs
CGROUPS = "/sys/fs/cgroup"
# (audit arch, clone, the syscalls refused): fork, vfork, shmget, semget, msgget, mq_open,
# unshare, setns, io_uring_setup; clone3 answers ENOSYS (threads fall back to clone)
SYSCALLS = {"x86_64": (0xC000003E, 56, (57, 58, 29, 64, 68, 240, 272, 308, 425)),
            "aarch64": (0xC00000B7, 220, (194, 190, 186, 180, 97, 268, 425))}


def preamble(paths=()) -> str:
    """The child's first lines: hard limits it cannot raise (a write fails with EFBIG), the
    grader's sys.path folders after its own, tempfile's folder named (its probe would fail)."""
    return f"""import resource, signal, sys, tempfile
for limit, n in ((resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_CORE, 0),
                 (resource.RLIMIT_AS, {ADDRESS_SPACE}), (resource.RLIMIT_NOFILE, {FILES})):
    resource.setrlimit(limit, (n, n))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sys.path += {list(paths)!r}
tempfile.tempdir = "/tmp"
"""


def inside(path, folders) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


@cache  # a child starts again after each failed test
def environment(hidden) -> tuple:
    """(folders to bind, folders on sys.path): the interpreter's prefixes and folder, sys.path's
    and those of the libraries mapped here, less a hidden folder's unless a prefix (a .venv)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                sys.base_exec_prefix, sysconfig.get_paths()["stdlib"])}
    maps = (line.split(None, 5)[-1].strip() for line in open("/proc/self/maps"))
    mapped = {os.path.dirname(p) for p in maps if ".so" in os.path.basename(p)}  # kept if a folder
    path = [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
    folders = {os.path.realpath(p) for p in (*path, *mapped, os.path.dirname(sys.executable),
                                             os.path.dirname(os.path.realpath(sys.executable)))}
    keep = lambda p: os.path.isdir(p) and (inside(p, prefixes) or not (
        inside(p, hidden) or any(inside(h, [p]) for h in hidden)))
    folders = sorted(f for f in prefixes | folders if keep(f))
    return ([f for f in folders if not inside(f, [g for g in folders if g != f])],
            [p for p in dict.fromkeys(path) if keep(p)])


@cache
def seccomp() -> bytes:
    """The seccomp program bwrap loads: SYSCALLS's, a clone without CLONE_THREAD and other ABIs
    refused; b"" on a machine SYSCALLS does not know."""
    if platform.machine() not in SYSCALLS:
        return b""
    arch, clone, refused = SYSCALLS[platform.machine()]
    n, allow, eperm = len(refused), 0x7FFF0000, 0x50000 | errno.EPERM
    program = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, eperm), (0x20, 0, 0, 0),
               (0x35, n + 6, 0, 0x40000000), (0x15, n + 6, 0, 435), (0x15, n + 1, 0, clone),
               *((0x15, n + 3 - i, 0, nr) for i, nr in enumerate(refused)), (0x06, 0, 0, allow),
               (0x20, 0, 0, 16), (0x45, 0, 1, 0x10000), (0x06, 0, 0, allow), (0x06, 0, 0, eperm),
               (0x06, 0, 0, 0x50000 | errno.ENOSYS)]
    return b"".join(code.to_bytes(2, "little") + bytes((jt, jf)) + k.to_bytes(4, "little")
                    for code, jt, jf, k in program)


def cgroup() -> list:
    """A new cgroup's folders below this process's own, limits written: v1's memory and pids,
    else v2's; [] where this process may not make one."""
    own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().split())
    name = f"course-grade-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    v1 = [("memory", {"memory.limit_in_bytes": MEMORY, "memory.memsw.limit_in_bytes": MEMORY}),
          ("pids", {"pids.max": TASKS})]
    for layout in (v1, [("", {"memory.max": MEMORY, "pids.max": TASKS, "memory.swap.max": 0})]):
        made = []
        try:
            for controller, limits in layout:
                made.append(Path(CGROUPS, controller, own[controller].strip("/"), name))
                made[-1].mkdir()
                for file, value in limits.items():  # swap's where the kernel counts it
                    if "sw" not in file or (made[-1] / file).exists():
                        (made[-1] / file).write_text(str(value))
            return made
        except (OSError, KeyError):
            remove(made)
    return []


def remove(folders):
    """Every process left in the cgroup killed, then its folders removed."""
    for folder in folders:
        for _ in range(500):
            try:
                for pid in (folder / "cgroup.procs").read_text().split():
                    os.kill(int(pid), 9)
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # a process not yet gone
                time.sleep(0.01)


def out_of_memory(folders) -> bool:
    """Whether the kernel killed a process of the cgroup for its memory limit."""
    files = [f / name for f in folders for name in ("memory.oom_control", "memory.events")]
    return any(line.startswith("oom_kill ") and line.split()[1] != "0"
               for file in files if file.exists() for line in file.read_text().splitlines())


def bwrap(fds, roots, hidden) -> list:
    """bwrap's options: Python's folders bound, the hidden ones among them covered,
    model.py and the seccomp program read from fds."""
    args = ["--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "grading",
            "--size", str(TMPFS), "--tmpfs", "/tmp", "--size", str(TMPFS), "--tmpfs", WORK,
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):  # merged /usr: links into it
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += [a for f in ("/etc/ld.so.cache", "/etc/ld.so.conf") for a in ("--ro-bind-try", f, f)]
    for root in roots:
        if not inside(root, ["/usr"]):
            args += ["--ro-bind", root, root]
    for folder in (h for h in hidden if inside(h, [*roots, "/usr"])):
        args += ["--size", str(TMPFS), "--tmpfs", folder, "--remount-ro", folder]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "0444", "--file", str(fds[0]),
             f"{WORK}/model.py", *(["--seccomp", str(fds[1])] if len(fds) > 1 else []),
             *(a for d in (WORK, "/tmp", "/dev", "/") for a in ("--remount-ro", d)),
             "--chdir", WORK, "--clearenv", "--setenv", "HOME", WORK, "--setenv", "PATH",
             "/usr/bin:/bin", "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "TORCHINDUCTOR_CACHE_DIR", "/tmp"]  # torch's import makes it: it exists
    return args


class Sandboxed:
    """`python -c code` on model.py's bytes, in the sandbox (its options through a descriptor: its
    /proc shows none), or unsandboxed (practice). kill() ends it and everything it started."""

    def __init__(self, code, source: bytes, fds=(), hidden=(), sandboxed=True, **popen):
        roots, paths = environment(hidden)
        argv = [sys.executable, "-I", "-B", "-c", preamble(paths) + code]
        self.cgroup, self.tmp, memfds = [], None, []
        popen = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, **popen,
                 "stdin": subprocess.DEVNULL, "start_new_session": True}  # its kill reaches all
        if not sandboxed:
            self.tmp = tempfile.TemporaryDirectory(prefix="grade", ignore_cleanup_errors=True)
            Path(self.tmp.name, "model.py").write_bytes(source)
            self.proc = subprocess.Popen(argv, cwd=self.tmp.name, pass_fds=fds, env={
                "PATH": os.defpath, "HOME": self.tmp.name, "OMP_NUM_THREADS": "1"}, **popen)
            return
        data = [source, *filter(None, [seccomp()])]
        memfds = [os.memfd_create("data") for _ in range(len(data) + 1)]
        data.append(b"".join(a.encode() + b"\0" for a in bwrap(memfds[:-1], roots, hidden)))
        for fd, b in zip(memfds, data):
            os.write(fd, b)
            os.lseek(fd, 0, 0)
        enter = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1/cgroup.procs" || exit 125; '
                 'shift; n=$((n - 1)); done; exec "$@"')
        self.cgroup = cgroup()
        try:  # the PID namespace's end kills what it started
            self.proc = subprocess.Popen(
                ["/bin/sh", "-c", enter, "sh", str(len(self.cgroup)), *map(str, self.cgroup),
                 shutil.which("bwrap"), "--args", str(memfds[-1]), "--", *argv],
                pass_fds=(*fds, *memfds), env={}, **popen)
        except BaseException:
            remove(self.cgroup)
            raise
        finally:
            for fd in memfds:
                os.close(fd)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait()
        remove(self.cgroup)
        if self.tmp:
            self.tmp.cleanup()


@cache
def problem(hidden=()) -> str:
    """None if the sandbox starts here and this interpreter imports torch in it, else one line
    saying why and the fix (once a process)."""
    if shutil.which("bwrap") is None:
        return f"no sandbox: the bwrap command is missing; {FIX}"
    box = Sandboxed("import torch", b"", hidden=hidden, stderr=subprocess.PIPE)
    try:
        err = box.proc.communicate(timeout=120)[1].decode(errors="replace").strip().splitlines()
    except subprocess.TimeoutExpired:
        err = ["bwrap: it did not start in 120 s"]
    finally:
        box.kill()
    if box.proc.returncode == 0:
        return None
    why = (err or [f"exit {box.proc.returncode}"])[-1]
    if why.startswith("bwrap:") and "execvp" not in why:  # not its namespaces: the interpreter
        return f"no sandbox: bwrap cannot start here ({why}); {FIX}"
    return (f"no sandbox: {sys.executable} does not start in the sandbox with torch ({why}); "
            f"run the grader with the Python environment that has torch")


def read_inside(folder, relative, limit) -> bytes:
    """The bytes of folder/relative, no part of it followed if a link (ELOOP, ENOTDIR), its size
    checked before it is read (EFBIG)."""
    parts = Path(relative).parts
    if ".." in parts or Path(relative).is_absolute():  # (dir_fd is ignored for an absolute one)
        raise OSError(errno.EACCES, "a path out of the folder")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            flags = os.O_NONBLOCK if i == len(parts) - 1 else os.O_DIRECTORY  # a FIFO never blocks
            fd, old = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | flags, dir_fd=fd), fd
            os.close(old)
        size = os.fstat(fd)
        if not stat.S_ISREG(size.st_mode) or size.st_size > limit:
            raise OSError(errno.EFBIG, f"not a file of at most {limit} bytes")
        data = bytearray(size.st_size)
        return bytes(data[:os.readv(fd, [data])])
    finally:
        os.close(fd)


def untrusted(data: bytes, limit):
    """torch.save's bytes read as data (weights_only), once no entry is compressed and all of them
    hold at most limit bytes: a small file never becomes a large one here."""
    entries = zipfile.ZipFile(io.BytesIO(data)).infolist()
    if any(e.compress_type != zipfile.ZIP_STORED for e in entries) \
            or sum(e.file_size for e in entries) > limit:
        raise ValueError("compressed or larger than its limit")
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)
