"""The repository's shape: the root holds the design card's files and the rest is the package
support/; the import graph is layered (no cycle, model.py imports nothing of the repository, not
even inside a function, baselines.py only model.py, the package only those two and its own modules
below each, nothing a script); course/ stands on the model and the package, and nothing but its own
tests stands on it."""
import ast

from helpers import ROOT

# The root holds the design card's files, the paper's comparisons and the commands a user runs; the
# rest is the package support/, which the scripts import and nobody runs.
CARD = {"model", "baselines", "train", "sample", "prepare_data", "bench_cache", "eval", "ablate",
        "export"}
ROOT_MODULES = {p.stem: p for p in ROOT.glob("*.py") if not p.stem.startswith("test_")
                and p.stem != "conftest"}
PACKAGE = {f"support.{p.stem}": p for p in (ROOT / "support").glob("*.py") if p.stem != "__init__"}
MODULES = {**ROOT_MODULES, **PACKAGE}
SCRIPTS = CARD - {"model", "baselines"}
# The course's own tests import course/ anywhere; helpers.py only inside its grading functions, so
# that every other test file imports helpers.py without course/.
COURSE_TESTS = {"test_course.py", "test_course_trust.py"}


def imports(path):
    """The repository modules a file imports anywhere: at the top, inside functions, in `if` blocks;
    a module of the package as support.NAME."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if node.module == "support":
                found |= {f"support.{a.name}" for a in node.names}
    return {m if m.startswith("support.") else m.split(".")[0] for m in found} & MODULES.keys() - {
        f"support.{path.stem}" if path.parent.name == "support" else path.stem}


def test_the_root_is_the_design_card_and_the_rest_is_the_package():
    assert set(ROOT_MODULES) == CARD, f"the root's modules: {sorted(ROOT_MODULES)}"
    # copied into exports, not imported
    assert not (ROOT / "support" / "hf_remote" / "__init__.py").exists()


def test_the_import_graph_is_layered():
    graph = {name: imports(path) for name, path in MODULES.items()}
    assert graph["model"] == set(), f"model.py imports {graph['model']}"
    assert graph["baselines"] == {"model"}, f"baselines.py imports {graph['baselines']}"
    package_doc = ast.get_docstring(ast.parse((ROOT / "support" / "__init__.py").read_text()))
    order = package_doc.split("\n\n")[-1].split()
    assert sorted(order) == sorted(m.removeprefix("support.") for m in PACKAGE), order
    for name in PACKAGE:  # on model.py, baselines.py and the package's modules listed before it
        below = {"model", "baselines"} | {f"support.{m}" for m in order[:order.index(name[8:])]}
        assert graph[name] <= below, f"{name} imports {sorted(graph[name] - below)}"

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, (*seen, d))) for d in graph[a])
    cycles = sorted(name for name in graph if reaches(name, name))
    assert not cycles, (f"modules on an import cycle: {cycles} "
                        f"({ {n: sorted(graph[n]) for n in cycles} })")
    assert not {name for name, deps in graph.items() if deps & SCRIPTS}, "a module imports a script"


def test_the_experiments_stand_on_the_model_and_the_package_and_nothing_stands_on_them():
    """experiments/ (studies behind docs/results.md, run as `python -m experiments.NAME`) read
    model.py, baselines.py and support/, never a script, and nothing of the repository imports
    them but their own tests."""
    studies = sorted((ROOT / "experiments").glob("*.py"))
    assert studies
    for path in studies:
        found = {m for m in imports(path) if m in SCRIPTS}
        assert not found, f"{path.relative_to(ROOT)} imports the scripts {sorted(found)}"
    for path in [*ROOT.glob("*.py"), *(ROOT / "support").rglob("*.py"),
                 *(ROOT / "course").glob("*.py")]:
        tree = ast.parse(path.read_text())
        users = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and (n.module or "").split(".")[0] == "experiments"]
        users += [n for n in ast.walk(tree) if isinstance(n, ast.Import)
                  and any(a.name.split(".")[0] == "experiments" for a in n.names)]
        assert not users, f"{path.relative_to(ROOT)} imports experiments/"


def test_the_course_stands_on_the_model_and_the_package_and_nothing_stands_on_it():
    """course/ (the assignment) reads model.py, baselines.py and support/, never a script; only its
    own tests (tests/test_course.py, tests/test_course_trust.py) import it, and tests/helpers.py
    only inside a function, so the repository and its other tests run without it."""
    for path in (ROOT / "course").rglob("*.py"):
        found = {m for m in imports(path) if m in SCRIPTS}
        assert not found, f"{path.relative_to(ROOT)} imports the scripts {sorted(found)}"
    for path in [*ROOT.glob("*.py"), *(ROOT / "support").rglob("*.py"),
                 *(ROOT / "tests").glob("*.py")]:
        if path.parent.name == "tests" and path.name in COURSE_TESTS:
            continue
        tree = ast.parse(path.read_text())
        users = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 and any(name.split(".")[0] == "course" for name in
                         ([a.name for a in n.names] if isinstance(n, ast.Import)
                          else [n.module or ""]))]
        if path == ROOT / "tests" / "helpers.py":
            functions = [f for f in ast.walk(tree)
                         if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            in_functions = {id(n) for f in functions for n in ast.walk(f)}
            users = [n for n in users if id(n) not in in_functions]
        assert not users, f"{path.relative_to(ROOT)} imports course (line {users[0].lineno})"


# The reading path: the lines of the repository's own files a default command imports (statically,
# at module level, following each import into the repository), at most these. What a default run
# does not use is imported where it is used, so these stay small as features come.
READING_BUDGET = {"train.py": 3100, "sample.py": 1500}


def reading_path(script) -> dict:
    """{file: lines} of every repository file `python script` imports at module level (a top-level
    import, or one in a top-level if/try), following each such import into the repository."""
    def module_file(name):  # a module, or a package's __init__.py (imported with any of its own)
        path = ROOT / name.replace(".", "/")
        return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()),
                    None)

    def top_level(body):
        for node in body:
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                yield from top_level(node.body + node.orelse + getattr(node, "finalbody", [])
                                     + [n for h in getattr(node, "handlers", []) for n in h.body])

    seen, todo = {}, [ROOT / script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = len(path.read_text().splitlines())
        for name in top_level(ast.parse(path.read_text()).body):
            parts = name.split(".")
            todo += [p for i in range(1, len(parts) + 1) if (p := module_file(".".join(parts[:i])))]
    return {p.relative_to(ROOT).as_posix(): n for p, n in seen.items()}


def test_the_reading_path_fits_its_budget_and_the_readme_states_it():
    """The README's numbers are the measured ones, and each is within its budget."""
    readme = " ".join((ROOT / "README.md").read_text().split())  # a sentence across lines
    for script, budget in READING_BUDGET.items():
        files = reading_path(script)
        lines = sum(files.values())
        assert lines <= budget, (f"python {script} imports {lines} lines of our code (budget "
                                 f"{budget}): {sorted(files.items(), key=lambda f: -f[1])}")
        stated = f"`python {script}` imports {len(files)} of our files, {lines:,} lines"
        assert stated in readme, f"README.md should say: {stated}"


