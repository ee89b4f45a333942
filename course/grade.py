"""
Grade a copy of the course assignment problem by problem (the handout: course/README.md).

    python course/grade.py                       # the copy this script is in
    python course/grade.py ../student --json=grade.json   # an instructor grades a copy
    python course/grade.py --problem=3           # one problem, with every failing test's reason

The tests and fixtures are this tree's (a copy grades itself; an instructor's repository grades a
student's copy with its own, whatever the copy's say), the code is DIR's. Each test has a time
limit, and a test that crashes the interpreter is charged to its problem, the rest run again: a
stub, a crash or an endless loop costs that problem's points and nothing else. A problem scores its
points when all of its tests pass; the last line is `score: X / Y`. Problem 6 is written answers,
graded by hand.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from course.problems import EXPERIMENT, FIXTURES, GRADED, MARKER, PROBLEMS  # noqa: E402
from support.cli import ConfigError, fail, output_file, require, write_atomically  # noqa: E402

PROCESS_TIMEOUT_S = 600  # one problem's whole pytest run (its tests take seconds)


def fixtures_for(root: Path, tmp: Path) -> Path:
    """The grader's fixtures: a student copy's recorded ones, or for the repository, recorded now
    from its model.py (COURSE_FIXTURES: a file recorded earlier from the same code)."""
    if os.environ.get("COURSE_FIXTURES"):
        return Path(os.environ["COURSE_FIXTURES"])
    if (root / FIXTURES).is_file():
        return root / FIXTURES
    if (root / MARKER).is_file():
        fail(f"{root / FIXTURES} is missing; ask for a fresh copy (python course/make.py)")
    path = tmp / "reference.pt"
    code = (f"import sys, torch; sys.path.insert(0, '.'); from course import fixtures; "
            f"torch.save(fixtures.make(), {str(path)!r})")
    made = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    if made.returncode:
        fail(f"could not record the fixtures from {root / 'model.py'}: "
             f"{(made.stderr.strip().splitlines() or ['no output'])[-1]}")
    return path


def run_tests(root, markers, fixtures, tmp, env_extra=None) -> dict:
    """{marker: (passed, [(test, why)], note)} for the tests with these markers (a test's marker is
    its file's: test_problem3.py -> problem3). One pytest process runs them; if it dies or hangs in
    a test, that test's problem gets nothing for it and the problems after it run again in a new
    process."""
    results, pending = {}, list(markers)
    while pending:
        report = tmp / f"report{len(results)}.jsonl"
        env = {**os.environ, "COURSE_ROOT": str(root), "COURSE_FIXTURES": str(fixtures),
               "COURSE_REPORT": str(report), "PYTHONDONTWRITEBYTECODE": "1", **(env_extra or {})}
        tests = HERE / "course" / "tests"  # the grader's tests, read by no conftest
                                           # or ini above them
        cmd = [sys.executable, "-m", "pytest", str(tests), "-m", " or ".join(pending), "-q",
               "-p", "no:cacheprovider", "-c", str(tests / "pytest.ini"), f"--confcutdir={tests}"]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=PROCESS_TIMEOUT_S)
            died = f"the interpreter died (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            proc, died = None, f"the tests ran past {PROCESS_TIMEOUT_S} s"
        records = ([json.loads(line) for line in report.read_text().splitlines()]
                   if report.is_file() else [])
        current = None  # the marker of the test that started last
        for r in records:
            if "start" in r:
                current = marker_of(r["start"])
            elif "test" in r and marker_of(r["test"]) in pending:
                entry = results.setdefault(marker_of(r["test"]), [0, [], ""])
                if r["outcome"] == "passed":
                    entry[0] += 1
                else:  # a skipped test is not a passed one
                    entry[1].append((r["test"].split("::")[-1], plain(r["why"]) or r["outcome"]))
        if any(r.get("finished") for r in records):
            break
        if current is None:  # pytest itself failed: nothing can be graded
            tail = ((proc.stdout + proc.stderr) if proc else "").strip().splitlines()[-1:] or [died]
            for m in pending:
                results[m] = [0, [("", f"pytest did not run the tests: {tail[0]}")], "crashed"]
            break
        last = next(r["start"] for r in reversed(records) if "start" in r)
        entry = results.setdefault(current, [0, [], ""])
        entry[1].append((last.split("::")[-1], died))
        entry[2] = "crashed" if proc else "timed out"
        pending = pending[pending.index(current) + 1:] if current in pending else []
    why = import_error(((proc.stdout + proc.stderr) if proc else ""), root)
    for m in markers:  # nothing ran: the tests could not import the code (a SyntaxError, say)
        entry = results.setdefault(m, [0, [], ""])
        if entry[0] == 0 and not entry[1]:
            entry[1:] = [[("", why)], "not run"]
    return {m: tuple(results[m]) for m in markers}


def import_error(said: str, root: Path) -> str:
    """Why pytest collected nothing, from its `E ` lines: 'SyntaxError: invalid syntax (model.py,
    line 459)'."""
    lines = [line[1:].strip() for line in said.splitlines() if line.startswith("E ")]
    error = next((line for line in lines if re.match(r"\w+(Error|Exception)\b", line)), None)
    if error is None:
        return lines[0] if lines else "no tests ran"
    where = next(filter(None, (re.match(r'File "([^"]+)", line (\d+)', line)
                               for line in lines)), None)
    if where:
        file = Path(where[1])
        file = file.relative_to(root) if file.is_relative_to(root) else file
        error += f" ({file}, line {where[2]})"
    return f"the code does not import: {error}"


