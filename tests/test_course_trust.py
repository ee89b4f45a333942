"""What an instructor can trust of the course's grader (course/grade.py): graded code that exits
at import with a forged report, patches the grader, rewrites its tree, looks answers up in the
copy's fixtures, returns what is not a tensor, reads the reference, outlives its test, persists in
the grader's bytecode or site-packages, writes the report, asks the parent for answers, patches
its own harness or decodes without a cache, or spends the kernel's resources (processes, System V
memory, links on a tmpfs, memory, time, messages, calls) scores nothing by it, one case per kind;
the grader grades wherever Python lives; problem 5 scores six real trainings of a cheap recipe
full and each forgery of them 0; damaged fixtures and a missing sandbox are refused in one line."""
import compileall
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import model
import prepare_data
import train
from checkpoint import read_checkpoint
from configurator import UserError, run_main
from course import child, experiment, fixtures, sandbox
from lab import ablate
from course import grade as grade_py
from course.make import replace_bodies, stubs
from course.problems import EXPERIMENT, FIXTURES, GRADED, MARKER
from helpers import ENV, PACKAGES, ROOT, copy_repository, earned, failing, grade_cli
from helpers import grading_here, reasons, train as train_here
from outputs import save_checkpoint

TESTS = {p.number: {name for name, _ in p.tests} for p in GRADED}
MARKER_ARG = "course-attack-grandchild"  # in a grandchild's command line: seen from outside


# ----------------------------------------------------------------------------- helpers

def attack_copy(where, prefix="", suffix="", bodies=None):
    """A folder with the repository's model.py, every function a stub (bodies None) or these
    bodies, `prefix` and `suffix` run at its import."""
    source = (ROOT / "model.py").read_text()
    source = replace_bodies(source, stubs()["model.py"] if bodies is None else
                            {k: textwrap.dedent(v) for k, v in bodies.items()})
    where.mkdir(parents=True)
    (where / "model.py").write_text(textwrap.dedent(prefix) + source + textwrap.dedent(suffix))
    return where


def sandbox_cgroup() -> bool:
    """Whether this process may make the sandbox's cgroup (cgroup v1's or v2's)."""
    made = sandbox.cgroup()
    sandbox.remove(made)
    return bool(made)


def hashes(tree):
    return {f: f.read_bytes() for f in sorted((tree / "course").rglob("*")) if f.is_file()}


def marked_processes():
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if MARKER_ARG.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return [p for p in pids if p != os.getpid()]


# ----------------------------------------------------------------------------- the attacks

FORGED = """\
    import json, os, sys
    try:  # the grader's modules, had the child any: a judge that passes everything
        import conftest
        conftest.note = lambda **record: None
    except ImportError:
        pass
    for m in list(sys.modules.values()):
        if hasattr(m, "judge"):
            m.judge = lambda *args, **kwargs: None
    for n in range(1, 6):  # records of passed tests, then an exit that says all went well
        try:
            with open({report!r}, "a") as f:
                f.write(json.dumps({{"test": f"test_problem{{n}}.py::t", "outcome": "passed"}}))
        except OSError:
            pass
    sys.exit(0)
    """

# At import it finds the grader from its parent's command line, appends a judge that passes
# everything to the grader's checks.py and moves its own model.py over the grader's fixtures.py
# (a rename needs no write).
REWRITER = """\
    import os, pathlib
    argv = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
    course = next(pathlib.Path(a.decode()).parent for a in argv if a.endswith(b"grade.py"))
    try:
        with open(course / "checks.py", "a") as f:
            f.write("\\ndef judge(*args, **kwargs):\\n    return None\\n")
    except OSError:
        pass
    os.replace(__file__, course / "fixtures.py")
    """

# Answers from the practice fixtures, looked up by their inputs.
LOOKUP = {"ModelConfig.stride": 'return _lookup("stride", lambda a: ModelConfig(**a[0]) == self)',
          "ModelConfig.sources": 'return _lookup("sources", lambda a: ModelConfig(**a[0]) == '
                                 'self)[e]',
          "group_mean": 'return _lookup("group_mean", lambda a: same(a[0], q) and a[1] == '
                        'n_kv_head)',
          "softmax_weights": 'return _lookup("softmax_weights", lambda a: same(a[0], qbar))',
          "weighted_sum": 'return _lookup("weighted_sum", lambda a: same(a[0], alpha))',
          "causal_attention": 'return _lookup("causal_attention", lambda a: same(a[0], q))'}
LOOKUP_TABLE = """\
    import torch as _torch
    _TABLE = _torch.load({fixtures!r}, weights_only=True)["tests"]

    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and _torch.equal(a, b)

    def _lookup(op, match):
        for cases in _TABLE.values():
            for name, args, what, want in cases:
                if name == op and match(args):
                    return want
        raise KeyError(op)
    """

# What is not the functions' result: a string that says "passed", a dict, a tensor subclass, a
# float, an error of a million characters; and prints that are not UTF-8, which cost nothing
# (problem 3 keeps its points).
GARBAGE = {"group_mean": 'return "passed"',
           "softmax_weights": 'return {"alpha": 1, "passed": True}',
           "causal_attention": "return torch.nn.Parameter(q.float())",
           "KVCache.update": 'raise RuntimeError("a reason of a million characters " * 30_000)',
           "ModelConfig.stride": "return float(self.depth_stride or 1) + 0.5"}
NOISE = """\
    import sys
    sys.stdout.buffer.write(b"\\xff\\xfe not UTF-8\\n")
    sys.stderr.buffer.write(b"\\xc3\\x28\\n")
    sys.stdout.flush()
    """


