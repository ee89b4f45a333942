"""The course assignment (course/): the repository grades full marks on the code problems, with
the hidden scenarios it records at grading time; a fresh student copy holds no solution, grades 0
and still imports; its bodies pasted back grade full in the copy's practice grader and the
instructor's; solutions that are right in another way keep full marks; each known wrong solution
loses the tests of its own problem that catch it and nothing else; a crash or an endless loop costs
only the tests it is in. The forgeries, problem 5's runs and make.py: tests/test_course_trust.py."""
import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from course.make import LEFT_OUT, WITHHELD_PAGES, blank, repository_files, stubs
from course.problems import EXPERIMENT, GRADED, PROBLEMS
from helpers import (COURSE_TIMEOUT, ENV, ROOT, earned, failing, fake_experiment, full, grade,
                     make_copy, with_bodies)
from support.outputs import mark

CODE = [p for p in GRADED if p.functions]  # problems 1-4
LOOP_TIMEOUT = 10  # the copy whose causal_attention loops forever: its passing tests take 0.1 s
TESTS = {p.number: {name for name, _ in p.tests} for p in GRADED}

# Wrong solutions students write, as bodies of the functions they belong to, grouped so that each
# copy breaks problems that the stubs keep apart: {copy: ({function: body}, {problem: the tests
# that catch it})}.
WRONG = {
    "sum, per-layer position": ({
        "group_mean": "return q.unflatten(1, (n_kv_head, -1)).sum(2)  # the sum, not the mean",
        "KVCache.update": """
            end = self.pos + k.shape[2]
            self.k[e, :, :, self.pos:end] = k
            self.v[e, :, :, self.pos:end] = v
            self.pos = end  # advanced per layer, not once per forward
            return self.k[e, :, :, :end], self.v[e, :, :, :end]""",
        "KVCache.advance": "pass"},
        {2: {"qbar_is_the_mean_of_each_group_of_query_heads"},
         4: {"a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}}),
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
        "causal_attention": "while True:\n    pass"},
        {2: {"the_weights_are_a_softmax_over_the_candidates",
             "the_softmax_runs_in_float32_for_bf16_activations"},
         3: {"depth_mix_mixes_what_each_mode_says", "the_model_gives_the_reference_logits",
             "a_bf16_model_runs_in_bf16",
             "each_layer_stores_its_mixed_record_and_decoding_reads_it"},
         4: TESTS[4]}),
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
        {1: {"every_layer_has_the_sources_of_the_rule", "layer_zero_and_vanilla_have_no_sources",
             "the_paper_counts_117_candidates_at_48_layers"},
         3: {"each_layer_stores_its_mixed_record_and_decoding_reads_it"}}),
    # the four that every practice scenario let through: only the hidden ones catch them
    "own stride, no shift, float32 sum, first row": ({
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
            return self.k[e, :, :, :end], self.v[e, :, :, :end]"""},
        {1: {"the_default_stride_is_the_modes_or_half_the_effective_depth",
             "every_layer_has_the_sources_of_the_rule"},
         2: {"the_weights_are_a_softmax_over_the_candidates",
             "the_softmax_runs_in_float32_for_bf16_activations"},
         3: {"the_weighted_sum_of_the_candidates", "a_bf16_model_runs_in_bf16"},
         4: {"a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"}}),
    # right values, wrong training: only a backward pass through the functions sees them
    "in-place softmax, detached weights": ({
        "softmax_weights": """
            scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
            s = fp32_or_wider(scores) / math.sqrt(qbar.shape[-1])
            e = (s - s.amax(2, keepdim=True)).exp_()
            return e.div_(e.sum(2, keepdim=True))  # over exp_'s saved output: backward raises""",
        "depth_mix": """
            keys, values = src_k + [k], src_v + [v]
            alpha = mode.weights(group_mean(q, k.shape[1]), keys, *rule).detach()  # never learns
            return (weighted_sum(alpha, keys) if mode.mixes_k else k,
                    weighted_sum(alpha, values) if mode.mixes_v else v, alpha)"""},
        {2: {"the_weights_are_a_softmax_over_the_candidates"},
         3: {"depth_mix_mixes_what_each_mode_says", "the_model_gives_the_reference_logits"}}),
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


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """A fresh student copy, made once; tests that change it work on copies of it."""
    return make_copy(tmp_path_factory.mktemp("course") / "student")


def test_the_repository_grades_full_marks_with_its_hidden_tests(graded):
    """The instructor's grader on its own code: problems 1-4 full with the hidden scenarios; problem
    5 on an untrained model's checkpoints (made by the fixture; the real runs take 10 minutes)
    passes every test but the losses' (test_course_trust.py grades the losses)."""
    printed, result = graded["repository"]
    assert result["hidden_tests"] is True and result["written_by"] == mark("grade.py")
    assert earned(result) == {**full(1, 2, 3, 4), 5: 11} and result["together"] is True, result
    assert failing(result) == {5: {"the_losses_are_those_of_a_correct_model"}}
    assert "the_losses_are_those_of_a_correct_model (-4): vanilla: mean final validation" \
        in printed
    handout = (ROOT / "course" / "README.md").read_text().splitlines()
    for line in printed.splitlines()[:len(CODE)]:  # what a correct solution prints, as shown
        assert line in handout, line
    for e in result["problems"]:  # the points of every test, as course/problems.py has them
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


def test_a_fresh_copy_grades_zero_imports_and_trains_nothing_yet(copy, graded):
    """The copy's own grader (practice: its recorded fixtures, no hidden tests)."""
    printed, result = graded["fresh copy"]
    assert result["hidden_tests"] is False
    assert earned(result) == dict.fromkeys([1, 2, 3, 4, 5], 0) and result["together"] is False
    assert f"no {copy / EXPERIMENT['out'] / 'results.json'}: run `python ablate.py" in printed
    for p in CODE:
        entry = next(e for e in result["problems"] if e["problem"] == p.number)
        assert all(f"Problem {p.number}: write " in t["why"] for t in entry["tests"]), entry
    # two fresh Pythons, side by side: each spends its time importing torch, on one core
    help_, imports = (subprocess.Popen([sys.executable, *args], cwd=copy, env=ENV, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                      for args in (["train.py", "--help"],
                                   ["-c", "import model, baselines, train, sample, eval, ablate"]))
    out, err = help_.communicate(timeout=300)
    assert help_.returncode == 0 and "--depth_mode" in out, err
    _, err = imports.communicate(timeout=300)
    assert imports.returncode == 0, err


def test_the_copy_holds_no_solution(copy):
    """Every line of the blanked bodies and of what is left out (the loop references, the tests, the
    pages that print the code, the answers) that the rest of the repository does not also hold: none
    is in any file of the copy, and there are enough such lines for the search to mean something."""
    blanked = stubs()
    kept = {line.strip() for f in repository_files(untracked=True) if f.endswith((".py", ".md"))
            and not f.startswith((*WITHHELD_PAGES, *blanked))  # as make.py copies them
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


def half_written(where):
    """model.py with a line that does not parse added at its end; returns that line's number."""
    lines = (ROOT / "model.py").read_text().splitlines() + ["def half_written(:"]
    (where / "model.py").write_text("\n".join(lines) + "\n")
    return len(lines)


@pytest.fixture(scope="module")
def graded(copy, tmp_path_factory):
    """{case: (printed, result)}: the repository graded by its own grader, with an untrained
    experiment (fake_experiment); the fresh copy graded by its own grader (practice); copies of it
    graded by the instructor's grader (this repository: hidden scenarios): the bodies pasted back,
    the solutions right in another way, each wrong solution, and a model.py that does not import;
    and the bodies pasted back in the copy's own grader. Each grading is a process of its own (a
    grader and its child taking turns: one core), so they run two at a time, the longest first
    (on an idle 2-core machine the endless loop takes 27 s, the repository 16 s, the crash 12 s,
    each other 4-7 s): no long one is left to finish alone at the end."""
    cases = {"pasted back": {}, "different": DIFFERENT,
             **{name: bodies for name, (bodies, _) in WRONG.items()}, "does not import": {}}
    copies = {name: with_bodies(copy, tmp_path_factory.mktemp("graded"), bodies)
              for name, bodies in cases.items()}
    half_written(copies["does not import"])
    jobs = {name: partial(grade, where, timeout=LOOP_TIMEOUT if "loop" in name else COURSE_TIMEOUT)
            for name, where in copies.items()}
    jobs["practice"] = partial(grade, copies["pasted back"], grader=copies["pasted back"])
    jobs["fresh copy"] = partial(grade, copy, grader=copy)
    runs = tmp_path_factory.mktemp("experiment") / "runs"
    jobs["repository"] = lambda: grade(ROOT, f"--experiment={fake_experiment(runs)}")
    first = ["positions, no self, endless loop", "repository", "raw value cached, a crash"]
    order = [*first, *(name for name in jobs if name not in first)]
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(jobs[name]) for name in order}
        return {name: job.result()[:2] for name, job in done.items()}


@pytest.mark.parametrize("case", ["pasted back", "practice", "different"])
def test_a_correct_solution_grades_full_marks(graded, case):
    """The reference's bodies, in the instructor's grader and the copy's; and bodies right in
    another way (bf16 einsum scores, KV heads repeated before causal_attention, a depth step at
    layer 0 over itself alone, a depth_mix without the layout check) in the instructor's."""
    _, result = graded[case]
    assert earned(result) == {**full(1, 2, 3, 4), 5: 0} and result["together"] is True, result


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_solution_costs_the_tests_that_catch_it_and_no_other(graded, name):
    _, broken = WRONG[name]
    _, result = graded[name]
    assert {n: tests for n, tests in failing(result).items() if n != 5} == broken, result
    assert result["together"] is False


def test_an_endless_loop_and_a_crash_say_so(graded):
    printed, _ = graded["positions, no self, endless loop"]
    assert f"the test ran past {LOOP_TIMEOUT} s: an endless loop" in printed
    printed, _ = graded["raw value cached, a crash"]
    assert "the interpreter died (exit 3)" in printed


def test_code_that_does_not_import_scores_zero_and_says_where(graded, tmp_path):
    printed, result = graded["does not import"]
    assert earned(result) == dict.fromkeys([1, 2, 3, 4, 5], 0)
    line = half_written(tmp_path)
    why = f"the code does not import: SyntaxError: invalid syntax (model.py, line {line})"
    assert all(t["why"] == why for e in result["problems"] if e["graded"] and e["problem"] != 5
               for t in e["tests"]), result
