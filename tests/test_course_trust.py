"""What an instructor can trust of the course's grader (course/grade.py): graded code that forges a
report, patches the grader, shadows pytest, rewrites the grader's tree or looks answers up in the
copy's fixtures scores nothing by it; problem 5 re-evaluates the runs' checkpoints, so runs written
without training score 0; damaged fixtures, bad arguments and make.py's destinations are refused in
one line."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course import experiment, grade as grade_py, make as make_py
from course.problems import EXPERIMENT, FIXTURES, MARKER
from helpers import (ENV, ROOT, earned, failing, fake_experiment, full, grade, make_copy,
                     with_bodies)
from support.outputs import mark
from support.errors import run_main

ZERO = dict.fromkeys([1, 2, 3, 4], 0)


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    return make_copy(tmp_path_factory.mktemp("course") / "student")


@pytest.fixture(scope="module")
def instructor(tmp_path_factory):
    """The repository's files in a folder of their own: a tree the graded code may try to rewrite,
    and a git clone of it (make.py's stamp and its untracked files)."""
    tree = tmp_path_factory.mktemp("instructor") / "tree"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tree / f)
    return tree


def side_by_side(*gradings):
    """Gradings that share nothing, both at once, their results in order: each is a process of its
    own (a grader and its child taking turns: one core), so on 2 cores two take the time of one."""
    with ThreadPoolExecutor(2) as pool:
        return [job.result() for job in [pool.submit(grading) for grading in gradings]]


def stub_copy(copy, where, prefix, name="forgery"):
    """The fresh copy (every function a stub) with `prefix` run when model.py is imported."""
    other = where / name
    shutil.copytree(copy, other)
    (other / "model.py").write_text(textwrap.dedent(prefix) + (copy / "model.py").read_text())
    return other


def test_a_forged_report_or_a_patched_grader_scores_nothing(copy, tmp_path):
    """At import: records of passed tests appended to $COURSE_REPORT (the old grader's report),
    then sys.exit(0); or the grader's conftest and checks patched to pass everything. The child
    sees no report and no grader module: 0, and the exit said as such."""
    report = tmp_path / "report.jsonl"
    forged = stub_copy(copy, tmp_path, """\
        import json, os, sys
        for n in range(1, 6):
            try:  # no file can be written: refused
                with open(os.environ.get("COURSE_REPORT", "report.jsonl"), "a") as f:
                    f.write(json.dumps({"test": f"test_problem{n}.py::t", "outcome": "passed"}))
            except OSError:
                pass
        sys.exit(0)
        """, "report")
    patched = stub_copy(copy, tmp_path, """\
        import sys
        try:
            import conftest
            conftest.note = lambda **record: None
        except ImportError:
            pass
        for m in list(sys.modules.values()):
            if hasattr(m, "judge"):
                m.judge = lambda *args, **kwargs: None
        """, "patched")
    # where the forgery would write, were it let
    (printed, result, _), (_, patched_result, _) = side_by_side(
        partial(grade, forged, env={"COURSE_REPORT": str(report)}), partial(grade, patched))
    assert {k: v for k, v in earned(result).items() if k < 5} == ZERO
    assert "the code does not import: model.py called sys.exit(0) at import" in printed
    assert not report.exists()
    assert {k: v for k, v in earned(patched_result).items() if k < 5} == ZERO


def test_a_pytest_at_the_copys_root_is_never_run(copy, tmp_path):
    shadow = stub_copy(copy, tmp_path, "", "shadow")
    (shadow / "pytest.py").write_text("print('5 passed')\nraise SystemExit(0)\n")
    (shadow / "conftest.py").write_text("raise SystemExit(0)\n")
    _, result, _ = grade(shadow)
    assert {k: v for k, v in earned(result).items() if k < 5} == ZERO


