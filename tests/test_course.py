"""The course assignment (course/), as its handout (course/README.md) promises: make.py writes a
student copy that holds no solution and refuses destinations that would lose files; grade.py
grades a copy in the sandbox test by test: the repository full marks with its hidden scenarios, a
fresh copy 0 and the reference's bodies full in the copy's practice grader, solutions right in
another way full, each wrong solution the tests of its own problem that catch it and no other, a
crash or an endless loop only the test it is in; the report, --json and one-line refusals. What an
instructor can trust of the grader (attacks, problem 5's forgeries): tests/test_course_trust.py."""
import ast
import json
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from configurator import run_main
from course import grade as grade_py
from course import make as make_py
from course.make import LEFT_OUT, WITHHELD_PAGES, replace_bodies, stubs
from course.problems import EXPERIMENT, EXPERIMENT_COMMAND, GRADED, MARKER, PROBLEMS
from helpers import ENV, ROOT, copy_repository, earned, failing, grade_cli, grading_here
from helpers import reasons
from outputs import mark

CODE = [p for p in GRADED if p.functions]  # problems 1-4
TESTS = {p.number: {name for name, _ in p.tests} for p in GRADED}
LOOP_TIMEOUT = 6  # the grading with an endless loop: its slowest other test takes 0.5 s

