"""The core and the lab: the README's first commands, run as a newcomer runs them, load a small
core and nothing of lab/ or course/ (counted from what the processes imported, not from the tops
of files); and the layers by construction: the core imports lab/ only inside the function that
serves the flag or file naming it, lab/ and course/ import the core, model.py imports torch
alone, and no module reaches back to itself."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, ROOT

pytestmark = pytest.mark.fast

CORE = sorted(p for p in ROOT.glob("*.py") if not p.name.startswith("test_")
              and p.name != "conftest.py")
LAB = sorted([*ROOT.glob("lab/**/*.py"), *ROOT.glob("course/*.py")])
BUDGET = {"train.py": 2000, "sample.py": 1000}  # nanoGPT's: 713 and 419


def loaded(*argv) -> dict:
    """{our file: its lines} of what `python SCRIPT ARGS` imported, run as a user runs it: a plain
    interpreter in the repository, its -X importtime report on stderr the only addition."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = {ROOT / argv[0]}
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = ROOT.joinpath(*line.rsplit("|", 1)[1].strip().split("."))
            files |= {f for f in (name.with_suffix(".py"), name / "__init__.py") if f.is_file()}
    return {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}


def test_the_readme_first_commands_load_a_small_core(tmp_path):
    """python train.py (a few steps, on a fresh data folder: Shakespeare prepared on first use)
    and python sample.py on its run. The README states these figures."""
    data, out = tmp_path / "data", tmp_path / "out"
    runs = {"train.py": loaded("train.py", "--max_iters=2", "--eval_interval=2", "--eval_seqs=4",
                               f"--data_root={data}", f"--out_dir={out}", "--sample_tokens=8"),
            "sample.py": loaded("sample.py", f"--init_from={out}", "--max_new_tokens=8")}
    for script, files in runs.items():
        print(f"python {script}: {len(files)} files, {sum(files.values())} lines: "
              + ", ".join(f"{f} {n}" for f, n in sorted(files.items(), key=lambda kv: -kv[1])))
        lab = [f for f in files if f.startswith(("lab/", "course/"))]
        assert not lab, f"python {script} loaded {lab}: the core's default paths never do"
        assert sum(files.values()) <= BUDGET[script], (script, files)


def imports(path: Path):
    """(module names imported at the top level, those imported anywhere) by a file."""
    tree, top, every = ast.parse(path.read_text()), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = {node.module}
        else:
            continue
        every |= names
        if node in tree.body:
            top |= names
    return top, every


def ours(name) -> str:
    """The file of ours a module name is (lab.hf -> lab/hf.py), or None."""
    path = ROOT.joinpath(*name.split("."))
    return next((f.relative_to(ROOT).as_posix() for f in (path.with_suffix(".py"),
                                                          path / "__init__.py") if f.is_file()),
                None)


def test_the_core_never_imports_the_lab_at_the_top_and_nothing_loops():
    graph = {}
    for path in CORE + LAB:
        top, every = imports(path)
        name = path.relative_to(ROOT).as_posix()
        graph[name] = {f for f in map(ours, every) if f and f != name}
        if path in CORE:
            lab = sorted(n for n in top if n.split(".")[0] in ("lab", "course"))
            assert not lab, f"{name} imports {lab} at its top: only where a flag names them"
    model_imports = {n.split(".")[0] for n in imports(ROOT / "model.py")[1]}
    assert model_imports <= {"math", "dataclasses", "typing", "torch"}, model_imports

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, (*seen, d))) for d in graph[a])
    loops = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not loops, f"import loops: {loops}"
