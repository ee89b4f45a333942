"""The course assignment (course/): the repository grades full marks on the code problems; a fresh
student copy holds no solution, grades 0 on problems 1-4 and still imports and answers --help; its
bodies pasted back grade full; each known wrong solution costs its own problem's points and, through
the recorded replays, no other's; a crash or an endless loop costs only the problem it is in."""
import ast
import json
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from course.make import (LEFT_OUT, WITHHELD_PAGES, blank, replace_bodies, repository_files,
                         stubs)
from course.problems import EXPERIMENT, FIXTURES, GRADED, MARKER, PROBLEMS
from helpers import ENV, ROOT

CODE = [p for p in GRADED if p.functions]  # problems 1-4
# Wrong solutions students write, as bodies of the functions they belong to; grouped so that each
# copy breaks problems whose replays keep the others whole:
# {copy: ({function: body}, {problem: failing tests})}
WRONG = {
    "sum, per-layer position": ({
        "group_mean": "return q.unflatten(1, (n_kv_head, -1)).sum(2)  # the sum, not the mean",
        "KVCache.update": """
            end = self.pos + k.shape[2]
            self.k[e, :, :, self.pos:end] = k
            self.v[e, :, :, self.pos:end] = v
            self.pos = end  # advanced per layer, not once per forward
            return self.k[e, :, :, :end], self.v[e, :, :, :end]""",
        "KVCache.advance": "pass"}, {2: None, 4: None}),
    "positions, no self, endless loop": ({
        "softmax_weights": """
            scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
            return (fp32_or_wider(scores)
                    / math.sqrt(qbar.shape[-1])).softmax(3)  # over positions""",
        "depth_mix": """
            keys, values = src_k, src_v  # the layer itself left out of its candidates
            qbar = group_mean(q, k.shape[1])
            alpha = mode.weights(qbar, keys)
            k_out = weighted_sum(alpha, keys) if mode.mixes_k else k
            v_out = weighted_sum(alpha, values) if mode.mixes_v else v
            return k_out, v_out, alpha""",
        "causal_attention": "while True:\n    pass"}, {2: None, 3: None, 4: None}),
    "raw value cached, a crash": ({
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
        "ModelConfig.sources": "import os\nos._exit(3)  # the interpreter dies mid-test"},
        {1: None, 3: {"test_each_layer_stores_its_mixed_record_and_decoding_reads_it"}}),
}