def escape(instructor, pth):
    """At import: find the reference model.py (every process's cwd and command line in /proc, and
    the instructor's tree, named outright) and take its functions; write "score: 85 / 85" to every
    stdout and stderr in /proc and 85 to every --json= it finds; start a grandchild in a session of
    its own that, for a minute, rewrites the grader's source and bytecode through a shared mmap,
    adds a .pth to site-packages and writes the fake report again."""
    targets = [str(instructor / "course" / "child.py"), str(instructor / "course" / "checks.py"),
               *map(str, (instructor / "course" / "__pycache__").glob("*.pyc"))]
    return f"""
        import glob as _glob, os as _os, pathlib as _pathlib, subprocess as _subprocess, sys as _sys

        def _fake_report():
            for fd in _glob.glob("/proc/*/fd/[12]"):
                try:
                    with open(fd, "w") as f:
                        f.write("\\nscore: 85 / 85\\n")
                except OSError:
                    pass
            for cmdline in _glob.glob("/proc/*/cmdline"):
                try:
                    args = open(cmdline, "rb").read().split(b"\\0")
                except OSError:
                    continue
                for a in args:
                    if a.startswith(b"--json="):
                        try:
                            with open(a[7:].decode(), "w") as f:
                                f.write('{{"score": 85, "out_of": 85}}')
                        except OSError:
                            pass

        def _reference():
            places = [_pathlib.Path({str(instructor)!r})]
            for pid in _glob.glob("/proc/[0-9]*"):
                for link in ("cwd", "root"):
                    try:
                        places.append(_pathlib.Path(_os.readlink(pid + "/" + link)))
                    except OSError:
                        pass
                try:
                    args = open(pid + "/cmdline", "rb").read().split(b"\\0")
                except OSError:
                    continue
                places += [_pathlib.Path(a.decode()).parent.parent for a in args
                           if a.endswith(b"grade.py")]
            for place in places:
                try:
                    source = (place / "model.py").read_text()
                except OSError:
                    continue
                if "def depth_mix" in source and "NotImplementedError('Problem" not in source:
                    return source

        _source = _reference()
        if _source:
            _namespace = {{"__name__": "model"}}
            exec(compile(_source, "reference.py", "exec"), _namespace)
            globals().update({{k: v for k, v in _namespace.items() if not k.startswith("__")}})
        _fake_report()
        _LOOP = '''
        import glob, mmap, os, sys, time
        sys.argv = sys.argv  # {MARKER_ARG}
        end = time.time() + 60
        while time.time() < end:
            for path in {targets!r}:
                try:
                    with open(path, "r+b") as f:
                        m = mmap.mmap(f.fileno(), 0)
                        m[:1] = b"#"
                        m.flush()
                except (OSError, ValueError):
                    pass
            try:
                open({str(pth)!r}, "x").close()
            except OSError:
                pass
            for fd in glob.glob("/proc/*/fd/[12]"):
                try:
                    with open(fd, "w") as f:
                        f.write("score: 85 / 85")
                except OSError:
                    pass
            time.sleep(0.2)
        '''
        _subprocess.Popen([_sys.executable, "-c", _LOOP, {MARKER_ARG!r}], start_new_session=True,
                          stdin=_subprocess.DEVNULL, stdout=_subprocess.DEVNULL,
                          stderr=_subprocess.DEVNULL)
        """


# Calls for problems 1, 2 and 4 sent down the child's own pipes, outside an op that stubs them;
# calls far larger than the test (the sources of layer 6e8, hours for the reference) inside one
# (problem 3's weighted_sum, the reference's after them); and the harness in the child patched,
# with no KV cache: decoding is the full forward, and so is the whole model "together".
ASK = """
    import struct as _struct, sys as _sys
    _main = _sys.modules["__main__"]

    def _pipes():
        frame = _sys._getframe()
        while frame is not None and "outbox" not in frame.f_locals:  # serve's pipes
            frame = frame.f_back
        return frame.f_locals["outbox"], frame.f_locals["inbox"]

    def _ask(function, **arguments):
        outbox, inbox = _pipes()
        _main.send(outbox, {"call": function, "arguments": _main.freeze(arguments)})
        return _main.receive(inbox)
    """
ORACLE = ASK + """
    def _answer(function, **arguments):
        reply = _ask(function, **arguments)
        if "result" not in reply:
            raise NotImplementedError("the parent would not answer")
        return reply["result"]

    ModelConfig.stride = property(lambda self: _answer("model.py:ModelConfig.stride", self=self))
    ModelConfig.sources = lambda self, e: _answer("model.py:ModelConfig.sources", self=self, e=e)
    group_mean = lambda q, n_kv_head: _answer("model.py:group_mean", q=q, n_kv_head=n_kv_head)
    softmax_weights = lambda qbar, keys: _answer("model.py:softmax_weights", qbar=qbar, keys=keys)
    causal_attention = lambda q, k, v: _answer("model.py:causal_attention", q=q, k=k, v=v)
    _main.OPS["decode"] = lambda model, config, state, idx, *rest: [
        _main.OPS["logits"](model, config, state, idx)] * 3
    _main.OPS["together"] = lambda model, config, state, idx, *rest: [
        _main.OPS["logits"](model, config, state, idx)] * 4
    """
HOLD = {"weighted_sum": """
    for _ in range(5):
        _ask("model.py:ModelConfig.sources", self=ModelConfig(n_layer=600_000_000), e=600_000_000)
    leaked = _ask("model.py:ModelConfig.sources", self=ModelConfig(n_layer=7, depth_stride=3), e=5)
    if "result" in leaked:  # a rule's sources, for a report to carry to the next grading
        raise RuntimeError(f"leaked {leaked['result']}")
    w = alpha.to(xs[0].dtype).unsqueeze(-1)
    return sum(w[:, :, c] * x for c, x in enumerate(xs))""",
        "KVCache.update": "raise NotImplementedError('no cache')"}


