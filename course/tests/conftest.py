"""The graded tests' plumbing: the code under grading on the path, the grader's own course package,
the reference fixtures, a time limit per test (an endless loop costs its problem, not the whole
grading), one marker per problem, and a report that grade.py reads (COURSE_REPORT: a JSON line as
each test starts and ends, so a crash names its test).

The tests, their fixtures and the `course` package come from the grader's tree (the one these tests
are in); model.py and the rest from COURSE_ROOT, the copy being graded (default: the same tree). So
an instructor grades a student's copy with the instructor's own tests, whatever the copy's say."""
import json
import os
import signal
import sys
import types
from pathlib import Path

import pytest
import torch

GRADER = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("COURSE_ROOT") or GRADER)  # the code under grading
sys.path.insert(0, str(ROOT))
sys.modules["course"] = course = types.ModuleType("course")  # course.* from GRADER, never from ROOT
course.__path__ = [str(GRADER / "course")]

from course.problems import FIXTURES, PROBLEMS  # noqa: E402

# per test; the slowest takes about a second on a loaded 2-core machine (COURSE_TEST_TIMEOUT: the
# grader's own tests, which try an endless loop)
TIMEOUT_S = int(os.environ.get("COURSE_TEST_TIMEOUT", 60))


def pytest_configure(config):
    for p in PROBLEMS:
        config.addinivalue_line("markers", f"problem{p.number}: problem {p.number}, {p.title}")
    config.addinivalue_line("markers", "together: every problem at once (no points)")


def note(**record):
    if os.environ.get("COURSE_REPORT"):
        with open(os.environ["COURSE_REPORT"], "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    note(start=nodeid)


FAILED = set()  # the files (problem3, ...) with a failing test so far in this process


def pytest_runtest_logreport(report):
    if report.failed:
        FAILED.add(Path(report.nodeid.split("::")[0]).stem.removeprefix("test_"))
    if report.when == "call" or report.outcome != "passed":  # a setup that failed
                                                             # is the test's failure
        crash = getattr(report.longrepr, "reprcrash", None)
        why = (crash.message if crash
               else str(report.longrepr or "").strip().splitlines()[-1:] or [""])
        note(test=report.nodeid, outcome=report.outcome,
             why=why if isinstance(why, str) else why[0])


def pytest_sessionfinish(session, exitstatus):
    note(finished=True)


TIMED_OUT = set()  # the files with a test that ran out of time: their other tests are not run


@pytest.fixture(autouse=True)
def time_limit(request):
    """SIGALRM where the platform has it (not on Windows, where the tests run unlimited). After one
    test of a problem runs out of time, the problem is lost: its other tests are not waited for."""
    file = request.node.path.stem
    if file in TIMED_OUT:
        pytest.skip(f"not run: another test of {file.removeprefix('test_')} ran past {TIMEOUT_S} s")
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        TIMED_OUT.add(file)
        raise TimeoutError(f"the test ran past {TIMEOUT_S} s: an endless loop, "
                           f"or far too much work")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def problems_pass():
    """The check together (its file runs last) is worth running once problems 1-4 pass."""
    failing = sorted(FAILED & {f"problem{p.number}" for p in PROBLEMS if p.functions})
    if failing:
        pytest.skip(f"{', '.join(failing)} do not pass yet")


@pytest.fixture(scope="session")
def ref():
    """The reference outputs course/make.py recorded from the living model.py (grade.py passes where
    they are for the repository itself, which has none of its own)."""
    path = Path(os.environ.get("COURSE_FIXTURES") or GRADER / FIXTURES)
    if not path.is_file():
        pytest.fail(f"no reference fixtures at {path}: grade with python course/grade.py, "
                    f"or ask for a fresh copy (python course/make.py)")
    return torch.load(path, weights_only=True)


@pytest.fixture(autouse=True)
def _float64():
    torch.manual_seed(0)
    with torch.no_grad():
        yield