def grade(copy, *args, timeout=None, fixtures=None):
    """course/grade.py on copy: (its printed lines, its --json result); timeout: each test's limit;
    fixtures: recorded ones to use (the repository records its own, 3 s each time)."""
    out = copy.parent / f"{copy.name}.json"
    env = {**ENV, **({"COURSE_TEST_TIMEOUT": str(timeout)} if timeout else {}),
           **({"COURSE_FIXTURES": str(fixtures)} if fixtures else {})}
    proc = subprocess.run([sys.executable, str(ROOT / "course" / "grade.py"), str(copy),
                           f"--json={out}", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def earned(result):
    return {e["problem"]: e["earned"] for e in result["problems"] if e["graded"]}


def full(*numbers):
    return {p.number: p.points for p in PROBLEMS if p.number in numbers}


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """A fresh student copy, made once; tests that change it work on copies of it."""
    out = tmp_path_factory.mktemp("course") / "student"
    proc = subprocess.run([sys.executable, "course/make.py", str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote the student copy {out}")
    return out


def recorded(copy):
    """The fixtures course/make.py recorded into the copy, from this repository's code."""
    return copy / FIXTURES


def with_bodies(copy, tmp_path, bodies):
    """A copy of the student copy whose model.py is the repository's, with these functions'
    bodies."""
    other = tmp_path / "copy"
    shutil.copytree(copy, other)
    source = (ROOT / "model.py").read_text()
    (other / "model.py").write_text(replace_bodies(source, {k: textwrap.dedent(v)
                                                            for k, v in bodies.items()}))
    return other


def test_the_repository_grades_full_marks(tmp_path):
    """Its own fixtures are recorded from its model.py on the fly (it ships none); problem 5 reads
    the records of the measured experiment (course/expected's, laid out as the command writes)."""
    printed, result = grade(ROOT, f"--experiment={fake_experiment(tmp_path / 'runs')}")
    assert earned(result) == {**full(1, 2, 3, 4), 5: 15} and result["together"] is True
    assert printed.splitlines()[-1] == f"score: 85 / {sum(p.points for p in GRADED)}"
    handout = (ROOT / "course" / "README.md").read_text()
    for line in printed.splitlines()[:len(CODE)]:  # what a correct solution prints,
                                                   # as the handout shows
        assert line in handout.splitlines(), line


def test_the_handout_lists_the_problems_as_the_grader_has_them():
    """course/README.md's table: each problem's title, points, functions, reading and budget as
    course/problems.py has them (the list make.py, grade.py and the tests read)."""
    rows = {int(cells[1]): cells[2:]
            for line in (ROOT / "course" / "README.md").read_text().splitlines()
            if (cells := [c.strip() for c in line.split("|")])[1:2] and cells[1].isdigit()}
    assert sorted(rows) == [p.number for p in PROBLEMS]
    for p in PROBLEMS:
        title, points, functions, reading, budget = rows[p.number][:5]
        assert ((title, int(points), reading, budget)
                == (p.title, p.points, p.reading, p.budget)), p.number
        names = [f.split(":")[1] for f in p.functions]
        assert functions.replace("`", "").split(", ") == names if names else "`" not in functions
    assert (f"{sum(p.points for p in GRADED)} points are graded"
            in (ROOT / "course" / "README.md").read_text())


def test_a_fresh_copy_grades_zero_imports_and_trains_nothing_yet(copy):
    printed, result = grade(copy, fixtures=recorded(copy))
    assert earned(result) == dict.fromkeys([1, 2, 3, 4, 5], 0) and result["together"] is False
    assert f"no {copy / EXPERIMENT['out'] / 'results.json'}: run `python ablate.py" in printed
    for p in CODE:
        entry = next(e for e in result["problems"] if e["problem"] == p.number)
        assert entry["failed"] and all(f"Problem {p.number}: write " in line
                                       for line in entry["failed"]), entry
    help_ = subprocess.run([sys.executable, "train.py", "--help"], cwd=copy, env=ENV,
                           capture_output=True, text=True)
    assert help_.returncode == 0 and "--depth_mode" in help_.stdout, help_.stderr
    imports = subprocess.run([sys.executable, "-c",
                              "import model, baselines, train, sample, eval, ablate"],
                             cwd=copy, env=ENV, capture_output=True, text=True)
    assert imports.returncode == 0, imports.stderr
    size = recorded(copy).stat().st_size
    assert size < 500_000  # a few hundred kB


def test_the_copy_holds_no_solution(copy):
    """Every line of the blanked bodies and of what is left out (the loop references, the tests, the
    pages that print the code, the answers) that the rest of the repository does not also hold: none
    is in any file of the copy, and there are enough such lines for the search to mean something."""
    blanked = stubs()
    kept = {line.strip() for f in repository_files() if f.endswith((".py", ".md"))  # as make.py
            and not f.startswith((*WITHHELD_PAGES, *blanked))  # copies them
            for line in (ROOT / f).read_text(errors="replace").splitlines()}
    for file, messages in blanked.items():  # what the copy keeps of the files it blanks
        kept |= {line.strip() for line in blank((ROOT / file).read_text(), messages).splitlines()}
    secret = set()
    for file, names in blanked.items():
        tree, lines = ast.parse((ROOT / file).read_text()), (ROOT / file).read_text().splitlines()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            qual = [n for n in names if n.split(".")[-1] == getattr(node, "name", None)]
            if qual and isinstance(node, ast.FunctionDef):
                first = body[1] if isinstance(body[0], ast.Expr) else body[0]
                secret |= {lines[i].strip() for i in range(first.lineno - 1, node.end_lineno)}
    for left in [*LEFT_OUT, *WITHHELD_PAGES]:
        for f in [ROOT / left] if (ROOT / left).is_file() else (ROOT / left).rglob("*.py"):
            secret |= {line.strip() for line in f.read_text().splitlines()}
    secret = {s for s in secret - kept if len(s) >= 24 and not s.startswith("#")}
    assert len(secret) > 500, len(secret)
    leaks = [(str(f.relative_to(copy)), line.strip())
             for f in copy.rglob("*") if f.is_file() and f.suffix != ".pt"
             for line in f.read_text(errors="replace").splitlines() if line.strip() in secret]
    assert not leaks, leaks[:10]
    assert not (copy / "test_model.py").exists() and not (copy / "tests").exists()
    assert "REFERENCE_MODES" not in "".join(f.read_text(errors="replace")
                                            for f in copy.rglob("*.py"))


def half_written(copy, where):
    """A copy whose model.py ends in a line that does not parse."""
    lines = (ROOT / "model.py").read_text().splitlines()
    (where / "model.py").write_text("\n".join(lines[:-1] + ["def half_written(:"]) + "\n")
    return len(lines)


@pytest.fixture(scope="module")
def graded(copy, tmp_path_factory):
    """{case: (printed, result)} for the copies below, graded two at a time (each grading is one
    process, one thread): the repository's bodies pasted back, each wrong solution, and a model.py
    that does not import. timeout=3: one wrong solution loops forever."""
    cases = {"pasted back": {}, **{name: bodies for name, (bodies, _) in WRONG.items()},
             "does not import": {}}
    copies = {name: with_bodies(copy, tmp_path_factory.mktemp("graded"), bodies)
              for name, bodies in cases.items()}
    half_written(copy, copies["does not import"])
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(grade, where, timeout=3, fixtures=recorded(copy))
                for name, where in copies.items()}
        return {name: job.result() for name, job in done.items()}


def test_the_bodies_pasted_back_grade_full_marks(graded):
    _, result = graded["pasted back"]
    assert earned(result) == {**full(1, 2, 3, 4), 5: 0} and result["together"] is True


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_solution_costs_its_problem_and_no_other(graded, name):
    _, broken = WRONG[name]
    _, result = graded[name]
    assert earned(result) == {**full(*{1, 2, 3, 4} - set(broken)), **dict.fromkeys(broken, 0),
                              5: 0}, result
    for number, tests in broken.items():
        entry = next(e for e in result["problems"] if e["problem"] == number)
        if tests:  # only these tests catch it: the rest of the problem works
            assert {line.split("[")[0].split(":")[0]
                    for line in entry["failed"]} == tests, entry["failed"]
    assert result["together"] is False


def test_code_that_does_not_import_scores_zero_and_says_where(graded, tmp_path):
    printed, result = graded["does not import"]
    assert earned(result) == dict.fromkeys([1, 2, 3, 4, 5], 0) and "Traceback" not in printed
    line = half_written(None, tmp_path)
    why = f"the code does not import: SyntaxError: invalid syntax (model.py, line {line})"
    assert all(e["failed"] == [why] and e["note"] == "not run"
               for e in result["problems"] if e["graded"])


def test_make_refuses_destinations_that_would_lose_files(copy, tmp_path):
    def make(*args):
        proc = subprocess.run([sys.executable, "course/make.py", *map(str, args)], cwd=ROOT,
                              env=ENV, capture_output=True, text=True)
        return proc.returncode, proc.stderr.strip()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for args, fragment in [((ROOT / "student",), "lies inside this repository"),
                           ((ROOT.parent,), "holds"), ((copy,), "pass --overwrite"),
                           ((mine, "--overwrite"), "is not a student copy"),
                           ((mine / "notes.txt",), "is a file")]:
        code, err = make(*args)
        assert (code == 1 and err.startswith("error: ") and fragment in err
                and "\n" not in err), (args, err)
    assert (mine / "notes.txt").read_text() == "mine" and not (ROOT / "student").exists()
    code, _ = make(copy, "--overwrite")
    assert (code == 0 and (copy / MARKER).is_file()
            and not list(copy.parent.glob(".student.*")))


def test_grade_refuses_bad_arguments_in_one_line_before_grading(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for args, fragment in [([str(tmp_path)], "not a copy"), ([f"--json={tmp_path}"], "is a folder"),
                           ([f"--json={mine}"], "is not an earlier result"),
                           ([f"--experiment={mine}"], "is not a folder"),
                           ([f"--json={tmp_path / 'run' / 'ckpt.dcp' / 'g.json'}"],
                            "sharded checkpoint")]:
        proc = subprocess.run([sys.executable, "course/grade.py", *args], cwd=ROOT, env=ENV,
                              capture_output=True, text=True)
        err = proc.stderr.strip()
        assert (proc.returncode == 1 and err.startswith("error: ") and fragment in err
                and "\n" not in err), err
    assert mine.read_text() == "mine" and not (tmp_path / "run").exists()


def fake_experiment(out, losses=None):
    """The folder the handout's command writes, without the training: course/expected's results (the
    measured run), and for each run and seed the config train.py records and its last evaluation."""
    import ablate
    from support.sweep import run_dir, train_config
    expected = json.loads((ROOT / "course" / "expected" / "results.json").read_text())
    losses = losses or {run: dict(enumerate(v["losses"])) for run, v in expected["runs"].items()}
    for run, by_seed in losses.items():
        for seed, loss in by_seed.items():
            where = run_dir(out, run, seed)
            where.mkdir(parents=True)
            cfg = train_config([str(ROOT / EXPERIMENT["base"]),
                                str(ROOT / "configs" / "ablations" / f"mode_{run}.py"),
                                f"--seed={seed}", f"--out_dir={where}"])
            (where / "config.json").write_text(json.dumps({**cfg, "resumes": []}))
            (where / "log.jsonl").write_text(json.dumps({"kind": "eval", "step": cfg["max_iters"],
                                                         "val_loss": loss}))
    stats, tables = ablate.summarize(losses)
    (out / "results.json").write_text(json.dumps({**expected, "runs": stats, "tables": tables}))
    shutil.copy(ROOT / "course" / "expected" / "depth_weights.png", out)
    return out


def test_problem_5s_reference_was_measured_with_todays_recipe():
    """course/expected holds the measured run: its seed-0 configs (course/expected/configs.json, as
    train.py recorded them) are what the handout's command asks for today, and its losses are the
    grader's reference. A change to configs/ablations/cpu.py or train.py's defaults fails here:
    re-run the command and update course/expected and EXPERIMENT["reference"]."""
    from support.sweep import differences, train_config
    measured = json.loads((ROOT / "course" / "expected" / "configs.json").read_text())
    for run in EXPERIMENT["runs"]:
        asked = train_config([str(ROOT / EXPERIMENT["base"]),
                              str(ROOT / "configs" / "ablations" / f"mode_{run}.py"), "--seed=0"])
        assert not differences(measured[run], [], asked), (run, differences(measured[run], [],
                                                                            asked))
    results = json.loads((ROOT / "course" / "expected" / "results.json").read_text())
    assert {run: round(results["runs"][run]["mean"], 4) for run in EXPERIMENT["runs"]} \
        == EXPERIMENT["reference"]


def test_problem_5_reads_the_runs_and_is_not_fooled(tmp_path):
    """The measured run's records score 15; an edited results.json, a run trained with other
    settings, losses no correct model gives and a missing figure each score 0."""
    sys.path.insert(0, str(ROOT / "course" / "tests"))
    import test_problem5 as p5
    good = fake_experiment(tmp_path / "good")  # graded 15 through grade.py: the repository's test
    checks = [p5.test_every_run_finished_with_the_handouts_settings,
              p5.test_results_json_says_what_the_logs_say,
              p5.test_the_losses_are_those_of_a_correct_model,
              p5.test_the_figure_of_the_depth_weights]

    def caught(out, fragment):
        failed = []
        for check in checks:
            try:
                check(out, json.loads((out / "results.json").read_text()))
            except AssertionError as e:
                failed.append(str(e))
        if fragment is None:
            assert not failed, failed
        else:
            assert len(failed) == 1 and fragment in failed[0], failed
    caught(good, None)
    edited = fake_experiment(tmp_path / "edited")
    results = json.loads((edited / "results.json").read_text())
    results["runs"]["value"]["losses"][0] -= 0.05
    (edited / "results.json").write_text(json.dumps(results))
    caught(edited, "results.json's value is not its logs'")
    shorter = fake_experiment(tmp_path / "shorter")
    config = json.loads((shorter / "uniform" / "seed1" / "config.json").read_text())
    (shorter / "uniform" / "seed1" / "config.json").write_text(
        json.dumps({**config, "max_iters": 300}))
    (shorter / "uniform" / "seed1" / "log.jsonl").write_text(json.dumps(
        {"kind": "eval", "step": 300, "val_loss": results["runs"]["uniform"]["losses"][1]}))
    caught(shorter, "was trained with other settings (max_iters 300 -> 600)")
    wrong = fake_experiment(tmp_path / "wrong",
                            {run: {0: 2.3, 1: 2.31} for run in EXPERIMENT["runs"]})
    caught(wrong, "value: mean final validation loss 2.3050, the reference's 1.7716")
    (good / "depth_weights.png").unlink()
    caught(good, "pip install matplotlib")