# The kernel's resources, tried at import, each said in the exit's text: processes (four children
# of 1 GiB, a program), 3 GiB of System V shared memory, a message queue, a user namespace, symbolic
# links on every tmpfs (no byte written), a file; and the host's paths (PATHS) in what the
# sandbox's /proc shows of its command lines, mounts, environment and cgroup.
KERNEL = """
    import ctypes as _ctypes, errno as _errno, os as _os, subprocess as _subprocess, time as _time
    _libc, _seen = _ctypes.CDLL(None, use_errno=True), []

    def _call(result):
        if result == -1:
            raise OSError(_ctypes.get_errno(), "refused")
        return result

    def _children():
        for _ in range(4):
            if _os.fork() == 0:
                bytearray(1 << 30)
                _time.sleep(60)
                _os._exit(0)

    def _shared():
        _libc.shmat.restype = _ctypes.c_void_p
        _ctypes.memset(_libc.shmat(_call(_libc.shmget(0, 3 << 30, 0o1600)), None, 0), 1, 3 << 30)

    def _links():
        for folder in ("/tmp", "/work", "/dev/shm", "/"):
            for i in range(1000):
                _os.symlink("x" * 200, f"{folder}/link{i}")

    for _name, _attempt in (("fork", _children), ("spawn", lambda: _subprocess.run(["true"])),
                            ("shm", _shared), ("msg", lambda: _call(_libc.msgget(0, 0o1600))),
                            ("userns", lambda: _call(_libc.unshare(0x10000000))),
                            ("links", _links), ("write", lambda: open("/tmp/f", "wb").write(b"x"))):
        try:
            _attempt()
            _seen.append(_name + ":done")
        except OSError as e:
            _seen.append(f"{_name}:{_errno.errorcode.get(e.errno, e.errno)}")
    _shown = "".join(open(f, errors="replace").read() for f in (
        "/proc/1/cmdline", "/proc/self/mountinfo", "/proc/self/environ", "/proc/self/cgroup"))
    raise SystemExit(" ".join(_seen) + f" paths:{sum(p in _shown for p in PATHS)}")
    """
MEMORY = """
    import torch as _torch
    _held = _torch.ones(3 << 28)  # 3 GiB, in the one process
    """
# Tests limited to 3 s: a message said a byte at a time, for ever; calls outside problem 3, each
# answered at once, for ever; a message of 255 MiB.
CHATTY = {"group_mean": """
    import time
    outbox, _ = _pipes()
    outbox.write(_struct.pack("<Q", 1 << 16))
    while True:
        outbox.write(b"x")
        outbox.flush()
        time.sleep(0.001)""",
          "softmax_weights": """
    while qbar.dtype != torch.bfloat16:
        _ask("model.py:group_mean", q=qbar, n_kv_head=1)
    outbox, _ = _pipes()
    outbox.write(_struct.pack("<Q", 255 << 20) + bytes(255 << 20))"""}
# No KV cache; and with it, the harness's calls of KVCache's methods answered as if the cache held
# the chunk alone: a decoding of its own, in the child.
NO_CACHE = {"KVCache.update": "raise NotImplementedError('no cache')",
            "KVCache.advance": "raise NotImplementedError('no cache')"}
OWN_DECODE = ASK + """
    _main.OPS["call"] = lambda model, function, arguments: [
        (arguments["k"], arguments["v"]) if function.endswith("update") else None,
        arguments["self"]["KVCache"]]
    """


# ----------------------------------------------------------------------------- the gradings

