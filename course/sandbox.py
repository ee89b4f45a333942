"""
The OS sandbox a graded child runs in, made by bubblewrap (Debian's `bubblewrap`): new user, mount,
PID, network, IPC and UTS namespaces. Inside, the child sees a read-only view of the Python
environment and the system's libraries, a fresh tmpfs at /work holding a copy of the student's
model.py, a /proc of its own PID namespace (never the grader's processes, command line or open
files), no network, and nothing writable outside its tmpfs; it runs as `nobody` with no
capabilities, in a session of its own, and every process it starts dies when the sandbox does
(--die-with-parent, and the PID namespace's init). The grader's tree, the reference model.py, the
report and other students' copies are not in its file system at all.

What it needs: the `bwrap` command (apt-get install bubblewrap) and user namespaces the user may
create (as root they always work; as another user, kernel.unprivileged_userns_clone=1 where the
kernel has that switch, and AppArmor not restricting unprivileged namespaces).
"""
import os
import shutil
import subprocess
import sys
import sysconfig

FIX = ("install bubblewrap (apt-get install bubblewrap) and allow user namespaces "
       "(sysctl kernel.unprivileged_userns_clone=1), or practise unsandboxed with --no_sandbox "
       "(not for credit)")
MEMORY = 6 << 30  # address space per process: torch maps ~2 GiB at import; a test needs MBs
WORK = "/work"    # the tmpfs the child starts in


def python_roots() -> list:
    """The folders the child's Python reads: the interpreter, its standard library and the
    site-packages that hold torch (a virtual environment's and its base's)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")),
             os.path.dirname(os.path.dirname(os.path.realpath(__import__("torch").__file__)))}
    paths = sorted(os.path.realpath(p) for p in paths if p and os.path.isdir(p))
    return [p for p in paths if not any(p.startswith(q + os.sep) for q in paths if q != p)]


def command(model_py, argv) -> list:
    """bwrap's command line that runs argv in the sandbox, with model_py copied to /work."""
    args = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "grading",
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):  # merged /usr: links into it
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf"):
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    for root in python_roots():
        if not root.startswith("/usr/"):
            args += ["--ro-bind", root, root]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", WORK,
             "--ro-bind", str(model_py), f"{WORK}/model.py", "--chdir", WORK, "--clearenv",
             "--setenv", "HOME", WORK, "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "LANG", "C.UTF-8"]
    return args + ["--", *argv]


def problem(model_py) -> str:
    """None if the sandbox starts here, else one line saying why and the fix."""
    if shutil.which("bwrap") is None:
        return f"no sandbox: the bwrap command is missing; {FIX}"
    try:
        proc = subprocess.run(command(model_py, ["/bin/true"]), capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no sandbox: bwrap did not start ({type(e).__name__}); {FIX}"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return f"no sandbox: bwrap cannot start here ({why}); {FIX}"
    return None
