"""
The graded child process, seen from the trusted parent (course/grade.py): start it in the sandbox
(course/sandbox.py) on a copy of the student's model.py, hand it each scenario of a test, answer the
calls its stubs make while the op that installed them runs (problem 3's calls to the functions of
problems 1, 2 and 4, within the op's sizes), and judge each result
(course/checks.py). A test that runs past its limit, or during which the child dies, fails; the
child starts again for the next test, so a crash or an endless loop costs that test alone.
"""
import io
import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

from course import checks, fixtures, ops, sandbox

OPS_SOURCE = Path(ops.__file__).read_text()
IMPORT_TIMEOUT_S = 60  # starting Python and torch, then importing model.py


class Gone(Exception):
    """The child died, ran out of time, or sent something that is not a message."""


# The child's first lines, before it imports anything of the student's: no file can be written
# outside a tmpfs either (a report, a grader file; a write fails with EFBIG), memory bounded, hard
# limits it cannot raise. tempfile's probe file is such a write: its folder is named instead.
LIMITS = f"""import os, resource, signal, tempfile
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
resource.setrlimit(resource.RLIMIT_AS, ({sandbox.MEMORY}, {sandbox.MEMORY}))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
tempfile.tempdir = os.getcwd()
"""


def scale(x, sizes=None):
    """(the largest integer, the most elements) among an op's inputs: numbers, tensors' sizes."""
    sizes = sizes if sizes is not None else [1, 1]
    if isinstance(x, torch.Tensor):
        sizes[0], sizes[1] = max(sizes[0], *x.shape, 1), max(sizes[1], x.numel())
    elif isinstance(x, (list, tuple, dict)):
        for i in (x.values() if isinstance(x, dict) else x):
            scale(i, sizes)
    elif isinstance(x, int) and not isinstance(x, bool):
        sizes[0] = max(sizes[0], abs(x))
    return sizes


def within(arguments, sizes) -> bool:
    """A stub's call no larger than the op it runs in: no number, size or tensor beyond the op's
    own (a KV cache: its layers times one input), so the reference's work for it stays that of
    the test."""
    if not isinstance(arguments, dict):
        return False
    biggest, elements = scale(arguments)
    return biggest <= sizes[0] and elements <= sizes[0] * sizes[1]