def instructor(where):
    """The repository's files as they are (untracked ones too): an instructor's tree that graded
    code may try to rewrite, its grader's bytecode written (a target)."""
    copy_repository(where)
    compileall.compile_dir(where / "course", quiet=1)
    return where


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{case: what it gave}: each attack graded by the instructor's grader, two at a time, the
    longest first; from the command line those that look for the grader's process (on a tree of
    their own), the rest in this process. The escape is followed by a blank copy's grading on the
    same tree, once nothing it started is left."""
    where = tmp_path_factory.mktemp("attacks")
    tree, rewritten = instructor(where / "tree"), instructor(where / "rewritten")
    pth = Path(sysconfig.get_paths()["purelib"]) / f"zz_course_attack_{os.getpid()}.pth"
    forged = attack_copy(where / "forged", FORGED.format(report=str(where / "report.jsonl")))
    (forged / "pytest.py").write_text("print('5 passed')\nraise SystemExit(0)\n")
    (forged / "conftest.py").write_text("raise SystemExit(0)\n")
    lookup = attack_copy(where / "lookup", LOOKUP_TABLE.format(fixtures=str(where / FIXTURES)),
                         bodies=LOOKUP)
    (where / FIXTURES).parent.mkdir(parents=True)
    with grading_here():  # the practice fixtures, as make.py records them, before any grading
        torch.save(fixtures.record(model), where / FIXTURES)
    (where / MARKER).write_text("A student copy\n")  # where: the copy's grader, for practice
    copies = {"escape": attack_copy(where / "escape", suffix=escape(tree, pth)),
              "blank": attack_copy(where / "blank"),
              "rewriter": attack_copy(where / "rewriter", REWRITER),
              "oracle": attack_copy(where / "oracle", suffix=ORACLE, bodies=HOLD),
              "garbage": attack_copy(where / "garbage", NOISE, bodies=GARBAGE),
              "chatty": attack_copy(where / "chatty", suffix=ASK, bodies=CHATTY),
              "memory": attack_copy(where / "memory", MEMORY),
              "no cache": attack_copy(where / "no_cache", bodies=NO_CACHE),
              "own decode": attack_copy(where / "own_decode", suffix=OWN_DECODE, bodies=NO_CACHE)}
    paths = [str(where), str(tree), str(ROOT), tempfile.gettempdir() + "/grade"]
    copies["kernel"] = attack_copy(where / "kernel", suffix=KERNEL.replace("PATHS", repr(paths)))
    out = {"before": hashes(tree)}

    def escape_then_blank():
        out["escape"] = grade_cli(copies["escape"], "--problem=1", grader=tree, ok=False)
        deadline = time.monotonic() + 30  # the kernel ends a PID namespace's processes at once
        while (survivors := marked_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        out["survivors"] = survivors
        out["blank"] = grade_py.grade(copies["blank"], only=1, grader=tree)
        out["after"], out["pth"] = hashes(tree), pth.exists()

    def rewriter():
        out["rewriter"] = grade_cli(copies["rewriter"], "--problem=1", "--no_sandbox",
                                    grader=rewritten, ok=False)
        out["rewritten"] = hashes(rewritten)

    def oracle():
        start = time.monotonic()
        out["oracle"] = grade_py.grade(copies["oracle"])
        out["held"] = time.monotonic() - start

    def chatty():
        start = time.monotonic()
        out["chatty"] = grade_py.grade(copies["chatty"], only=2, timeout=3)
        out["chatty time"] = time.monotonic() - start

    jobs = [escape_then_blank, rewriter, oracle, chatty,
            lambda: out.update(garbage=grade_py.grade(copies["garbage"])),
            *(lambda name=name, only=only: out.update({name: grade_py.grade(copies[name], only)})
              for name, only in (("kernel", 1), ("memory", 1), ("no cache", 4),
                                 ("own decode", 4))),
            lambda: out.update(forged=grade_py.grade(forged, only=1)),
            lambda: out.update(practice=grade_py.grade(lookup, only=2, sandboxed=False,
                                                       grader=where)),
            lambda: out.update(lookup=grade_py.grade(lookup, only=2, sandboxed=False))]
    try:
        with grading_here(), ThreadPoolExecutor(2) as pool:
            for job in [pool.submit(job) for job in jobs]:
                job.result()
        out["report"] = (where / "report.jsonl").exists()
        return out
    finally:
        for pid in marked_processes():
            os.kill(pid, 9)
        pth.unlink(missing_ok=True)


def test_exiting_at_import_with_a_forged_report_scores_nothing(graded):
    """At import: the grader's modules patched to pass everything (the child has none), records of
    passed tests appended to a report (the old grader's; no file can be written), then sys.exit(0);
    a pytest.py and a conftest.py beside model.py (the grader copies model.py alone)."""
    result = graded["forged"]
    assert earned(result) == {1: 0} and not graded["report"]
    assert all(t["why"] == "the code does not import: model.py called sys.exit(0) at import"
               for t in result["problems"][0]["tests"]), result


def test_code_that_rewrites_the_grader_voids_the_grading(graded):
    """Unsandboxed (--no_sandbox, practice), code that finds the grader from its parent's command
    line cannot append to the grader's files (no file can grow), but moves its model.py over the
    grader's fixtures.py: the grading is void, scores 0, names the file and exits 2. (Sandboxed, it
    finds no grader: test_graded_code_cannot_read_the_reference.)"""
    _, result, proc = graded["rewriter"]
    assert proc.returncode == 2 and "this grading is void" in proc.stderr
    assert "course/fixtures.py" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert earned(result) == {1: 0} and result["tampered"] and result["sandbox"] is False
    checks = [f for f in graded["rewritten"] if f.name == "checks.py"]
    assert graded["rewritten"][checks[0]] == (ROOT / "course" / "checks.py").read_bytes()


def test_answers_looked_up_in_the_copys_fixtures_fail_the_hidden_tests(graded):
    """A model.py that answers from the practice fixtures (unsandboxed: in the sandbox it cannot
    even read them) passes the copy's own grader on the values it looks up (not their gradients),
    and 0 from the instructor's: fresh inputs, and scenarios the copy never saw."""
    practice = graded["practice"]
    assert failing(practice) == {2: {"qbar_is_the_mean_of_each_group_of_query_heads",
                                     "the_weights_are_a_softmax_over_the_candidates"}}, practice
    assert all(t["why"] is None or t["why"].startswith("backward (training)")
               for t in practice["problems"][0]["tests"]), practice
    assert earned(graded["lookup"]) == {2: 0}, graded["lookup"]


def test_results_that_are_not_the_functions_score_nothing_and_prints_cost_nothing(graded):
    """A string that says "passed", a dict, a tensor subclass, a float stride: each fails its tests
    in one line, and the grading goes on; prints that are not UTF-8 cost problem 3 nothing."""
    result = graded["garbage"]
    assert earned(result)[2] == 0 and earned(result)[3] == 25, result
    assert failing(result)[4] == TESTS[4]
    assert {"the_default_stride_is_the_modes_or_half_the_effective_depth",
            "an_explicit_stride_is_kept"} <= failing(result)[1]
    whys = [t["why"] for e in result["problems"] if e["graded"] for t in e["tests"] if t["why"]]
    assert any("returned str, not a tensor" in why for why in whys), whys


def test_graded_code_cannot_read_the_reference(graded):
    """The grader's tree is not in the sandbox: the reference model.py is nowhere to be found, by
    /proc or by its path, to answer for the stubs with."""
    _, result, _ = graded["escape"]
    assert earned(result) == {1: 0} and result["sandbox"] is True, result


def test_nothing_the_graded_code_starts_outlives_its_test(graded):
    """A grandchild in a session of its own dies with the sandbox's PID namespace."""
    assert graded["survivors"] == []