def test_code_that_rewrites_the_grader_cannot_reach_it_or_voids_the_grading(copy, tmp_path,
                                                                              instructor):
    """At import it finds the grader from its parent's command line, appends a judge that passes
    everything to the grader's checks.py and moves its own model.py over the grader's fixtures.py
    (a rename needs no write). In the sandbox there is no grader to find: 0, nothing changed.
    Unsandboxed (--no-sandbox, practice), the grading that saw the rename is void, scores 0, names
    the file and exits 2."""
    rewriter = stub_copy(copy, tmp_path, """\
        import os, pathlib
        argv = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
        course = next(pathlib.Path(a.decode()).parent for a in argv if a.endswith(b"grade.py"))
        try:
            with open(course / "checks.py", "a") as f:
                f.write("\\ndef judge(*args, **kwargs):\\n    return None\\n")
        except OSError:
            pass
        os.replace(__file__, course / "fixtures.py")
        """, "rewriter")
    before = hashes(instructor)
    _, result, proc = grade(rewriter, "--problem=1", grader=instructor)
    assert earned(result) == {1: 0} and not result["tampered"] and hashes(instructor) == before
    _, result, proc = grade(rewriter, "--problem=1", "--no-sandbox", grader=instructor, ok=False)
    assert (instructor / "course" / "checks.py").read_bytes() == before[instructor / "course" /
                                                                         "checks.py"]
    assert proc.returncode == 2 and "this grading is void" in proc.stderr
    assert "course/fixtures.py" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert earned(result) == {1: 0} and result["tampered"] and result["sandbox"] is False
    shutil.copy2(ROOT / "course" / "fixtures.py", instructor / "course" / "fixtures.py")


def test_answers_looked_up_in_the_copys_fixtures_fail_the_hidden_tests(copy, tmp_path):
    """A model.py that answers from the practice fixtures (unsandboxed: in the sandbox it cannot
    even read them) passes the copy's own grader on the values it looks up (not their gradients),
    and 0 from the instructor's: fresh inputs, and scenarios the copy never saw."""
    bodies = {"ModelConfig.stride": 'return _lookup("stride", lambda a: ModelConfig(**a[0]) == '
                                    'self)',
              "ModelConfig.sources": 'return _lookup("sources", lambda a: ModelConfig(**a[0]) == '
                                     'self)[e]',
              "group_mean": 'return _lookup("group_mean", lambda a: same(a[0], q) and a[1] == '
                            'n_kv_head)',
              "softmax_weights": 'return _lookup("softmax_weights", lambda a: same(a[0], qbar))',
              "weighted_sum": 'return _lookup("weighted_sum", lambda a: same(a[0], alpha))',
              "causal_attention": 'return _lookup("causal_attention", lambda a: same(a[0], q))'}
    lookup = with_bodies(copy, tmp_path, bodies, f"""\
        import torch as _torch
        _TABLE = _torch.load({str(copy / FIXTURES)!r}, weights_only=True)["tests"]

        def same(a, b):
            return a.shape == b.shape and a.dtype == b.dtype and _torch.equal(a, b)

        def _lookup(op, match):
            for cases in _TABLE.values():
                for name, args, what, want in cases:
                    if name == op and match(args):
                        return want
            raise KeyError(op)
        """, "lookup")
    (_, practice, _), (_, result, _) = side_by_side(
        partial(grade, lookup, "--problem=2", "--no-sandbox", grader=lookup),
        partial(grade, lookup, "--no-sandbox"))
    assert failing(practice) == {2: {"qbar_is_the_mean_of_each_group_of_query_heads",
                                     "the_weights_are_a_softmax_over_the_candidates"}}, practice
    assert all(t["why"] is None or t["why"].startswith("backward (training)")
               for t in practice["problems"][0]["tests"]), practice  # values: every one looked up
    assert earned(result)[1] == 0 and earned(result)[2] == 0, result
    assert {"the_weighted_sum_of_the_candidates"} <= failing(result)[3]
    assert failing(result)[4] >= {"causal_attention_over_a_whole_sequence"}