class Child:
    def __init__(self, tree, ref, model, timeout, sandboxed=True):
        self.tree, self.ref, self.model, self.timeout = tree, ref, model, timeout
        self.sandboxed = sandboxed
        self.proc, self.import_error = None, None

    # ---------------------------------------------------------------- the process and its pipes
    def start(self):
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "LANG", "LC_ALL")}
        env["OMP_NUM_THREADS"] = "1"  # tiny tensors: one thread is 20x faster than a pool
        code = LIMITS + OPS_SOURCE + f"\nserve({down_r}, {up_w})\n"
        argv = [sys.executable, "-I", "-B", "-c", code]
        if self.sandboxed:
            argv = sandbox.command(self.tree / "model.py", argv)
        # a session of its own: the kill at the end reaches every process it started (sandboxed,
        # the PID namespace's end does too); no preexec_fn, so gradings may run in threads
        self.proc = subprocess.Popen(argv, cwd=self.tree,
                                     env={**env, "HOME": str(self.tree)}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=(down_r, up_w), start_new_session=True)
        os.close(down_r)
        os.close(up_w)
        self.down, self.up = down_w, up_r
        try:
            first = self.receive(time.monotonic() + IMPORT_TIMEOUT_S)
        except Gone as e:
            self.import_error = (f"importing model.py did not finish in {IMPORT_TIMEOUT_S} s"
                                 if "ran past" in str(e)
                                 else f"model.py could not be imported: {e}")
            return
        if "error" in first:
            self.import_error = f"the code does not import: {first['error']}"

    def close(self):
        if self.proc is not None:
            for fd in (self.down, self.up):
                os.close(fd)
            if self.proc.poll() is None:  # its session; sandboxed, its PID namespace dies
                os.killpg(self.proc.pid, signal.SIGKILL)  # with bwrap: anything it started
            self.proc.wait()
            self.proc = None

    def send(self, message, deadline):
        data = ops.packed(message)
        while data:
            if not select.select([], [self.down], [], max(0.0, deadline - time.monotonic()))[1]:
                raise Gone(f"the test ran past {self.timeout:g} s")
            try:
                data = data[os.write(self.down, data):]
            except OSError:
                raise Gone(self.death()) from None

    def read(self, n, deadline):
        data = b""
        while len(data) < n:
            if not select.select([self.up], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise Gone(f"the test ran past {self.timeout:g} s: an endless loop, or far too "
                           f"much work")
            chunk = os.read(self.up, min(n - len(data), 1 << 20))
            if not chunk:
                raise Gone(self.death())
            data += chunk
        return data

    def death(self):
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "the child closed its pipe"
        return "the child exited early (exit 0)" if code == 0 else \
            f"the interpreter died (exit {code})"

    def receive(self, deadline, limit=1 << 28):
        (n,) = struct.unpack("<Q", self.read(8, deadline))
        if n > limit:
            raise Gone(f"the child sent a message of {n} bytes")
        try:
            message = torch.load(io.BytesIO(self.read(n, deadline)), weights_only=True)
        except Gone:
            raise
        except Exception as e:
            raise Gone(f"the child sent something that is not data ({type(e).__name__})") from e
        if not isinstance(message, dict):
            raise Gone("the child sent something that is not a message")
        return message

    # ------------------------------------------------------------------------- running ops
    def ask(self, op, args, stubs, deadline):
        """One op in the child: its result, after answering every call its stubs make."""
        self.send({"op": op, "args": args, "stubs": stubs}, deadline)
        sizes = scale(args)
        while True:
            message = self.receive(deadline)
            if "call" in message:
                cotangent = message.get("cotangent")
                fair = message["call"] in stubs and within(message.get("arguments"), sizes) \
                    and (cotangent is None or within({"c": cotangent}, sizes))
                reply = self.answer(message["call"], message["arguments"], cotangent) if fair \
                    else {"own": True}
                self.send(reply, deadline)
            elif "error" in message:
                return False, str(message["error"])
            elif "result" in message:
                return True, message["result"]
            else:
                raise Gone("the child sent something that is not a result")

    def answer(self, function, arguments, cotangent=None):
        """A stub's call: the reference's answer from the call's own inputs (the instructor's),
        or the record's for the same inputs, else the student's own function (a student copy)."""
        if self.model is not None:
            try:
                return ops.answer(self.model, function, arguments, cotangent=cotangent)
            except Exception:  # a call the reference refuses: the student's own function says
                return {"own": True}
        if cotangent is not None:  # a gradient the record does not hold
            return {"own": True}
        for recorded, reply in self.ref["calls"].get(function, []):
            if fixtures.same(arguments, recorded):
                return reply
        return {"own": True}

    def run(self, test, stubs):
        """None if every scenario of the test passes, else why the first one failed."""
        if self.proc is None:
            self.start()
        if self.import_error:
            return self.import_error
        deadline = time.monotonic() + self.timeout
        try:
            for op, args, what, want in self.ref["tests"][test]:
                ok, got = self.ask(op, args, stubs, deadline)
                if not ok:
                    return f"{what}: {got}"
                try:
                    reason = checks.judge(test, got, want, args, what, op)
                except Exception:  # a result of another kind than the reference's
                    reason = f"{what}: the result is not what the function should return"
                if reason:
                    return reason
        except Gone as e:
            self.close()
            return str(e)
        return None

    def problem(self, p):
        stubs = fixtures.stubbed(p.number)
        return {name: self.run(name, stubs) for name, _ in p.tests}

    def together(self) -> bool:
        return self.run("together", []) is None
