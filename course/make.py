"""
Write the student copy of this repository for the course assignment (the handout: course/README.md).

    python course/make.py ../student              # hand it out (never a folder inside this repo)
    python course/make.py ../student --overwrite  # replace an earlier student copy, whole
    python course/make.py ../student --untracked  # also copy the files git does not track

The functions course/problems.py names get the body `raise NotImplementedError("Problem N: ...")`,
their signatures and docstrings kept. What would show a solution stays out: the loop reference
(tests/reference.py), the tests that check the method (test_model.py, tests/), the docs that print
its code, the instructor's answers (course/answers.md). The graded tests' fixtures are recorded from
this repository's model.py as it is now, so they match it. Only the files git tracks are copied
(an untracked scratch file is listed and refused unless --untracked), and the copy's stamp says
whether the tree was dirty.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository: the core
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import ast
import os
import shutil
import subprocess
import time

from configurator import Key, UserError, parse, run_main
from course.problems import FIXTURES, MARKER, PROBLEMS
from outputs import claim, clean_stale, manifest, mark, seal

# Left out of the copy: the loop references and the tests that check the method against them, CI,
# this script and the answers. The pages that print the method's code become a one-line page.
LEFT_OUT = ("test_model.py", "conftest.py", "tests/", ".ci/", "course/make.py", "course/answers.md",
            "course/fixtures/")
WITHHELD_PAGES = ("docs/cost.md", "docs/forking.md", "docs/tests.md")


def replace_bodies(source: str, bodies: dict) -> str:
    """source with the body of each function in bodies ({qualified name: code}) replaced by the code
    (unindented; indented here): the decorators, the signature and the docstring stay."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if isinstance(child, ast.FunctionDef) and name in bodies:
                    found[name] = child
                visit(child, name + ".")
    visit(ast.parse(source), "")
    if set(bodies) - set(found):
        raise ValueError(f"no function {', '.join(sorted(set(bodies) - set(found)))} in the code")
    lines = source.splitlines(keepends=True)
    for name, fn in sorted(found.items(), key=lambda item: -item[1].lineno):
        first = fn.body[0]
        documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str)
        start = first.end_lineno if documented else first.lineno - 1  # comments after it go too
        indent = " " * first.col_offset
        code = bodies[name].strip("\n").splitlines()
        lines[start:fn.end_lineno] = [(indent + line).rstrip() + "\n" for line in code]
    return "".join(lines)


def stubs() -> dict:
    """{file: {qualified name: the body that raises NotImplementedError}} from the problems."""
    out = {}
    for p in PROBLEMS:
        for function in p.functions:
            file, name = function.split(":")
            message = f"Problem {p.number}: write {name} (course/README.md)"
            out.setdefault(file, {})[name] = f"raise NotImplementedError({message!r})"
    return out