def test_results_that_are_not_the_functions_score_nothing(copy, tmp_path):
    """A string that says "passed", a dict, a tensor subclass, the right tensor in the wrong dtype:
    each fails its test in one line, and the grading goes on."""
    garbage = with_bodies(copy, tmp_path, {
        "group_mean": 'return "passed"',
        "softmax_weights": 'return {"alpha": 1, "passed": True}',
        "causal_attention": "return torch.nn.Parameter(q.float())",
        "ModelConfig.stride": "return float(self.depth_stride or 1) + 0.5"}, "", "garbage")
    (printed, result, _), (_, fourth, _) = side_by_side(partial(grade, garbage, "--problem=2"),
                                                         partial(grade, garbage, "--problem=4"))
    assert earned(result) == {2: 0}
    assert "returned str, not a tensor" in printed
    assert failing(fourth) == {4: {"causal_attention_over_a_whole_sequence",
                                   "a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}}


def test_prints_that_are_not_utf8_cost_nothing(copy, tmp_path):
    noisy = with_bodies(copy, tmp_path, {}, """\
        import sys
        sys.stdout.buffer.write(b"\\xff\\xfe not UTF-8\\n")
        sys.stderr.buffer.write(b"\\xc3\\x28\\n")
        sys.stdout.flush()
        """, "noisy")
    _, result, _ = grade(noisy, "--problem=2")
    assert earned(result) == {2: 15}


def test_damaged_or_foreign_fixtures_are_named_in_one_line(copy, tmp_path):
    damaged = {}
    for damage in ("truncated", "foreign"):
        other = damaged[damage] = tmp_path / damage
        shutil.copytree(copy, other)
        path = other / FIXTURES
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:1000])
        else:
            torch.save({"sources": 1}, path)
    gradings = side_by_side(*(partial(grade, other, grader=other, ok=False)
                              for other in damaged.values()))
    for other, (_, result, proc) in zip(damaged.values(), gradings):
        path = other / FIXTURES
        err = proc.stderr.strip()
        assert proc.returncode == 2 and err.startswith("error: ") and str(path) in err \
            and "\n" not in err and result is None, err


# ------------------------------------------------------------------------------- problem 5

def test_problem_5_reevaluates_the_checkpoints(tmp_path):
    """Logs fabricated from course/expected with no checkpoint, or beside checkpoints that do not
    give them, score 0 on every test (checkpoints that do: tests/test_course.py, the repository's
    full marks)."""
    bare = experiment.grade(fake_experiment(tmp_path / "bare", checkpoints=False), ROOT)
    assert all(bare.values()) and "no " in bare["each_checkpoint_gives_its_logged_loss"], bare
    expected = json.loads((ROOT / "course" / "expected" / "results.json").read_text())
    losses = {run: dict(enumerate(v["losses"])) for run, v in expected["runs"].items()}
    forged = experiment.grade(fake_experiment(tmp_path / "forged", losses), ROOT)
    assert all(forged.values()), forged
    assert "the log is not the checkpoint's" in forged["each_checkpoint_gives_its_logged_loss"]


def test_problem_5_fabricated_runs_score_nothing(tmp_path):
    """One checkpoint relabelled as another run (its config rewritten, its log given its own loss),
    or one run's checkpoint copied to both seeds: the checkpoints do not hold their runs, and the
    problem scores 0."""
    from support.sweep import run_dir
    losses = {run: {0: 2.0, 1: 2.1} for run in EXPERIMENT["runs"]}  # never reached: not evaluated
    out = fake_experiment(tmp_path / "runs", losses)
    cases = {}
    for name, (source, target) in {"relabelled": (("vanilla", 0), ("value", 0)),
                                   "one seed twice": (("value", 0), ("value", 1))}.items():
        forged = cases[name] = tmp_path / name.replace(" ", "_")
        shutil.copytree(out, forged)
        ckpt = torch.load(run_dir(forged, *source) / "ckpt.pt", weights_only=True)
        ckpt["config"] = torch.load(run_dir(forged, *target) / "ckpt.pt",
                                    weights_only=True)["config"]
        torch.save(ckpt, run_dir(forged, *target) / "ckpt.pt")
        shutil.copy(run_dir(forged, *source) / "log.jsonl", run_dir(forged, *target) / "log.jsonl")
    relabelled = experiment.grade(cases["relabelled"], ROOT)
    twice = experiment.grade(cases["one seed twice"], ROOT)
    assert all(relabelled.values()) and all(twice.values())
    assert "holds another model than its run's: depth_mode 'vanilla' (the run's: 'value')" \
        in relabelled["each_checkpoint_gives_its_logged_loss"], relabelled
    assert "holds the same weights as value seed 0" in twice["each_checkpoint_gives_its_logged_loss"]