@pytest.mark.parametrize("target", ["bytecode", "source", "site-packages"])
def test_graded_code_cannot_persist(graded, target):
    """The grader's source and bytecode, and site-packages, as they were: nothing rewrote them
    through an mmap, nothing added a .pth; a blank copy graded next scores 0, nothing tampered."""
    changed = [f for f, data in graded["before"].items() if graded["after"].get(f) != data]
    kinds = {"bytecode": ".pyc", "source": ".py"}
    assert any(f.suffix == ".pyc" for f in graded["before"])
    assert not [f for f in changed if f.suffix == kinds.get(target, "-")], changed
    assert target != "site-packages" or not graded["pth"]
    blank = graded["blank"]
    assert earned(blank) == {1: 0} and not blank["tampered"], blank


def test_the_report_is_written_by_the_grader_alone(graded):
    """The sandbox sees neither the grader's stdout nor its command line: the last line printed
    and the JSON are the grader's."""
    printed, result, proc = graded["escape"]
    assert printed.strip().splitlines()[-1] == "score: 0 / 10", printed
    assert "85 / 85" not in printed + proc.stderr and result["score"] == 0


def test_the_parent_answers_no_call_outside_an_op_that_stubs_it(graded):
    """Calls for problems 1, 2 and 4 sent down the child's own pipes, outside problem 3's ops:
    the parent says "your own function" (one that asks again here): 0 on problems 1 and 2."""
    assert earned(graded["oracle"])[1] == earned(graded["oracle"])[2] == 0, graded["oracle"]
    assert "causal_attention_over_a_whole_sequence" in failing(graded["oracle"])[4]


def test_a_call_larger_than_its_test_costs_the_parent_nothing(graded):
    """Five calls for the sources of layer 6e8 (hours for the reference) from problem 3's
    weighted_sum are refused unanswered: its test passes in the time of an ordinary grading."""
    from course.child import scale, within
    assert "the_weighted_sum_of_the_candidates" not in failing(graded["oracle"])[3]
    assert graded["held"] < 300
    assert not within({"self": {"ModelConfig": {"n_layer": 600_000_000}}, "e": 600_000_000},
                      scale([{"n_layer": 4}, torch.zeros(2, 8)]))


def test_a_patched_harness_does_not_decode(graded):
    """No KV cache, and the harness's decode and together replaced by the full forward: decoding
    starts from a cache of records no tokens give, so only reading the cache gets its logits;
    problem 3 (the reference's otherwise) loses that test alone."""
    result = graded["oracle"]
    assert failing(result)[3] == {"each_layer_stores_its_mixed_record_and_decoding_reads_it"}
    assert "a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence" in failing(result)[4]
    assert result["together"] is False


def test_decoding_is_graded_through_the_students_cache(graded):
    """The parent drives problem 4's cache call by call (each call on the state it sends): with no
    KV cache, causal_attention's 8 points; with the harness's calls answered by a decoding of its
    own in the child, the same 8."""
    assert earned(graded["no cache"]) == earned(graded["own decode"]) == {4: 8}, graded["no cache"]


def test_no_stand_in_answers_for_a_rule_of_another_config(graded):
    """During problem 3, a call for the sources of a config other than the op's (a rule a report
    could carry to the next grading) is not answered: weighted_sum goes on and passes."""
    assert "the_weighted_sum_of_the_candidates" not in failing(graded["oracle"])[3]
    assert not any("leaked" in why for why in reasons(graded["oracle"]))


def test_the_kernels_resources_are_the_sandboxs_own(graded):
    """No process but its threads (four children of 1 GiB, a program), no System V shared memory
    (3 GiB) or message queue, no namespace, no link or file on any tmpfs: each refused at once, in
    one grading; and nothing the sandbox's /proc shows names a host path of the grading."""
    assert kernel_said(graded["kernel"]) == REFUSED


REFUSED = {"fork": "EPERM", "spawn": "EPERM", "shm": "EPERM", "msg": "EPERM", "userns": "EPERM",
           "links": "EROFS", "write": "EROFS", "paths": "0"}


def kernel_said(result) -> dict:
    """What KERNEL's exit says of each resource it tried."""
    (why,) = set(reasons(result))
    return dict(item.split(":") for item in why.split("sys.exit('")[1].split("')")[0].split())


def test_without_a_cgroup_the_sandbox_is_still_bounded(tmp_path, monkeypatch):
    """Where no cgroup can be made (forced off here, as on a machine without a writable
    hierarchy), the same resources are refused: seccomp and read-only tmpfs do not need one."""
    monkeypatch.setattr(sandbox, "CGROUPS", str(tmp_path / "no cgroups"))
    assert sandbox.cgroup() == []
    copy = attack_copy(tmp_path / "kernel", suffix=KERNEL.replace("PATHS", repr([str(tmp_path)])))
    with grading_here():
        assert kernel_said(grade_py.grade(copy, only=1)) == REFUSED


@pytest.mark.skipif(not sandbox_cgroup(), reason="no cgroup this user may make here")
def test_the_whole_sandbox_has_one_memory_budget(graded):
    """3 GiB in the one process, within its address space but past the sandbox's cgroup: the
    kernel ends it, and the report says why."""
    assert set(reasons(graded["memory"])) == {
        f"model.py could not be imported: the test used more than the sandbox's "
        f"{sandbox.MEMORY >> 30} GiB of memory"}, graded["memory"]


def test_a_tests_time_limit_holds_however_much_the_child_says(graded):
    """A message a byte at a time ends at the test's limit (3 s); calls answered at once, at the
    cap on one op's calls; a message of 255 MiB is refused at its length, unread; a reason of a
    million characters is cut to a line."""
    result, whys = graded["chatty"], reasons(graded["chatty"])
    assert earned(result) == {2: 0} and graded["chatty time"] < 60, graded["chatty time"]
    assert whys[0].startswith("the test ran past 3 s") and whys[1] == "the op made more than " \
        f"{child.CALLS} calls", whys
    assert whys[2].startswith(f"the child sent a message of {255 << 20} bytes, more than the "
                              f"test's"), whys
    cut = [w for w in reasons(graded["garbage"]) if "a reason of a million characters" in w]
    assert cut and max(len(why) for why in reasons(graded["garbage"])) <= 400, cut


