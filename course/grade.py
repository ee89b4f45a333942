"""
Grade a copy of the course assignment problem by problem, test by test (the handout:
course/README.md).

    python course/grade.py                       # the copy this script is in (practice)
    python course/grade.py ../student --json=grade.json   # an instructor grades a student's copy
    python course/grade.py --problem=3           # one problem, with every failing test's reason

The graded code runs in a bubblewrap sandbox (course/sandbox.py) and sends values back over pipes;
this process alone holds the expected outputs, judges values only (whether update returns views is
not enforced) and writes the report. It needs bwrap (apt-get install bubblewrap), user namespaces
and an interpreter that imports torch in the sandbox, else it refuses in one line; --no_sandbox is
practice, never credit. The instructor's grader draws a fresh --seed and adds hidden scenarios.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # the grader's tree: its core and its model.py, the reference
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import hashlib
import json
import os
import random

from configurator import Key, UserError, parse, run_main
from course.problems import EXPERIMENT, FIXTURES, GRADED, MARKER, PROBLEMS
from outputs import mark, output_file, write_atomically

TEST_TIMEOUT_S = 60  # a test's limit: the slowest takes 1-3 s on a loaded 2-core machine


def load_fixtures(grader: Path):
    """The practice fixtures, or one line naming the file and what to do."""
    import torch
    from course.fixtures import FORMAT
    path = grader / FIXTURES
    try:  # missing, cut short, foreign or damaged bytes
        ref = torch.load(path, weights_only=True)
        if isinstance(ref, dict) and ref.get("format") == FORMAT and "tests" in ref:
            return ref
    except Exception:
        pass
    raise UserError(f"{path} is missing, damaged or not the fixtures of this grader (format "
                    f"{FORMAT}); ask for a fresh copy (python course/make.py)")


def reference(seed, names=None):
    """The instructor's scenarios drawn from seed (the tests in names, or all) with this tree's
    model.py's outputs, and that model (it answers problem 3's calls)."""
    import model
    from course import fixtures, ops
    ops.prepare(model)
    try:
        tests = {k: v for k, v in fixtures.scenarios(model, seed, hidden=True).items()
                 if names is None or k in names}
        tests = fixtures.expected(model, tests)
    except Exception as e:
        raise UserError(f"could not record the tests from {model.__file__} ({type(e).__name__}: "
                        f"{e}); grade with a tree whose model.py is complete")
    return {"tests": tests, "calls": None}, model


def digest(files) -> dict:
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None
            for f in files}


def grade(root: Path, only=None, experiment=None, seed=None, sandboxed=True, grader=HERE,
          timeout=TEST_TIMEOUT_S, figure=None) -> dict:
    """The report on the copy at root. grader: the tree whose grader this is; a student copy's
    (its marker) has the practice fixtures and no reference to record more. figure: where to draw
    problem 5's depth weights."""
    import torch  # here, not at the top: a refused argument answers before torch loads
    from course import experiment as runs
    from course import sandbox
    from course.child import Child
    from course.fixtures import stubbed
    torch.set_num_threads(1)  # tiny tensors: one thread is 20x faster than a pool
    trees = tuple(dict.fromkeys(os.path.realpath(f) for f in (grader, HERE)))
    hidden = tuple(dict.fromkeys((*trees, os.path.realpath(root))))
    if sandboxed and (why := sandbox.problem(trees)):  # once a grader, whichever copy it grades
        raise UserError(why)  # before the reference's work: nothing graded
    seed = random.SystemRandom().randrange(2 ** 31) if seed is None else seed
    # the grader's own files, the core it loaded from its tree too: a grading during which one
    # changed is void
    loaded = [Path(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
    files = sorted({grader / "model.py", *(grader / "course").rglob("*.py"),
                    *(f for f in loaded if f.parent == grader and f.suffix == ".py")})
    before, practice = digest(files), (grader / MARKER).is_file()
    problems = [p for p in PROBLEMS if only in (None, p.number)]
    names = {name for p in problems for name, _ in p.tests} | {"together"}
    ref, answering = (load_fixtures(grader), None) if practice else reference(seed, names)
    try:  # all of the student's code it runs, read without following a link, its size bounded
        source = sandbox.read_inside(root, "model.py", sandbox.SOURCE_LIMIT)
    except OSError as e:  # a link, a folder, a FIFO, too large: what the tests say
        source = f"model.py is not a file of at most {sandbox.SOURCE_LIMIT} bytes ({e.strerror})"
    runs_at = (Path(experiment), "") if experiment else (root, EXPERIMENT["out"])
    entries, child = [], Child(source, ref, answering, timeout, sandboxed, hidden)
    try:
        for p in problems:
            if not p.graded:
                entries.append({"problem": p.number, "title": p.title, "points": p.points,
                                "graded": False})
                continue
            results = runs.grade(*runs_at, figure) if not p.functions else {
                t: child.run(t, stubbed(p.number)) for t, _ in p.tests}
            entries.append(entry(p, results))
        code = [e for e in entries if e.get("graded") and e["problem"] != 5]
        together = None if only is not None else (  # once problems 1-4 pass; no points
            len(code) == 4 and all(e["earned"] == e["points"] for e in code)
            and child.run("together", []) is None)
    finally:
        child.close()
    tampered = [f for f, h in digest(files).items() if before[f] != h]
    graded = [e for e in entries if e["graded"]]
    if tampered:
        for e in graded:
            e.update(earned=0, tests=[{**t, "earned": 0} for t in e["tests"]])
    return {"written_by": mark("grade.py"), "root": str(root), "seed": seed,
            "hidden_tests": not practice, "sandbox": sandboxed, "problems": entries,
            "together": together, "tampered": tampered, "score": sum(e["earned"] for e in graded),
            "out_of": sum(e["points"] for e in graded)}


def entry(p, results) -> dict:
    """A problem's result: each test's points earned, and why a test failed."""
    tests = [{"test": name, "points": points, "earned": points if results[name] is None else 0,
              "why": results[name] and results[name][:400]} for name, points in p.tests]
    return {"problem": p.number, "title": p.title, "points": p.points, "graded": True,
            "earned": sum(t["earned"] for t in tests), "tests": tests}


def show(result, verbose):
    """One line per problem, then each failing test's points and reason (three unless verbose)."""
    for e in result["problems"]:
        head = f"problem {e['problem']}  {e['title']:<36}"
        if not e["graded"]:
            print(f"{head}  - / {e['points']:>2}  written answers, graded by hand")
            continue
        passed = sum(t["why"] is None for t in e["tests"])
        print(f"{head} {e['earned']:>2} / {e['points']:>2}  {passed} of {len(e['tests'])} tests "
              f"passed")
        reasons = {}  # the same reason for several tests (a stub, a missing file) is said once
        for t in e["tests"]:
            if t["why"] is not None:
                reasons.setdefault(t["why"], []).append(t)
        for i, (why, tests) in enumerate(reasons.items()):
            if i == 3 and not verbose:
                print(f"      ... and more: python course/grade.py --problem={e['problem']}")
                break
            more = f" and {len(tests) - 1} more" if len(tests) > 1 else ""
            lost = sum(t["points"] for t in tests)
            print(f"      {tests[0]['test']}{more} (-{lost}): {why}")
    if result["together"] is not None:
        verdict = ("cached decoding equals the full forward in every mode" if result["together"]
                   else "not yet one working model (checked once problems 1-4 pass; no points)")
        print("together: " + verdict)
    unsandboxed = "" if result["sandbox"] else "  (unsandboxed with --no_sandbox: practice only)"
    print(f"score: {result['score']} / {result['out_of']}{unsandboxed}")


KEYS = {
    "dir": Key("", "the copy to grade (default: the one this script is in)", positional=True),
    "json": Key("", "also write the result here, and problem 5's depth weights as the grader "
                 "draws them beside it (.depth_weights.png)"),
    "problem": Key(None, "grade one problem", kind=int, choices=tuple(p.number for p in GRADED)),
    "experiment": Key("", f"problem 5's runs, if not in DIR/{EXPERIMENT['out']}"),
    "seed": Key(None, "the hidden scenarios' seed (default: a fresh one; the JSON records it, to "
                "grade again alike)", "in [0, 2**63)", kind=int),
    "no_sandbox": Key(False, "practice only, never for credit: run the graded code without the "
                      "OS sandbox (the report records it)"),
}


def main(argv):
    args = parse(argv, KEYS, __doc__)
    root = Path(args["dir"] or HERE).resolve()
    if not (root / "model.py").is_file():
        raise UserError(f"{args['dir']} is not a copy of the assignment (no model.py in it)")
    json_path = output_file(args["json"], "--json", "grade.py") if args["json"] else None
    figure = json_path and output_file(json_path.with_suffix(".depth_weights.png"), "--json",
                                       "ablate.py")  # the figure beside it, drawn by ablate.save
    experiment = args["experiment"] and Path(args["experiment"]).resolve()
    if experiment and not experiment.is_dir():
        raise UserError(f"--experiment={args['experiment']} is not a folder; give the --out of the "
                        f"handout's command")
    result = grade(root, args["problem"], experiment, args["seed"], not args["no_sandbox"],
                   figure=figure)
    show(result, verbose=args["problem"] is not None)
    if json_path:
        write_atomically(json_path, json.dumps(result, indent=2) + "\n")
    if result["tampered"]:
        changed = ", ".join(result["tampered"])
        raise UserError(f"the grader's own files changed while grading ({changed}): this grading "
                        f"is void; restore them (git checkout) and grade in a container")


if __name__ == "__main__":
    sys.exit(run_main(main))
