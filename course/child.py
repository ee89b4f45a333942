"""
The graded child process, seen from the trusted parent: start it in the sandbox on the student's
model.py, hand it each scenario of a test, answer its stubs' calls within the op's own sizes and
config, and judge each result. A test that runs past its limit however much the child writes, or
during which the child dies, fails; the child starts again for the next test.
"""
import os
import select
import struct
import time
from pathlib import Path

import torch

from course import checks, fixtures, ops, sandbox

OPS_SOURCE = Path(ops.__file__).read_text()
IMPORT_TIMEOUT_S = 60  # starting Python and torch, then importing model.py
CALLS = 2000  # stub calls one op may make (the reference's largest makes 100)
MESSAGE = 1 << 20  # a message's bytes beyond 16 times the op's own tensors


class Gone(Exception):
    """The child died, ran out of time, or sent something that is not a message."""


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


def within(arguments, sizes, configs=()) -> bool:
    """A stub's call no larger than the op it runs in: no number, size or tensor beyond the op's
    own (a KV cache: its layers times one input), so the reference's work for it stays that of
    the test; a config (stride, sources) only the op's own, so no rule is answered but its."""
    if not isinstance(arguments, dict):
        return False
    biggest, elements = scale(arguments)
    own = [a["ModelConfig"] for a in arguments.values() if isinstance(a, dict) and "ModelConfig"
           in a]
    return biggest <= sizes[0] and elements <= sizes[0] * sizes[1] and all(
        isinstance(c, dict) and any(c.items() >= o.items() for o in configs) for c in own)


class Child:
    def __init__(self, source, ref, model, timeout, sandboxed=True, hidden=()):
        self.source, self.ref, self.model, self.timeout = source, ref, model, timeout
        self.sandboxed, self.hidden = sandboxed, hidden
        # a str source: why the grader would not read model.py
        self.box, self.import_error = None, source if isinstance(source, str) else None

    # ---------------------------------------------------------------- the process and its pipes
    def start(self):
        (down_r, down_w), (up_r, up_w) = os.pipe(), os.pipe()
        try:
            self.box = sandbox.Sandboxed(OPS_SOURCE + f"\nserve({down_r}, {up_w})\n", self.source,
                                         (down_r, up_w), self.hidden, self.sandboxed)
        except BaseException:  # no child: its ends of the pipes too
            os.close(down_w)
            os.close(up_r)
            raise
        finally:
            os.close(down_r)
            os.close(up_w)
        self.down, self.up = down_w, up_r
        os.set_blocking(down_w, False)
        try:
            first = self.receive(time.monotonic() + IMPORT_TIMEOUT_S, 1 << 16, 0)
        except Gone as e:
            self.import_error = (f"importing model.py did not finish in {IMPORT_TIMEOUT_S} s"
                                 if "ran past" in str(e)
                                 else f"model.py could not be imported: {e}")
            return
        if "error" in first:
            self.import_error = f"the code does not import: {str(first['error'])[:300]}"

    def close(self):
        if self.box is not None:
            for fd in (self.down, self.up):
                os.close(fd)
            self.box.kill()
            self.box = None

    def send(self, message, deadline):
        data = memoryview(ops.packed(message))
        while data:  # a non-blocking pipe: a child that stops reading costs its test's time alone
            if not select.select([], [self.down], [], max(0.0, deadline - time.monotonic()))[1]:
                raise Gone(f"the test ran past {self.timeout:g} s")
            try:
                data = data[os.write(self.down, data):]
            except BlockingIOError:
                continue
            except OSError:
                raise Gone(self.death()) from None

    def read(self, n, deadline):
        """n bytes, into one buffer, before the deadline however fast they come."""
        data, got = bytearray(n), 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.up], [], [], left)[0]:
                raise Gone(f"the test ran past {self.timeout:g} s: an endless loop, far too much "
                           f"work, or far too much to say")
            chunk = os.readv(self.up, [memoryview(data)[got:]])
            if not chunk:
                raise Gone(self.death())
            got += chunk
        return bytes(data)

    def death(self):
        try:
            code = self.box.proc.wait(5)
        except Exception:
            return "the child closed its pipe"
        if sandbox.out_of_memory(self.box.cgroup):
            return f"the test used more than the sandbox's {sandbox.MEMORY >> 30} GiB of memory"
        return "the child exited early (exit 0)" if code == 0 else \
            f"the interpreter died (exit {code})"

    def receive(self, deadline, limit, elements):
        """The child's next message: at most limit bytes, then tensors of at most `elements`."""
        (n,) = struct.unpack("<Q", self.read(8, deadline))
        if n > limit:
            raise Gone(f"the child sent a message of {n} bytes, more than the test's {limit}")
        data = self.read(n, deadline)
        try:  # a view over a small storage may be as large as it says; nesting has no bound
            message = sandbox.untrusted(data, limit)
            size = sum(t.numel() for t in ops.tensors(message)) if isinstance(message, dict) else -1
        except Exception as e:
            raise Gone(f"the child sent something that is not data ({type(e).__name__})") from e
        if not 0 <= size <= elements:
            raise Gone("the child sent something that is not a message of the test's size")
        return message

    # ------------------------------------------------------------------------- running ops
    def ask(self, op, args, stubs, deadline, want):
        """One op in the child: its result, after answering every call its stubs make."""
        self.send({"op": op, "args": args, "stubs": stubs}, deadline)
        sizes, own = scale(args), [a for a in args if isinstance(a, dict) and "n_layer" in a]
        tensors = ops.tensors([args, want])
        limit = MESSAGE + 16 * sum(t.numel() * t.element_size() for t in tensors)
        elements = 4 * sum(t.numel() for t in tensors) + 4096
        for _ in range(CALLS):
            message = self.receive(deadline, limit, elements)
            if "call" in message:
                cotangent = message.get("cotangent")
                fair = message["call"] in stubs and within(message.get("arguments"), sizes, own) \
                    and (cotangent is None or within({"c": cotangent}, sizes))
                reply = self.answer(message["call"], message["arguments"], cotangent) if fair \
                    else {"own": True}
                self.send(reply, deadline)
            elif "error" in message:
                return False, str(message["error"])[:300]
            elif "result" in message:
                return True, message["result"]
            else:
                raise Gone("the child sent something that is not a result")
        raise Gone(f"the op made more than {CALLS} calls")

    def answer(self, function, arguments, cotangent=None):
        """A stub's call: the reference's answer from the call's own inputs (the instructor's),
        or the record's for the same inputs, else the student's own function (a student copy)."""
        if self.model is not None:
            try:
                return ops.answer(self.model, function, arguments, cotangent=cotangent)
            except Exception:  # a call the reference refuses: the student's own function says
                return {"own": True}
        records = self.ref["calls"].get(function, []) if cotangent is None else []  # no gradients
        return next((reply for recorded, reply in records if fixtures.same(arguments, recorded)),
                    {"own": True})

    def run(self, test, stubs):
        """None if every scenario of the test passes, else why the first one failed."""
        if self.box is None and not self.import_error:
            self.start()
        if self.import_error:
            return self.import_error
        deadline = time.monotonic() + self.timeout
        try:
            for op, args, what, want in self.ref["tests"][test]:
                ok, got = self.ask(op, args, stubs, deadline, want)
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