def test_the_reading_path_follows_imports_at_module_level_only(tmp_path, monkeypatch):
    """An import inside a function is not on the path; one in a top-level try is."""
    (tmp_path / "p").mkdir()
    for name, text in {"a.py": "import b\ntry:\n    import c\nexcept ImportError:\n    pass\n"
                                "def f():\n    import d\n",
                       "b.py": "x = 1\n", "c.py": "from p import q\n", "d.py": "y = 2\n",
                       "p/__init__.py": "", "p/q.py": "z = 3\n"}.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert reading_path("a.py") == {"a.py": 7, "b.py": 1, "c.py": 1, "p/__init__.py": 0,
                                    "p/q.py": 1}


def imported_test_modules(path) -> list:
    """The test modules (a file name starting with test_) a file imports anywhere, with the line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.level or node.module == "tests":  # from tests import test_x, from . import ...
                names += [a.name for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names
                  if any(part.startswith("test_") for part in name.split("."))]
    return found


def test_no_test_module_imports_another():
    """Test files share tests/helpers.py and the naive reference, tests/reference.py, never one
    another: what is shared lives in a module that is no test file, so each test file can be read,
    run and changed alone. (tests/test_contract.py loads the test files that register a model's
    reference in reference.MODEL_REFERENCES, by importlib, for that registration alone; it imports
    none of their names.)"""
    files = [ROOT / "test_model.py", *sorted((ROOT / "tests").glob("test_*.py")),
             ROOT / "tests" / "parallel_driver.py"]
    offenders = {path.relative_to(ROOT).as_posix(): found for path in files
                 if (found := imported_test_modules(path))}
    assert not offenders, f"test modules importing test modules (name, line): {offenders}"