def test_problem_5_a_model_trained_on_the_validation_windows_fails():
    """The check on a tiny model: trained on training text it passes; trained on the validation
    windows it scores lower on them than on training text, and fails by name."""
    import model
    train, val = experiment.texts({"dataset": "shakespeare"})
    cfg = {"block_size": 32, "eval_seqs": 4}
    offsets = np.linspace(0, len(val) - 33, 4).round().astype(np.int64)
    verdicts = {}
    for name, text, starts in (("honest", train, None), ("cheat", val, offsets)):
        torch.manual_seed(0)
        gpt = model.GPT(model.ModelConfig(vocab_size=257, block_size=32, n_layer=2, n_head=2,
                                          n_kv_head=1, head_dim=16, n_embd=32, mlp_hidden=64))
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
        rng = np.random.default_rng(0)
        for _ in range(150):
            batch = starts if starts is not None else rng.integers(0, len(text) - 33, 8)
            w = torch.from_numpy(np.stack([text[o:o + 33] for o in batch]).astype(np.int64))
            loss = F.cross_entropy(gpt(w[:, :-1])[0].flatten(0, 1), w[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        try:
            experiment.not_trained_on_validation(gpt, train, experiment.val_loss(gpt, val, cfg),
                                                 cfg, name)
            verdicts[name] = None
        except experiment.Fail as e:
            verdicts[name] = str(e)
    assert verdicts["honest"] is None, verdicts
    assert verdicts["cheat"] and "learnt the validation windows" in verdicts["cheat"], verdicts


def test_problem_5s_checks_of_the_records(tmp_path):
    """On logs alone: the measured losses pass; value trained like vanilla, an edited results.json,
    a shorter run and a missing figure each fail their check."""
    def check(name, out):
        try:
            experiment.CHECKS[name](out, experiment.results_of(out), ROOT)
        except experiment.Fail as e:
            return str(e)
        return None
    good = fake_experiment(tmp_path / "good", checkpoints=False)
    for name in experiment.CHECKS:
        if name != "each_checkpoint_gives_its_logged_loss":
            assert check(name, good) is None, name
    vanilla = {0: 1.79, 1: 1.80}  # each mean within the tolerance, value's gain too small
    like = fake_experiment(tmp_path / "like", {"vanilla": vanilla, "uniform": {0: 1.74, 1: 1.76},
                                               "value": {0: 1.78, 1: 1.79}}, False)
    assert "value is -0.0100 against vanilla" in check("the_losses_are_those_of_a_correct_model",
                                                       like)
    results = json.loads((good / "results.json").read_text())
    results["runs"]["value"]["losses"][0] -= 0.05
    (good / "results.json").write_text(json.dumps(results))
    assert "results.json's value is not its logs'" in check("results_json_says_what_the_logs_say",
                                                            good)
    config = json.loads((good / "uniform" / "seed1" / "config.json").read_text())
    (good / "uniform" / "seed1" / "config.json").write_text(json.dumps({**config,
                                                                       "max_iters": 300}))
    (good / "uniform" / "seed1" / "log.jsonl").write_text(json.dumps(
        {"kind": "eval", "step": 300, "val_loss": 1.75}))
    assert "max_iters 300 -> 600" in check("every_run_finished_with_the_handouts_settings", good)
    (good / "depth_weights.png").unlink()
    assert "pip install matplotlib" in check("the_figure_of_the_depth_weights", good)
    assert EXPERIMENT["tolerance"] < EXPERIMENT["gain"]  # it can tell value from vanilla


def test_problem_5s_reference_was_measured_with_todays_recipe():
    """course/expected holds the measured run: its seed-0 configs are what the handout's command
    asks for today, and its losses and value's paired gain are the grader's reference."""
    from support.sweep import differences, train_config
    measured = json.loads((ROOT / "course" / "expected" / "configs.json").read_text())
    for run in EXPERIMENT["runs"]:
        asked = train_config([str(ROOT / EXPERIMENT["base"]),
                              str(ROOT / "configs" / "ablations" / f"mode_{run}.py"), "--seed=0"])
        assert not differences(measured[run], [], asked), run
    results = json.loads((ROOT / "course" / "expected" / "results.json").read_text())
    assert {run: round(results["runs"][run]["mean"], 4) for run in EXPERIMENT["runs"]} \
        == EXPERIMENT["reference"]
    gain = sum(a - b for a, b in zip(results["runs"]["value"]["losses"],
                                     results["runs"]["vanilla"]["losses"])) / 2
    assert round(-gain, 4) == EXPERIMENT["gain"]


# ------------------------------------------------------------------------ the scripts' refusals

def run(script, *args, cwd=ROOT):
    """The script as a user runs it, in a fresh Python: (exit status, stderr, stdout)."""
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True)
    return proc.returncode, proc.stderr.strip(), proc.stdout


def refused(capsys, script, *args):
    """A refusal as the script's entry point (run_main) answers it, in this process: (exit status,
    its one line on stderr). Every refusal comes before the script's work, so a fresh Python would
    spend its time importing torch; one refusal of each script still runs as a subprocess (run)."""
    capsys.readouterr()
    code = run_main(script.interruptible, [str(a) for a in args])
    return code, capsys.readouterr().err.strip()


def test_make_refuses_destinations_that_would_lose_files(copy, tmp_path, capsys, monkeypatch):
    student = tmp_path / "student"  # the module's copy stays as make.py wrote it
    shutil.copytree(copy, student)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    fake = tmp_path / "fake"
    (fake / "course").mkdir(parents=True)
    (fake / MARKER).write_text("not make.py's\n")
    for args, cwd, fragment in [((ROOT / "student",), ROOT, "lies inside this repository"),
                                ((ROOT.parent,), ROOT, "holds"), ((student,), ROOT, "--overwrite"),
                                ((mine, "--overwrite"), ROOT, "not written by course/make.py"),
                                ((fake, "--overwrite"), ROOT, "not written by course/make.py"),
                                ((mine / "notes.txt",), ROOT, "is a file"),
                                ((".",), empty, "is the current folder")]:
        monkeypatch.chdir(cwd)
        code, err = refused(capsys, make_py, *args)
        assert (code == 2 and err.startswith("error: ") and fragment in err
                and "\n" not in err), (args, err)
    monkeypatch.chdir(ROOT)
    assert (mine / "notes.txt").read_text() == "mine" and not (ROOT / "student").exists()
    # a make.py killed mid-write left its part of a copy, and the copy it was replacing
    (tmp_path / ".student.tmp999999999").mkdir()
    os.replace(student, tmp_path / ".student.old999999998")
    code, err = refused(capsys, make_py, student, "--untracked")
    assert code == 2 and "pass --overwrite" in err, err  # the old copy is back in place first
    # the command line itself, in fresh Pythons side by side: a refusal in the folder it names is
    # one line and exit status 2; --overwrite replaces the copy whole
    (code, err, out), again = side_by_side(
        partial(run, ROOT / "course" / "make.py", ".", cwd=empty),
        partial(run, ROOT / "course" / "make.py", student, "--overwrite", "--untracked"))
    assert code == 2 and err.startswith("error: ") and "is the current folder" in err \
        and "\n" not in err and "Traceback" not in err + out, err
    assert empty.is_dir() and not any(empty.iterdir())
    code, err, _ = again
    assert code == 0 and (student / MARKER).is_file(), err
    assert not list(tmp_path.glob(".student.*"))


def test_make_copies_tracked_files_and_stamps_a_dirty_tree(tmp_path):
    """In a clone: an untracked scratch file is named and refused (--untracked copies it, under a
    dirty stamp); a model.py the fixtures cannot be recorded from is one line, no traceback."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / "scratch").mkdir()
    (clone / "scratch" / "solution.py").write_text("# the instructor's notes\n")
    (code, err, _), untracked = side_by_side(  # both only read what git sees of the clone
        partial(run, clone / "course" / "make.py", tmp_path / "a", cwd=clone),
        partial(run, clone / "course" / "make.py", tmp_path / "b", "--untracked", cwd=clone))
    assert code == 2 and "scratch/solution.py" in err and "--untracked" in err, err
    code, err, _ = untracked
    assert code == 0 and (tmp_path / "b" / "scratch" / "solution.py").is_file(), err
    assert "-dirty (a dirty tree" in (tmp_path / "b" / MARKER).read_text()
    (clone / "scratch" / "solution.py").unlink()
    source = (clone / "model.py").read_text()
    (clone / "model.py").write_text(source.replace("    return q.unflatten(1, (n_kv_head, -1))"
                                                   ".mean(2)", "    raise RuntimeError('broken')"))
    code, err, out = run(clone / "course" / "make.py", tmp_path / "c", cwd=clone)
    assert code == 2 and "cannot record the fixtures" in err and "\n" not in err, err
    assert "Traceback" not in err + out and not (tmp_path / "c").exists()


def test_grade_refuses_bad_arguments_in_one_line_before_grading(tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"score": 3, "from": "another program"}))
    for args, fragment in [([f"--json={tmp_path}"], "is a folder"),
                           ([f"--json={mine}"], "was not written by grade.py"),
                           ([f"--json={other}"], "was not written by grade.py"),
                           ([f"--experiment={mine}"], "is not a folder"),
                           (["--seed=-1"], "out of range"),
                           ([f"--json={tmp_path / 'run' / 'ckpt.dcp' / 'g.json'}"],
                            "sharded checkpoint")]:
        code, err = refused(capsys, grade_py, *args)
        assert code == 2 and err.startswith("error: ") and fragment in err and "\n" not in err, err
    assert mine.read_text() == "mine" and json.loads(other.read_text())["score"] == 3
    # the command line itself, in fresh Pythons side by side: a refusal is one line and exit
    # status 2; a result grade.py wrote earlier is replaced
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"written_by": mark("grade.py"), "score": 0}))
    (code, err, out), again = side_by_side(
        partial(run, ROOT / "course" / "grade.py", tmp_path),
        partial(run, ROOT / "course" / "grade.py", "--problem=1", f"--json={earlier}"))
    assert code == 2 and err.startswith("error: ") and "not a copy" in err and "\n" not in err \
        and "Traceback" not in err + out, err
    code, err, _ = again
    assert code == 0 and json.loads(earlier.read_text())["problems"][0]["earned"] == 10, err


def test_grade_help_says_what_it_protects_against(capsys):
    with pytest.raises(SystemExit) as done:  # argparse's --help prints and exits 0
        run_main(grade_py.interruptible, ["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "bubblewrap" in out and "--no-sandbox" in out
    assert "apt-get install bubblewrap" in out and "not enforced" in out
    assert full(1) == {1: 10}


# --------------------------------------------------------- the sandbox: attacks on the grader itself

MARKER_ARG = "course-attack-grandchild"  # in a grandchild's command line: seen from outside


def attack_copy(copy, where, name, suffix, bodies=None):
    """The fresh copy (every function a stub), or the repository's model.py with `bodies`, with
    `suffix` run at the end of its import."""
    other = with_bodies(copy, where, bodies, "", name) if bodies is not None else \
        stub_copy(copy, where, "", name)
    (other / "model.py").write_text((other / "model.py").read_text() + textwrap.dedent(suffix))
    return other


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


ORACLE = """
    import sys as _sys

    def _ask(function, **arguments):
        main, frame = _sys.modules["__main__"], _sys._getframe()
        while frame is not None and "outbox" not in frame.f_locals:  # serve's pipes
            frame = frame.f_back
        main.send(frame.f_locals["outbox"], {"call": function, "arguments": main.freeze(arguments)})
        return main.receive(frame.f_locals["inbox"])

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
    """

# the reference's weighted_sum, after asking the parent five times for the sources of layer 6e8
HOLD = {"weighted_sum": """
    for _ in range(5):
        _ask("model.py:ModelConfig.sources", self=ModelConfig(n_layer=600_000_000), e=600_000_000)
    w = alpha.to(xs[0].dtype).unsqueeze(-1)
    return sum(w[:, :, c] * x for c, x in enumerate(xs))"""}

# the reference's model.py without a KV cache, and the harness in its process patched: decoding is
# the full forward, and the whole model "together" too
HARNESS = """
    import sys as _sys
    _main = _sys.modules["__main__"]
    _main.OPS["decode"] = lambda model, config, state, idx, *rest: [
        _main.OPS["logits"](model, config, state, idx)] * 3
    _main.OPS["together"] = lambda model, config, state, idx, *rest: [
        _main.OPS["logits"](model, config, state, idx)] * 4
    """


def marked_processes():
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if MARKER_ARG.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return [p for p in pids if p != os.getpid()]


def hashes(tree):
    return {f: f.read_bytes() for f in sorted((tree / "course").rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def attacked(copy, instructor, tmp_path_factory):
    """The instructor's grader on each attack (the escape, the oracle, holding the parent, the
    patched harness), two at a time, then on a blank copy from the same tree; what was left
    behind: {"gradings": {case: (printed, result, proc, seconds)}, "survivors", "before", "after",
    "pth"}."""
    import sysconfig
    where = tmp_path_factory.mktemp("attacks")
    grade(copy, "--problem=1", grader=instructor)  # the grader's bytecode exists: a target
    pth = Path(sysconfig.get_paths()["purelib"]) / f"zz_course_attack_{os.getpid()}.pth"
    before = hashes(instructor)
    copies = {"escape": attack_copy(copy, where, "escape", escape(instructor, pth)),
              "oracle": attack_copy(copy, where, "oracle", ORACLE),
              "hold": attack_copy(copy, where, "hold", ORACLE, HOLD),
              "harness": attack_copy(copy, where, "harness", HARNESS, {
                  "KVCache.update": "raise NotImplementedError('no cache')"})}
    args = {"hold": ["--problem=3"], "escape": [f"--experiment={where}"]}

    def timed(name):
        start = time.monotonic()
        out = grade(copies[name], *args.get(name, []), grader=instructor, ok=False)
        return (*out, time.monotonic() - start)
    try:
        gradings = dict(zip(copies, side_by_side(*(partial(timed, n) for n in copies))))
        deadline = time.monotonic() + 30  # the kernel ends a PID namespace's processes at once
        while (survivors := marked_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        gradings["blank"] = (*grade(copy, f"--experiment={where}", grader=instructor), 0)
        return {"gradings": gradings, "survivors": survivors, "before": before,
                "after": hashes(instructor), "pth": pth.exists()}
    finally:
        for pid in marked_processes():
            os.kill(pid, 9)
        pth.unlink(missing_ok=True)


def test_graded_code_cannot_read_the_reference(attacked):
    """The grader's tree is not in the sandbox: the reference model.py is nowhere to be found, by
    /proc or by its path; the attack and a blank copy after it score 0 on problems 1-4."""
    for case in ("escape", "blank"):
        _, result, _, _ = attacked["gradings"][case]
        assert {k: v for k, v in earned(result).items() if k < 5} == ZERO, case
        assert result["together"] is False and result["sandbox"] is True


def test_nothing_the_graded_code_starts_outlives_its_test(attacked):
    """A grandchild in a session of its own dies with the sandbox's PID namespace."""
    assert attacked["survivors"] == []