def marker_of(nodeid: str) -> str:
    return Path(nodeid.split("::")[0]).stem.removeprefix("test_")


def plain(message: str) -> str:
    """pytest's failure line without its wrapping: 'failed on setup with "Failed: why"' -> 'why'."""
    if message.startswith('failed on setup with "'):
        message = message[len('failed on setup with "'):].removesuffix('"')
    for prefix in ("Failed: ", "AssertionError: "):
        message = message.removeprefix(prefix)
    return message


def grade(root: Path, only=None, env=None) -> dict:
    """Every problem's tests and the check of the parts together (said once problems 1-4 pass)."""
    problems = [p for p in PROBLEMS if only in (None, p.number)]
    markers = [f"problem{p.number}" for p in problems if p.graded]
    with tempfile.TemporaryDirectory(prefix="grade") as tmp:
        tmp = Path(tmp)
        fixtures = fixtures_for(HERE, tmp)
        results = run_tests(root, markers + ["together"] * (only is None), fixtures, tmp, env)
    code = [f"problem{p.number}" for p in problems if p.functions]
    if only is not None or not all(results[m][0] and not results[m][1] for m in code):
        results.pop("together", None)  # the parts as one model: said once problems 1-4 pass
    entries = []
    for p in problems:
        entry = {"problem": p.number, "title": p.title, "points": p.points, "graded": p.graded}
        if p.graded:
            passed, failures, note = results[f"problem{p.number}"]
            entry.update(earned=p.points if passed and not failures else 0, passed=passed,
                         failed=[f"{name}: {why}" if name else why for name, why in failures],
                         note=note)
        entries.append(entry)
    graded = [e for e in entries if e["graded"]]
    together = results.get("together")
    return {"root": str(root), "problems": entries,
            "together": None if only else bool(together and together[0] and not together[1]),
            "score": sum(e["earned"] for e in graded), "out_of": sum(e["points"] for e in graded)}


def show(result, verbose):
    """One line per problem, under it why its tests failed (the first three reasons unless
    verbose)."""
    for e in result["problems"]:
        head = f"problem {e['problem']}  {e['title']:<36}"
        if not e["graded"]:
            print(f"{head}  - / {e['points']:>2}  written answers, graded by hand")
            continue
        n = e["passed"] + len(e["failed"])
        tests = "its tests did not run" if e["note"] == "not run" else (
            f"{e['passed']} of {n} tests passed" + (f" ({e['note']})" if e["note"] else ""))
        print(f"{head} {e['earned']:>2} / {e['points']:>2}  {tests}")
        reasons = {}  # the same reason for several tests (a stub, a missing file) is said once
        for line in e["failed"]:
            name, _, why = line.partition(": ") if ": " in line else ("", "", line)
            reasons.setdefault(why or line, []).append(name)
        for i, (why, names) in enumerate(reasons.items()):
            if i == 3 and not verbose:
                print(f"      ... and more: python course/grade.py --problem={e['problem']}")
                break
            print(f"      {names[0]}"
                  f"{f' (and {len(names) - 1} more)' if len(names) > 1 else ''}: {why}")
    if result["together"] is not None:
        verdict = ("cached decoding equals the full forward in every mode" if result["together"]
                   else "not yet one working model (checked once problems 1-4 pass; no points)")
        print("together: " + verdict)
    print(f"score: {result['score']} / {result['out_of']}")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("dir", nargs="?", default=str(HERE),
                   help="the copy to grade (default: this one)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--problem", type=int, choices=[q.number for q in GRADED],
                   help="grade one problem")
    p.add_argument("--experiment", help=f"problem 5's runs, if not in DIR/{EXPERIMENT['out']}")
    args = p.parse_args(argv)
    root = Path(args.dir).resolve()
    if not (root / "model.py").is_file() or not (root / "course" / "tests").is_dir():
        fail(f"{args.dir} is not a copy of the assignment (no model.py and course/tests/ in it)")
    try:
        require("pytest", "grading")
        json_path = output_file(args.json, "--json", replaces=("score",)) if args.json else None
    except (ConfigError, ImportError) as e:
        fail(e)
    if args.experiment and not Path(args.experiment).is_dir():
        fail(f"--experiment={args.experiment} is not a folder; "
             f"give the --out of the handout's command")
    experiment = ({"COURSE_EXPERIMENT": str(Path(args.experiment).resolve())}
                  if args.experiment else {})
    result = grade(root, args.problem, experiment)
    show(result, verbose=args.problem is not None)
    if json_path:
        write_atomically(json_path, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        fail("interrupted: nothing graded, nothing written")