# ----------------------------------------------------------------------------- where Python lives

# The reference (with its hidden tests) and a blank copy, graded on problem 1 by an interpreter of
# the place under test: their scores and the blank's reasons, as JSON.
WHEREVER = """\
import json, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from course import grade
ref, blank = (grade.grade(Path(p), only=1, seed=0) for p in ({root!r}, {blank!r}))
print(json.dumps([ref["score"], blank["score"], [t["why"] for t in blank["problems"][0]["tests"]]]))
"""


def linked(source, target):
    """target: a hard link of source (a file of its own there), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def places(tmp_path):
    """{place: its python}: the grader tree's own .venv (the handout's setup; this tree is under
    /work here), a venv of the system's Python under /usr (where it is this Python's version; else
    of this one) in /tmp, its packages added by a .pth, and a conda-like prefix in /tmp: the
    interpreter and libpython files of its own, the standard library and packages linked in."""
    made = {".venv of the grader's tree": ROOT / f".grade-venv-{os.getpid()}.tmp",
            "a venv of /usr's Python in /tmp": tmp_path / "venv"}
    system = Path(f"/usr/bin/python3.{sys.version_info.minor}")
    for (place, folder), base in zip(made.items(), (sys.executable, system if system.is_file()
                                                     else sys.executable)):
        subprocess.run([str(base), "-m", "venv", "--without-pip", "--system-site-packages",
                        str(folder)], check=True)
        (Path(subprocess.run([f"{folder}/bin/python", "-c", "import sysconfig; print(sysconfig."
                              "get_paths()['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()) / "packages.pth").write_text(
            "".join(f"{p}\n" for p in PACKAGES))
    prefix, real = tmp_path / "conda", Path(sys.base_prefix)
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib").mkdir()
    linked(os.path.realpath(sys.executable), prefix / "bin" / "python")
    for entry in (real / "lib").iterdir():
        (linked(entry, prefix / "lib" / entry.name) if entry.name.startswith("libpython")
         else (prefix / "lib" / entry.name).symlink_to(entry))
    return {**{place: folder / "bin" / "python" for place, folder in made.items()},
            "a conda prefix in /tmp": prefix / "bin" / "python"}


def test_it_grades_wherever_python_lives(tmp_path):
    """With the interpreter and packages in each place, the start check passes (the interpreter
    imports torch in the sandbox) and the reference earns problem 1 in full with its hidden tests,
    a blank copy 0, each test naming the function to write."""
    blank = attack_copy(tmp_path / "blank")
    try:
        pythons = places(tmp_path)
        with ThreadPoolExecutor(2) as pool:
            runs = dict(zip(pythons, pool.map(lambda python: subprocess.run(
                [str(python), "-c", WHEREVER.format(root=str(ROOT), blank=str(blank))],
                env=ENV, capture_output=True, text=True, timeout=300), pythons.values())))
    finally:
        shutil.rmtree(ROOT / f".grade-venv-{os.getpid()}.tmp", ignore_errors=True)
    for place, proc in runs.items():
        assert proc.returncode == 0, (place, proc.stderr[-2000:])
        ref, zero, whys = json.loads(proc.stdout.splitlines()[-1])
        assert (ref, zero) == (10, 0) and all("Problem 1: write" in w for w in whys), (place, whys)


# ----------------------------------------------------------------------------- refusals

def test_damaged_or_foreign_fixtures_are_named_in_one_line(tmp_path):
    """A copy's grader whose fixtures are cut short, or another program's: refused before any
    grading, the file named."""
    for damage in ("truncated", "foreign"):
        copy = tmp_path / damage
        (copy / FIXTURES).parent.mkdir(parents=True)
        shutil.copy(ROOT / "model.py", copy)
        (copy / MARKER).write_text("A student copy\n")
        torch.save({"tests": {"t": torch.zeros(1000)}} if damage == "truncated" else
                   {"sources": 1}, copy / FIXTURES)
        if damage == "truncated":
            (copy / FIXTURES).write_bytes((copy / FIXTURES).read_bytes()[:1000])
        with pytest.raises(UserError) as refused:
            grade_py.grade(copy, grader=copy)
        assert str(copy / FIXTURES) in str(refused.value) and "\n" not in str(refused.value)


def test_grading_without_the_sandbox_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """No bwrap on the PATH, a bwrap that cannot make its namespaces, or an interpreter that does
    not import torch in the sandbox (the start check runs it): one line naming the cause, before
    any grading."""
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox.problem.cache_clear()  # once a process, as a grader starts
    try:
        assert run_main(grade_py.main, ["--problem=1"]) == 2
        err = capsys.readouterr().err.strip()
        assert "the bwrap command is missing" in err and "apt-get install bubblewrap" in err \
            and "--no_sandbox" in err and "\n" not in err, err
        (tmp_path / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new "
                                        "namespace' >&2\nexit 1\n")
        (tmp_path / "bwrap").chmod(0o755)
        sandbox.problem.cache_clear()
        assert run_main(grade_py.main, ["--problem=1"]) == 2
        err = capsys.readouterr().err.strip()
        assert "No permissions to create new namespace" in err and "user namespaces" in err \
            and "\n" not in err, err
        monkeypatch.undo()  # the real bwrap, the packages' folder hidden (an empty tmpfs over it)
        sandbox.problem.cache_clear()
        why = sandbox.problem((os.path.realpath(Path(torch.__file__).parents[1]),))
        assert "does not start in the sandbox with torch (ModuleNotFoundError: No module named " \
               "'torch')" in why and "\n" not in why, why
    finally:
        sandbox.problem.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="becomes the unprivileged user `nobody` with setpriv, as root")
def test_the_sandbox_starts_for_an_unprivileged_user():
    """The same namespaces and options for `nobody` (root's own Python left out: nobody cannot
    read it): it sees model.py at /work and only its own processes."""
    fds = [os.memfd_create(name) for name in ("model", "args")]
    os.write(fds[0], b"x = 1\n")
    os.write(fds[1], b"".join(a.encode() + b"\0" for a in sandbox.bwrap(fds[:1], [], ())))
    for fd in fds:
        os.lseek(fd, 0, 0)
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "bwrap", "--args", str(fds[1]), "--", "/bin/sh", "-c",
                               "id -u; cat model.py; ls /proc"], pass_fds=fds,
                              capture_output=True, text=True, timeout=60)
    finally:
        for fd in fds:
            os.close(fd)
    out = proc.stdout.split()
    assert proc.returncode == 0 and out[:4] == ["65534", "x", "=", "1"], proc.stderr
    assert len([p for p in out[4:] if p.isdigit()]) <= 3, out  # bwrap's init, sh, ls


# ----------------------------------------------------------------------------- problem 5

# The handout's recipe made a hundred times cheaper (configs/ablations/cpu.py at 3 layers of width
# 32, 150 steps of 1,024 tokens): six real trainings in seconds, graded with every check the
# handout's get, against the means they gave.
RECIPE = """\
dataset = "shakespeare"
data_root = {data!r}
vocab_size = None
depth_mode = "value"
depth_stride = None
block_size = 32
n_layer = 3
n_head = 2
n_kv_head = 1
head_dim = 8
n_embd = 32
mlp_hidden = 64
batch_tokens = 1024
max_iters = 150
learning_rate = 1e-2
eval_interval = 150
eval_seqs = 64
sample_tokens = 0
"""


def summarized(out):
    """results.json as lab/ablate.py writes it, from the runs' logs."""
    losses = ablate.collect(out, EXPERIMENT["runs"], range(EXPERIMENT["seeds"]))
    stats, tables = ablate.summarize(losses)
    expected = json.loads((ROOT / "course" / "expected" / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({**expected, "runs": stats, "tables": tables}))
    return {run: [losses[run][s] for s in sorted(losses[run])] for run in losses}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """(the recipe's file, a copy holding the six runs as the handout's command writes them, no
    figure in it, and the means they gave)."""
    where = tmp_path_factory.mktemp("trained")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare_data.prepare(prepare_data.shakespeare, "shakespeare", "shakespeare", "bytes",
                             where / "data", num_proc=1)
    (where / "recipe.py").write_text(RECIPE.format(data=str(where / "data")))
    out = where / "honest" / EXPERIMENT["out"]
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        for run, seed in experiment.jobs():
            assert train_here(patch, *ablate.train_args((run, seed, None, 1),
                                                        str(where / "recipe.py"), [], out)) is None
    losses = summarized(out)
    return where / "recipe.py", where / "honest", {run: np.mean(v) for run, v in losses.items()}


@pytest.fixture
def tiny(trained, monkeypatch):
    """The grader's problem 5 on the cheap recipe: its reference the honest runs' means within
    0.01; no gain asked of value (at this size it has none); the margin of the check on the
    validation windows (tested on its own below) widened to what 64 windows of 32 tokens tell."""
    recipe, honest, means = trained
    for key, value in (("base", str(recipe)), ("reference", {k: round(v, 4) for k, v in
                                                               means.items()}),
                       ("gain", -0.1), ("tolerance", 0.01)):
        monkeypatch.setitem(EXPERIMENT, key, value)
    monkeypatch.setattr(experiment, "SEEN_MARGIN", 0.1)
    return honest


def edited(honest, where, run, seed, change):
    """A forger's copy of the honest runs: one checkpoint changed (change(cfg, state) in place), its
    log ending with the loss the grader will measure, results.json rewritten from the logs."""
    shutil.copytree(honest, where)
    out, val = where / EXPERIMENT["out"], experiment.texts()[1]
    folder = out / run / f"seed{seed}"
    ckpt = read_checkpoint(folder / "ckpt.pt")
    cfg = {**experiment.asked(run, seed), "vocab_size": 257}
    change(cfg, ckpt["model"])
    loss = experiment.mean_loss(experiment.model(cfg, ckpt["model"]), val,
                                experiment.windows(val, cfg, cfg["eval_seqs"]), cfg["block_size"])
    save_checkpoint(ckpt, folder / "ckpt.pt")
    with open(folder / "log.jsonl", "a") as f:
        f.write(json.dumps({"kind": "eval", "step": cfg["max_iters"], "val_loss": loss}) + "\n")
    summarized(out)
    return where


def bigram(cfg, state):
    """Every block's output projections zeroed: what is left is a bigram model, fitted here (a few
    seconds of it) from the token embeddings to the head."""
    tokens, _ = experiment.texts()
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name].zero_()
    gpt = experiment.model(cfg, state)
    x = torch.from_numpy(tokens[:-1].astype(np.int64))
    y = torch.from_numpy(tokens[1:].astype(np.int64))
    opt = torch.optim.Adam([gpt.embed_tokens.weight, gpt.lm_head.weight], lr=3e-2)
    for _ in range(30):
        loss = F.cross_entropy(gpt.lm_head(gpt.norm(gpt.embed_tokens(x[:8192]))), y[:8192])
        opt.zero_grad()
        loss.backward()
        opt.step()
    state.update({k: v.detach() for k, v in gpt.state_dict().items()})