def git_files(*flags) -> list:
    """git ls-files with flags, less what the copy leaves out; a tree without git is refused."""
    try:
        out = subprocess.run(["git", "ls-files", *flags, "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        raise UserError(f"{ROOT} is not a git checkout: the copy holds the files git tracks; "
                        f"run make.py in a clone") from None
    return sorted(f for f in out.split("\0") if f and not f.startswith(LEFT_OUT))


def untracked_files() -> list:
    """The files git neither tracks nor ignores, that a copy would leave out."""
    return git_files("-o", "--exclude-standard")


def check_destination(out: Path, overwrite: bool):
    """Refuse a destination inside this repository (or holding it), and what outputs.claim
    refuses (the current folder or one above it, a file, a folder of other work); an earlier copy
    needs --overwrite and must hold nothing the copy did not write."""
    where = out.resolve()
    if where == ROOT or ROOT in where.parents or where in ROOT.parents:
        raise UserError(f"{out} is, holds or lies inside this repository ({ROOT}); give a folder "
                        f"outside it, e.g. {ROOT.parent / 'student'}")
    # a copy a killed run moved aside is back in place before the next check
    clean_stale(where, hidden=True, restorable=lambda old: manifest(old).get("written_by")
                == mark("course/make.py"))
    folder = claim(out, "course/make.py", "OUT_DIR")
    if folder.names and not overwrite:
        raise UserError(f"{out} holds an earlier student copy; pass --overwrite to replace it "
                        f"whole")
    folder.refuse_foreign()  # a student's own files: named, never replaced with the copy


def write_copy(tmp: Path, untracked: bool) -> int:
    """The student copy in tmp; returns the number of files."""
    blanked = stubs()
    files = [f for f in git_files("-c", *(["-o", "--exclude-standard"] if untracked else []))
             if (ROOT / f).is_file()]  # a deleted file git still tracks is not copied
    for f in files:
        (tmp / f).parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / f).read_text() if f in blanked or f in WITHHELD_PAGES else None
        if f in blanked:
            (tmp / f).write_text(replace_bodies(text, blanked[f]))
        elif f in WITHHELD_PAGES:
            (tmp / f).write_text(f"# {text.splitlines()[0].lstrip('# ')}\n\n"
                                 f"Left out of the student copy: "
                                 f"this page shows the method's code. See course/README.md.\n")
        else:
            shutil.copy2(ROOT / f, tmp / f)
    (tmp / "pytest.ini").write_text("[pytest]\n# The assignment has no pytest tests: "
                                    "python course/grade.py grades it, test by test.\n"
                                    "testpaths = course\n")
    readme = (tmp / "README.md").read_text()
    (tmp / "README.md").write_text("> **Student copy for the course assignment**: start with "
                                   "[course/README.md](course/README.md).\n\n" + readme)
    (tmp / FIXTURES).parent.mkdir(parents=True, exist_ok=True)
    import torch
    torch.save(recorded(), tmp / FIXTURES)
    (tmp / MARKER).write_text(f"A student copy made by course/make.py on "
                              f"{time.strftime('%Y-%m-%d')} from {commit(untracked)}.\n")
    seal(tmp, "course/make.py")
    return len(files) + 2


def recorded() -> dict:
    """The practice fixtures from this repository's model.py, or one line saying why not."""
    try:
        import model
        from course import fixtures
        return fixtures.record(model)
    except Exception as e:  # model.py broken or changed under the scenarios
        raise UserError(f"cannot record the fixtures from {ROOT / 'model.py'} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e).strip() else ''}); make the tree's "
                        f"model.py complete and its tests pass (python -m pytest -q "
                        f"test_model.py), then rerun")


def commit(untracked=False) -> str:
    """Where the copy comes from: the commit, marked dirty for changed or untracked files."""
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    if untracked and untracked_files() and not out.endswith("-dirty"):
        out += "-dirty"
    return f"commit {out}" + (" (a dirty tree: uncommitted changes copied)"
                              if out.endswith("-dirty") else "")


KEYS = {"out_dir": Key(None, "a new or empty folder outside this repository", kind=str, path=True,
                      positional=True),
        "overwrite": Key(False, "replace an earlier student copy there, whole"),
        "untracked": Key(False, "also copy the files git does not track (refused without it)")}


def main(argv):
    args = parse(argv, KEYS, __doc__)
    out = Path(args["out_dir"])
    check_destination(out, args["overwrite"])
    extra = untracked_files()
    if extra and not args["untracked"]:
        raise UserError(f"{len(extra)} file(s) git does not track would be left out of the copy "
                        f"({', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}): commit or "
                        f"remove them, or pass --untracked to copy them too")
    out = out.resolve()
    tmp, old = (out.with_name(f".{out.name}.tmp{os.getpid()}"),
                out.with_name(f".{out.name}.old{os.getpid()}"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        n = write_copy(tmp, args["untracked"])
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror or e}); pick a folder you can write to")
    except ValueError as e:  # a function the problems name that the code no longer has
        raise UserError(f"course/problems.py names {e}: update its list to the code's names")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():  # stopped between the two renames: the old copy stays
            os.replace(old, out)
        shutil.rmtree(old, ignore_errors=True)
    n_stubs = sum(len(p.functions) for p in PROBLEMS)
    print(f"wrote the student copy {args['out_dir']}: {n} files, {n_stubs} functions to write over "
          f"{sum(1 for p in PROBLEMS if p.functions)} problems. Hand it out; students start with "
          f"course/README.md and grade with python course/grade.py")


if __name__ == "__main__":
    sys.exit(run_main(main))