@pytest.mark.parametrize("target", ["bytecode", "source", "site-packages"])
def test_graded_code_cannot_persist(attacked, target):
    """The grader's source and bytecode, and site-packages, as they were: nothing rewrote them
    through an mmap, nothing added a .pth; the blank copy graded next scores 0."""
    changed = [f for f, data in attacked["before"].items() if attacked["after"].get(f) != data]
    kinds = {"bytecode": ".pyc", "source": ".py"}
    assert not [f for f in changed if f.suffix == kinds.get(target, "-")], changed
    assert target != "site-packages" or not attacked["pth"]
    _, result, proc, _ = attacked["gradings"]["blank"]
    assert earned(result) == {**ZERO, 5: 0} and not result["tampered"], proc.stdout


def test_the_report_is_written_by_the_grader_alone(attacked):
    """The sandbox sees neither the grader's stdout nor its command line: the last line printed
    and the JSON are the grader's."""
    printed, result, proc, _ = attacked["gradings"]["escape"]
    assert printed.strip().splitlines()[-1] == "score: 0 / 85", printed
    assert "85 / 85" not in printed + proc.stderr and result["score"] == 0


def test_the_parent_answers_no_call_outside_an_op_that_stubs_it(attacked):
    """Calls for problems 1, 2 and 4 sent down the child's own pipes, outside problem 3's ops:
    the parent says "your own function" (a stub here): 0."""
    _, result, _, _ = attacked["gradings"]["oracle"]
    assert {k: v for k, v in earned(result).items() if k < 5} == ZERO