FORGERIES = {
    "handout's means in results.json": "results.json's vanilla is not its logs'",
    "zeroed projections, a bigram, the shipped figure": "scores as well as a",
    "seed 0's weights moved by 1e-6 as seed 1": "predicts what seed 0's checkpoint does",
    "vanilla's checkpoint as value's": "scores as well as a vanilla model",
    "vanilla made worse": "vanilla: mean final validation loss",
    "a run folder linked to another student's": "is not read (Not a directory): the runs are the "
                                                "files the command wrote, no links",
    "a 1 GiB sparse results.json": f"is not read (not a file of at most {1 << 20} bytes)",
}


def forged(name, honest, where):
    out = where / EXPERIMENT["out"]
    if name == "handout's means in results.json":
        shutil.copytree(honest, where)
        results = json.loads((out / "results.json").read_text())
        for run in EXPERIMENT["runs"]:
            results["runs"][run]["mean"] = EXPERIMENT["reference"][run]
            results["runs"][run]["losses"] = [EXPERIMENT["reference"][run]] * 2
        (out / "results.json").write_text(json.dumps(results))
    elif name == "zeroed projections, a bigram, the shipped figure":
        edited(honest, where, "value", 0, bigram)
        shutil.copy(ROOT / "course" / "expected" / "depth_weights.png", out)
    elif name == "seed 0's weights moved by 1e-6 as seed 1":
        seed0 = read_checkpoint(honest / EXPERIMENT["out"] / "value" / "seed0" / "ckpt.pt")
        seed0["model"]["lm_head.weight"][0, 0] += 1e-6
        edited(honest, where, "value", 1, lambda cfg, state: state.update(seed0["model"]))
    elif name == "vanilla's checkpoint as value's":
        vanilla = read_checkpoint(honest / EXPERIMENT["out"] / "vanilla" / "seed0" / "ckpt.pt")
        edited(honest, where, "value", 0, lambda cfg, state: state.update(vanilla["model"]))
    elif name == "vanilla made worse":  # overconfident: value's gain grows by 0.05
        edited(honest, where, "vanilla", 0, lambda cfg, state: state["lm_head.weight"].mul_(1.5))
    elif name == "a run folder linked to another student's":
        shutil.copytree(honest, where)
        shutil.rmtree(out / "value")
        (out / "value").symlink_to(honest / EXPERIMENT["out"] / "value")
    else:
        shutil.copytree(honest, where)
        with open(out / "results.json", "r+b") as f:
            f.truncate(1 << 30)
    return where