# Wrong solutions students write, as bodies of the functions they belong to, grouped so that each
# copy breaks problems that the stubs keep apart: {copy: ({function: body}, {problem: the tests
# that catch it})}. Problem 3 is graded with the reference answering its calls to the others'
# functions, so a wrong group_mean or KVCache.update costs problem 3 nothing.
WRONG = {
    "positions, raw value cached, per-layer position, a crash": ({
        "group_mean": "import os\nos._exit(3)  # the interpreter dies mid-test",
        "softmax_weights": """
            scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
            return (fp32_or_wider(scores)
                    / math.sqrt(qbar.shape[-1])).softmax(3)  # over positions""",
        "Attention.forward": """
            q, k, v = self.rotate(*self.project(x), cos, sin)
            raw = v
            if src_k:
                k, v = self.depth_step(q, k, v, src_k, src_v, e)
            if cache is None:
                return self.store_and_attend(q, k, v, cache, e)
            pos = cache.pos  # the cache keeps the raw value; attention reads the mixed one
            keys, _ = cache.update(e, k, raw)
            values = torch.cat([cache.v[e, :, :, :pos], v], 2)
            y = causal_attention(q, keys, values).transpose(1, 2)
            return self.o_proj(y.flatten(2)), (k, v)""",
        "KVCache.update": """
            end = self.pos + k.shape[2]
            self.k[e, :, :, self.pos:end] = k
            self.v[e, :, :, self.pos:end] = v
            self.pos = end  # advanced per layer, not once per forward
            return self.k[e, :, :, :end], self.v[e, :, :, :end]""",
        "KVCache.advance": "pass"},
        {2: TESTS[2], 3: {"each_layer_stores_its_mixed_record_and_decoding_reads_it"},
         4: {"a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}}),
    # what every practice scenario lets through: only the hidden ones catch the first four
    "own stride, no shift, float32 sum, first row, no self": ({
        "ModelConfig.stride": """
            return self.depth_stride or max(1, self.n_eff_layer // 2)  # the mode's own ignored""",
        "softmax_weights": """
            scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
            e = (fp32_or_wider(scores) / math.sqrt(qbar.shape[-1])).exp()  # no max shift
            return e / e.sum(2, keepdim=True)""",
        "weighted_sum": """
            w = alpha.unsqueeze(-1)  # float32 weights make a float32 sum of bf16 records
            return sum(w[:, :, c] * x for c, x in enumerate(xs))""",
        "KVCache.update": """
            end = self.pos + k.shape[2]
            self.k[e, 0, :, self.pos:end] = k[0]  # the batch's first sequence only
            self.v[e, 0, :, self.pos:end] = v[0]
            return self.k[e, :, :, :end], self.v[e, :, :, :end]""",
        "depth_mix": """
            keys, values = src_k, src_v  # the layer itself left out of its candidates
            alpha = mode.weights(group_mean(q, k.shape[1]), keys, *rule)
            return (weighted_sum(alpha, keys) if mode.mixes_k else k,
                    weighted_sum(alpha, values) if mode.mixes_v else v, alpha)"""},
        {1: {"the_default_stride_is_the_modes_or_half_the_effective_depth",
             "every_layer_has_the_sources_of_the_rule"},
         2: {"the_weights_are_a_softmax_over_the_candidates",
             "the_softmax_runs_in_float32_for_bf16_activations"},
         3: {"the_weighted_sum_of_the_candidates", "depth_mix_mixes_what_each_mode_says",
             "the_model_gives_the_reference_logits", "a_bf16_model_runs_in_bf16",
             "each_layer_stores_its_mixed_record_and_decoding_reads_it"},
         4: {"a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}}),
    # right values, wrong training (only a backward pass sees those two), and a hang
    "sum, in-place softmax, detached weights, endless loop": ({
        "group_mean": "return q.unflatten(1, (n_kv_head, -1)).sum(2)  # the sum, not the mean",
        "softmax_weights": """
            scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
            s = fp32_or_wider(scores) / math.sqrt(qbar.shape[-1])
            e = (s - s.amax(2, keepdim=True)).exp_()
            return e.div_(e.sum(2, keepdim=True))  # over exp_'s saved output: backward raises""",
        "depth_mix": """
            keys, values = src_k + [k], src_v + [v]
            alpha = mode.weights(group_mean(q, k.shape[1]), keys, *rule).detach()  # never learns
            return (weighted_sum(alpha, keys) if mode.mixes_k else k,
                    weighted_sum(alpha, values) if mode.mixes_v else v, alpha)""",
        # a hang rather than a busy loop: the same timeout, without a core spent on it
        "KVCache.advance": "import time\nwhile True:\n    time.sleep(0.1)"},
        {2: {"qbar_is_the_mean_of_each_group_of_query_heads",
             "the_weights_are_a_softmax_over_the_candidates"},
         3: {"depth_mix_mixes_what_each_mode_says", "the_model_gives_the_reference_logits"},
         4: {"a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}}),
}
# Right in another way than the reference: each keeps full marks.
DIFFERENT = {
    "softmax_weights": """
        scores = torch.einsum("bhtd,bhctd->bhct", qbar, torch.stack(keys, 2))  # bf16 scores
        return (scores.float() if scores.dtype == torch.bfloat16 else scores).div(
            math.sqrt(qbar.shape[-1])).softmax(2)""",
    "Attention.store_and_attend": """
        if cache is None:
            record = (k, v)
        else:
            pos = cache.pos
            k, v = cache.update(e, k, v)
            record = (k[:, :, pos:], v[:, :, pos:])
        g = q.shape[1] // k.shape[1]  # the KV heads repeated for their query heads
        y = causal_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
        return self.o_proj(y.transpose(1, 2).flatten(2)), record""",
    "Attention.forward": """
        q, k, v = self.rotate(*self.project(x), cos, sin)
        if self.mode.mixes:  # layer 0 too: over itself alone, its weight is one
            k, v = self.depth_step(q, k, v, src_k, src_v, e)
        return self.store_and_attend(q, k, v, cache, e)""",
    "depth_mix": """
        keys, values = src_k + [k], src_v + [v]  # no layout check: the passes alone
        alpha = mode.weights(group_mean(q, k.shape[1]), keys)
        return (weighted_sum(alpha, keys) if mode.mixes_k else k,
                weighted_sum(alpha, values) if mode.mixes_v else v, alpha)""",
}


# ----------------------------------------------------------------------------- helpers

def full(*numbers):
    return {p.number: p.points for p in PROBLEMS if p.number in numbers}


def with_bodies(where, bodies, copy=None):
    """A folder holding the repository's model.py with these functions' bodies; with copy, a copy
    of that student copy (its grader and fixtures) around it."""
    shutil.copytree(copy, where) if copy else where.mkdir(parents=True)
    (where / "model.py").write_text(replace_bodies(
        (ROOT / "model.py").read_text(), {k: textwrap.dedent(v) for k, v in bodies.items()}))
    return where


def make_copy(out, *args, tree=ROOT):
    """course/make.py of tree as a user runs it: (exit status, stderr, stdout)."""
    proc = subprocess.run([sys.executable, str(tree / "course" / "make.py"), str(out), *args],
                          cwd=tree, env=ENV, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr, proc.stdout


def refused(capsys, main, *args):
    """A refusal as the script's entry point answers it, in this process (a fresh Python spends
    its time importing torch): (exit status, its line on stderr)."""
    capsys.readouterr()
    code = run_main(main, [str(a) for a in args])
    return code, capsys.readouterr().err.strip()


# ----------------------------------------------------------------------------- the copy

def half_written(where):
    """model.py with a line that does not parse added at its end; returns that line's number."""
    lines = (ROOT / "model.py").read_text().splitlines() + ["def half_written(:"]
    where.mkdir()
    (where / "model.py").write_text("\n".join(lines) + "\n")
    return len(lines)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{case: what it gave}, two at a time, the longest first: a fresh student copy of the
    repository as it is (its untracked files too), graded by its own grader (practice: 0), then
    the reference's bodies in it (full), then train.py's --help there; meanwhile the repository
    graded by its own grader from the command line (its printed lines, its JSON over an earlier
    one), and in this process with the hidden scenarios the solutions right in another way, each
    wrong one and a model.py that does not import (problem 1: every test says why)."""
    where = tmp_path_factory.mktemp("graded")
    copies = {name: with_bodies(where / name.replace(" ", "_"), bodies)
              for name, (bodies, _) in WRONG.items()}
    copies["different"] = with_bodies(where / "different", DIFFERENT)
    half_written(where / "broken")
    (where / "repository.grade.json").write_text(json.dumps({"written_by": mark("grade.py")}))
    (where / "repository").symlink_to(ROOT)  # its JSON beside it, in the temporary folder
    (where / "no runs").mkdir()
    out = {}

    def copy_then_practice():
        out["copy"] = student = where / "student"
        out["make"] = make_copy(student, "--untracked")
        out["fresh copy"] = grade_py.grade(student, grader=student)
        pasted = with_bodies(where / "pasted", {}, copy=student)
        out["pasted back"] = grade_py.grade(pasted, grader=pasted)
        out["help"] = subprocess.run(  # the commands of the handout: their --help
            [sys.executable, "-c", "import configurator, sample, train\nfrom lab import ablate\n"
             "for main in train.main, ablate.main:\n"
             "    assert configurator.run_main(main, ['--help']) == 0"], cwd=student, env=ENV,
            capture_output=True, text=True, timeout=300)

    loop = next(name for name in WRONG if "loop" in name)
    jobs = [copy_then_practice,
            lambda: out.update({loop: grade_py.grade(copies[loop], timeout=LOOP_TIMEOUT)}),
            lambda: out.update(repository=grade_cli(where / "repository",
                                                    f"--experiment={where / 'no runs'}")),
            *(lambda name=name: out.update({name: grade_py.grade(copies[name])})
              for name in copies if name != loop),
            lambda: out.update(broken=grade_py.grade(where / "broken", only=1))]
    with grading_here(), ThreadPoolExecutor(2) as pool:
        for job in [pool.submit(job) for job in jobs]:
            job.result()
    return out


@pytest.fixture(scope="module")
def copy(graded):
    code, err, printed = graded["make"]
    assert code == 0 and printed.startswith(f"wrote the student copy {graded['copy']}"), err
    return graded["copy"]


def test_the_repository_grades_full_marks_with_its_hidden_tests(graded):
    """The instructor's grader on its own code, from the command line: problems 1-4 full with the
    hidden scenarios, lines as the handout shows them, each test's points as course/problems.py
    has them; problem 5 (no runs here: tests/test_course_trust.py grades them) 0, saying the
    command to run; the JSON replaces the one grade.py wrote earlier."""
    printed, result, _ = graded["repository"]
    assert result["hidden_tests"] is True and result["sandbox"] is True
    assert result["written_by"] == mark("grade.py") and result["together"] is True
    assert earned(result) == {**full(1, 2, 3, 4), 5: 0}, result
    handout = (ROOT / "course" / "README.md").read_text().splitlines()
    for line in printed.splitlines()[:len(CODE)]:
        assert line in handout, line
    assert "together: cached decoding equals the full forward in every mode" in printed
    assert "results.json: run `python lab/ablate.py --runs=vanilla,uniform,value" in printed
    for e in result["problems"]:
        if e["graded"]:
            p = next(p for p in PROBLEMS if p.number == e["problem"])
            assert [(t["test"], t["points"]) for t in e["tests"]] == list(p.tests)


def test_the_handout_lists_the_problems_and_tests_as_the_grader_has_them():
    """course/README.md's tables: each problem's title, points, functions, reading and budget, and
    each test's points, as course/problems.py has them (the list make.py and grade.py read)."""
    text = (ROOT / "course" / "README.md").read_text()
    rows = {int(cells[1]): cells[2:] for line in text.splitlines()
            if (cells := [c.strip() for c in line.split("|")])[1:2] and cells[1].isdigit()}
    assert sorted(rows) == [p.number for p in PROBLEMS]
    for p in PROBLEMS:
        title, points, functions, reading, budget = rows[p.number][:5]
        assert ((title, int(points), reading, budget)
                == (p.title, p.points, p.reading, p.budget)), p.number
        names = [f.split(":")[1] for f in p.functions]
        assert functions.replace("`", "").split(", ") == names if names else "`" not in functions
    tests = [(cells[1], int(cells[2])) for line in text.splitlines()
             if (cells := [c.strip().strip("`") for c in line.split("|")])[1:2]
             and any(cells[1] == name for p in GRADED for name, _ in p.tests)]
    assert tests == [t for p in GRADED for t in p.tests]
    assert f"{sum(p.points for p in GRADED)} points are graded" in text
    assert f"\n{EXPERIMENT_COMMAND}\n" in text


def test_a_fresh_copy_grades_zero_and_still_runs(copy, graded):
    """The copy's own grader (practice: its recorded fixtures, no hidden tests): every test of
    problems 1-4 names the function to write; problem 5 the command to run. The rest of the
    repository imports and runs as it is: train.py's and lab/ablate.py's --help."""
    result = graded["fresh copy"]
    assert result["hidden_tests"] is False
    assert earned(result) == dict.fromkeys([1, 2, 3, 4, 5], 0) and result["together"] is False
    for p in CODE:
        entry = next(e for e in result["problems"] if e["problem"] == p.number)
        assert all(f"Problem {p.number}: write " in t["why"] for t in entry["tests"]), entry
    assert f"no {copy / EXPERIMENT['out'] / 'results.json'}: run `python lab/ablate.py" \
        in reasons(result)[-1]
    proc = graded["help"]
    assert proc.returncode == 0 and "--depth_mode" in proc.stdout and "--seeds" in proc.stdout, \
        proc.stderr


def test_the_copy_holds_no_solution(copy):
    """Every line of the blanked bodies and of what is left out (the loop references, the tests,
    the pages that print the code, the answers) that the rest of the repository does not also
    hold: none is in any file of the copy, and there are enough such lines for the search to mean
    something."""
    blanked = stubs()
    handed = [f.relative_to(copy).as_posix() for f in copy.rglob("*") if f.is_file()]
    kept = {line.strip() for f in handed if f.endswith((".py", ".md")) and (ROOT / f).is_file()
            and not f.startswith((*WITHHELD_PAGES, *blanked))  # as make.py copies them
            for line in (ROOT / f).read_text(errors="replace").splitlines()}
    for file, bodies in blanked.items():  # what make.py keeps of the files it blanks
        kept |= {line.strip() for line in
                 replace_bodies((ROOT / file).read_text(), bodies).splitlines()}
    secret = set()
    for file, names in blanked.items():
        lines = (ROOT / file).read_text().splitlines()
        for node in ast.walk(ast.parse((ROOT / file).read_text())):
            if isinstance(node, ast.FunctionDef) and any(n.split(".")[-1] == node.name
                                                         for n in names):
                first = node.body[1] if isinstance(node.body[0], ast.Expr) else node.body[0]
                secret |= {lines[i].strip() for i in range(first.lineno - 1, node.end_lineno)}
    for left in [*LEFT_OUT, *WITHHELD_PAGES]:
        for f in [ROOT / left] if (ROOT / left).is_file() else (ROOT / left).rglob("*.py"):
            secret |= {line.strip() for line in f.read_text().splitlines()}
    secret = {s for s in secret - kept if len(s) >= 24 and not s.startswith("#")}
    assert len(secret) > 500, len(secret)
    leaks = [(f, line.strip()) for f in handed if not f.endswith(".pt")
             for line in (copy / f).read_text(errors="replace").splitlines()
             if line.strip() in secret]
    assert not leaks, leaks[:10]
    assert not (copy / "test_model.py").exists() and not (copy / "tests").exists()
    assert (copy / MARKER).read_text().startswith("A student copy made by course/make.py")


@pytest.mark.parametrize("case", ["pasted back", "different"])
def test_a_correct_solution_grades_full_marks(graded, case):
    """The reference's bodies in the copy's practice grader; bodies right in another way (bf16
    einsum scores, KV heads repeated before causal_attention, a depth step at layer 0 over itself
    alone, a depth_mix without the layout check) in the instructor's."""
    result = graded[case]
    assert earned(result) == {**full(1, 2, 3, 4), 5: 0} and result["together"] is True, result


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_solution_costs_the_tests_that_catch_it_and_no_other(graded, name):
    _, broken = WRONG[name]
    result = graded[name]
    assert {n: tests for n, tests in failing(result).items() if n != 5} == broken, result
    assert result["together"] is False


def test_an_endless_loop_and_a_crash_say_so(graded):
    """Each costs the test it is in: the child starts again for the next, which fails for its
    own reason (a softmax over positions) or passes."""
    loop, crash = (graded[next(n for n in WRONG if word in n)] for word in ("loop", "crash"))
    assert f"the test ran past {LOOP_TIMEOUT} s: an endless loop, far too much work, or far too " \
           f"much to say" in reasons(loop)
    second = next(e for e in crash["problems"] if e["problem"] == 2)["tests"]
    assert [t["why"] == "the interpreter died (exit 3)" for t in second] == [True, False, False]


def test_code_that_does_not_import_scores_zero_and_says_where(graded, tmp_path):
    result = graded["broken"]
    line = half_written(tmp_path / "again")
    why = f"the code does not import: SyntaxError: invalid syntax (model.py, line {line})"
    assert earned(result) == {1: 0} and set(reasons(result)) == {why}, result


# ----------------------------------------------------------------------------- refusals

def test_make_refuses_destinations_that_would_lose_files(copy, tmp_path, capsys, monkeypatch):
    """Inside the repository, holding it, an earlier copy without --overwrite, a folder of other
    files, a file, the current folder: one line each, nothing touched. A make.py killed mid-write
    left its part of a copy and the copy it was replacing: the old copy is back first; --overwrite
    replaces it whole."""
    student = tmp_path / "student"
    shutil.copytree(copy, student)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    for args, fragment in [((ROOT / "student",), "lies inside this repository"),
                           ((ROOT.parent,), "holds"), ((student,), "pass --overwrite"),
                           ((mine, "--overwrite"), "not written by course/make.py"),
                           ((mine / "notes.txt",), "is a file"), ((".",), "is the current folder")]:
        code, err = refused(capsys, make_py.main, *args)
        assert code == 2 and err.startswith("error: ") and fragment in err and "\n" not in err, \
            (args, err)
    assert (mine / "notes.txt").read_text() == "mine" and not (ROOT / "student").exists()
    assert not any((tmp_path / "empty").iterdir())
    (tmp_path / ".student.tmp999999999").mkdir()
    student.rename(tmp_path / ".student.old999999998")
    code, err = refused(capsys, make_py.main, student, "--untracked")
    assert code == 2 and "pass --overwrite" in err, err
    (student / "old.txt").write_text("the earlier copy's")  # a file make.py wrote, as it says
    manifest = json.loads((student / ".written_by.json").read_text())
    (student / ".written_by.json").write_text(json.dumps({**manifest, "files": [
        *manifest["files"], "old.txt"]}))
    monkeypatch.setattr(make_py, "recorded", lambda: {})  # recording: the fixture's make.py
    assert refused(capsys, make_py.main, student, "--overwrite", "--untracked")[0] == 0
    assert not (student / "old.txt").exists() and (student / MARKER).is_file()
    assert not list(tmp_path.glob(".student.*"))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The repository as it is (its untracked files too), committed to a git repository of its
    own, with an untracked scratch file."""
    tree = tmp_path_factory.mktemp("instructor") / "tree"
    copy_repository(tree)
    git = ["git", "-c", "user.name=course", "-c", "user.email=course@example.com"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the instructor's tree"]):
        subprocess.run([*git, *args], cwd=tree, check=True, capture_output=True)
    (tree / "scratch").mkdir()
    (tree / "scratch" / "solution.py").write_text("# the instructor's notes\n")
    return tree


def test_make_copies_what_git_sees_of_the_tree(tree, tmp_path, capsys, monkeypatch):
    """An untracked scratch file is named and refused (--untracked copies it, under a dirty
    stamp); a model.py the fixtures cannot be recorded from is one line, no copy written."""
    monkeypatch.setattr(make_py, "ROOT", tree)
    monkeypatch.setattr(make_py, "recorded", lambda: {})  # this process's model.py is ROOT's
    code, err = refused(capsys, make_py.main, tmp_path / "a")
    assert code == 2 and "scratch/solution.py" in err and "--untracked" in err, err
    assert refused(capsys, make_py.main, tmp_path / "b", "--untracked")[0] == 0
    assert (tmp_path / "b" / "scratch" / "solution.py").is_file()
    assert "-dirty (a dirty tree" in (tmp_path / "b" / MARKER).read_text()
    broken = shutil.copytree(tree, tmp_path / "broken")
    source = (broken / "model.py").read_text()
    (broken / "model.py").write_text(source.replace(
        "    return q.unflatten(1, (n_kv_head, -1)).mean(2)", "    raise RuntimeError('broken')"))
    code, err, printed = make_copy(tmp_path / "c", "--untracked", tree=broken)
    assert code == 2 and "cannot record the fixtures" in err and err.count("\n") == 1, err
    assert "Traceback" not in err + printed and not (tmp_path / "c").exists()


def test_grade_refuses_bad_arguments_in_one_line_before_grading(tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"score": 3, "from": "another program"}))
    figure = tmp_path / "g.depth_weights.png"  # the figure a grading draws beside its --json
    figure.write_bytes(b"\x89PNG a user's figure")
    for args, fragment in [([f"--json={tmp_path}"], "is a folder"),
                           ([f"--json={tmp_path / 'g.json'}"], "was not written by ablate.py"),
                           ([f"--json={mine}"], "was not written by grade.py"),
                           ([f"--json={other}"], "was not written by grade.py"),
                           ([f"--experiment={mine}"], "is not a folder"),
                           (["--seed=-1"], "--seed must be a finite number in [0, 2**63)"),
                           (["--problem=6"], "--problem=6 is not a choice"),
                           ([tmp_path], "is not a copy of the assignment"),
                           ([f"--json={tmp_path / 'run' / 'ckpt.dcp' / 'g.json'}"],
                            "sharded checkpoint")]:
        code, err = refused(capsys, grade_py.main, *args)
        assert code == 2 and err.startswith("error: ") and fragment in err and "\n" not in err, err
    assert mine.read_text() == "mine" and json.loads(other.read_text())["score"] == 3
    assert figure.read_bytes() == b"\x89PNG a user's figure" and not (tmp_path / "g.json").exists()


def test_grade_help_says_what_it_protects_against(capsys):
    assert run_main(grade_py.main, ["--help"]) == 0
    out = capsys.readouterr().out
    assert "bubblewrap" in out and "--no_sandbox" in out and "not enforced" in out
    assert "apt-get install bubblewrap" in out and "--seed" in out
