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