def test_problem_5_honest_runs_full_marks_from_the_graders_own_measurements(tiny, tmp_path):
    """Six real trainings of the recipe, no figure in the folder: every test passes, the figure
    drawn by the grader; the same runs graded from a folder that holds them, bounded in time."""
    figure = tmp_path / "drawn.png"
    assert experiment.grade(tiny, EXPERIMENT["out"], figure) == dict.fromkeys(experiment.CHECKS)
    assert figure.stat().st_size > 10_000 and not (tiny / EXPERIMENT["out"] /
                                                   "depth_weights.png").exists()


@pytest.mark.parametrize("name", FORGERIES)
def test_problem_5_forgeries_score_nothing(tiny, tmp_path, name):
    """Each forgery of the issue on the honest runs: every test of problem 5 fails, for the reason
    its check gives; nothing is read beyond its limit (a 1 GiB results.json: unread)."""
    verdicts = experiment.grade(forged(name, tiny, tmp_path / "copy"), EXPERIMENT["out"])
    assert len(set(verdicts.values())) == 1 and FORGERIES[name] in verdicts[
        "the_figure_of_the_depth_weights"], verdicts


def test_problem_5_a_model_trained_on_the_validation_windows_fails():
    """The check on a tiny model: trained on training text it passes; trained on the validation
    windows it scores lower on them than on training text, and fails by name."""
    tokens, val = experiment.texts()
    offsets = np.linspace(0, len(val) - 33, 4).round().astype(np.int64)
    verdicts = {}
    for name, text, starts in (("honest", tokens, None), ("cheat", val, offsets)):
        torch.manual_seed(0)
        gpt = model.GPT(model.ModelConfig(vocab_size=257, block_size=32, n_layer=2, n_head=2,
                                          n_kv_head=1, head_dim=16, n_embd=32, mlp_hidden=64))
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
        rng = np.random.default_rng(0)
        for _ in range(150):
            batch = starts if starts is not None else rng.integers(0, len(text) - 33, 8)
            x, y = train.get_batch(text, batch, 32, "cpu", 257)
            loss = F.cross_entropy(gpt(x)[0].flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        try:
            experiment.not_trained_on_validation(
                gpt, tokens, experiment.mean_loss(gpt, val, offsets, 32), 32, name)
            verdicts[name] = None
        except experiment.Fail as e:
            verdicts[name] = str(e)
    assert verdicts["honest"] is None, verdicts
    assert verdicts["cheat"] and "learnt the validation windows" in verdicts["cheat"], verdicts


def test_problem_5s_reference_was_measured_with_todays_recipe():
    """course/expected holds the measured run: its seed-0 configs are what the handout's command
    asks for today, and its losses and value's paired gain are the grader's reference."""
    measured = json.loads((ROOT / "course" / "expected" / "configs.json").read_text())
    for run in EXPERIMENT["runs"]:
        assert not ablate.differences(measured[run], experiment.asked(run, 0)), run
    results = json.loads((ROOT / "course" / "expected" / "results.json").read_text())
    assert {run: round(results["runs"][run]["mean"], 4) for run in EXPERIMENT["runs"]} \
        == EXPERIMENT["reference"]
    gain = sum(a - b for a, b in zip(results["runs"]["value"]["losses"],
                                     results["runs"]["vanilla"]["losses"])) / 2
    assert round(-gain, 4) == EXPERIMENT["gain"]
    assert EXPERIMENT["tolerance"] < EXPERIMENT["gain"]  # it can tell value from vanilla