def test_a_call_larger_than_its_test_costs_the_parent_nothing(attacked):
    """Five calls for the sources of layer 6e8 (hours for the reference) are refused unanswered:
    problem 3, otherwise the reference's, keeps its points in the time of an ordinary grading."""
    from course.child import scale, within
    _, result, _, seconds = attacked["gradings"]["hold"]
    assert earned(result) == {3: 25} and seconds < 300, (seconds, result)
    assert not within({"self": {"ModelConfig": {"n_layer": 600_000_000}}, "e": 600_000_000},
                      scale([{"n_layer": 4}, torch.zeros(2, 8)]))


def test_a_patched_harness_does_not_decode(attacked):
    """No KV cache, and the harness's decode and together replaced by the full forward: decoding
    starts from a cache of records no tokens give, so only reading the cache gets its logits."""
    _, result, _, _ = attacked["gradings"]["harness"]
    assert failing(result)[3] == {"each_layer_stores_its_mixed_record_and_decoding_reads_it"}
    assert failing(result)[4] == {"a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}
    assert result["together"] is False


def test_grading_without_the_sandbox_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """No bwrap on the PATH, or a bwrap that cannot make its namespaces: one line naming the fix,
    before any grading."""
    monkeypatch.setenv("PATH", str(tmp_path))
    code, err = refused(capsys, grade_py, "--problem=1")
    assert code == 2 and "the bwrap command is missing" in err and "apt-get install bubblewrap" \
        in err and "--no-sandbox" in err and "\n" not in err, err
    (tmp_path / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new "
                                    "namespace' >&2\nexit 1\n")
    (tmp_path / "bwrap").chmod(0o755)
    code, err = refused(capsys, grade_py, "--problem=1")
    assert code == 2 and "No permissions to create new namespace" in err and "user namespaces" \
        in err and "\n" not in err, err


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="becomes the unprivileged user `nobody` with setpriv, as root")
def test_the_sandbox_starts_for_an_unprivileged_user(monkeypatch):
    """The same namespaces for `nobody` (root's own Python left out: nobody cannot read it): it
    sees the copied model.py at /work and only its own processes."""
    from course import sandbox
    monkeypatch.setattr(sandbox, "python_roots", lambda: [])
    folder = Path(tempfile.mkdtemp(prefix="sandbox"))
    try:
        folder.chmod(0o755)
        (folder / "model.py").write_text("x = 1\n")
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               *sandbox.command(folder / "model.py", [
                                   "/bin/sh", "-c", "id -u; cat model.py; ls /proc"])],
                              capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(folder)
    out = proc.stdout.split()
    assert proc.returncode == 0 and out[:4] == ["65534", "x", "=", "1"], proc.stderr
    assert len([p for p in out[4:] if p.isdigit()]) <= 3, out  # bwrap's init, sh, ls
