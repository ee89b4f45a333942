"""Ctrl-C and SIGTERM stop train.py cleanly: the step in flight finishes, a checkpoint of it is
written, the process exits 128 + the signal with one line saying how to continue, and continuing
gives the run that was never stopped; under torchrun a signal to one rank stops every rank at the
same step; and Ctrl-C while any script starts (torch's import takes seconds) is one line too."""
import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ENV, ROOT, TINY, max_diff, read_log, run

# long enough to be interrupted
RUN = [*TINY, "--max_iters=400", "--eval_interval=10", "--ckpt_interval=0"]
UNTIL = 40  # every run is compared up to this step


@pytest.fixture(scope="module")
def uninterrupted(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run("train.py", *RUN, "--micro_batch=4", "--batch_tokens=256", f"--data_root={data_root}",
        f"--out_dir={out}", f"--stop_at_step={UNTIL}")
    return read_log(out)


def interrupt(command, out_dir, signum, target=lambda proc: proc.pid):
    """Start command, send signum to target(proc) once two steps are logged; (returncode, stdout,
    stderr)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log, deadline = Path(out_dir) / "log.jsonl", time.monotonic() + 300  # a hang's bound
    while not (log.is_file() and log.read_text().count('"kind": "train"') >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no two steps logged"
        time.sleep(0.005)
    os.kill(target(proc), signum)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def stopped_step(out_dir):
    step = torch.load(Path(out_dir) / "ckpt.pt", weights_only=True)["step"]
    assert 2 <= step < UNTIL, f"the run stopped at step {step}, outside the compared range"
    # nothing after the checkpoint
    assert max(s for kind, s in read_log(out_dir) if kind == "train") == step
    return step


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_with_a_checkpoint_and_resuming_is_the_same_run(uninterrupted, data_root,
                                                                       tmp_path, signum):
    code, _, err = interrupt([sys.executable, "train.py", *RUN, "--micro_batch=4",
                              "--batch_tokens=256", f"--data_root={data_root}",
                              f"--out_dir={tmp_path}"], tmp_path, signum)
    step = stopped_step(tmp_path)
    assert code == 128 + signum, err
    assert err.strip().splitlines()[-1] == (f"stopped by {signal.Signals(signum).name} after step {step}, saved to "
                                            f"{tmp_path}/ckpt.pt; continue with the same command and --resume=True")
    assert "Traceback" not in err
    run("train.py", f"--out_dir={tmp_path}", "--resume=True", f"--stop_at_step={UNTIL}")
    diff = max_diff(read_log(tmp_path), uninterrupted)
    assert diff == 0, f"stopped by a signal and resumed, the losses differ by up to {diff:.3e}"


def rank_pid(launcher, rank):
    """The pid of torchrun's worker with RANK=rank (its environment says which)."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{launcher.pid}\n" in status.read_text() and \
                    f"RANK={rank}".encode() in (status.parent / "environ").read_bytes().split(b"\0"):
                return int(status.parent.name)
        except OSError:  # a process that ended meanwhile
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun")


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(uninterrupted, data_root, tmp_path):
    torchrun = (sys.executable, "-m", "torch.distributed.run")
    # 2 ranks x 2 micro-steps x 2 sequences, as one process
    two_ranks = ["--micro_batch=2", "--batch_tokens=256"]
    code, _, err = interrupt([*torchrun, "--standalone", "--nproc_per_node=2", "train.py", *RUN,
                              *two_ranks, f"--data_root={data_root}", f"--out_dir={tmp_path}"],
                             tmp_path, signal.SIGTERM, lambda p: rank_pid(p, 1))
    step = stopped_step(tmp_path)
    # rank 0 saved and said so
    assert code != 0 and f"stopped by SIGTERM after step {step}" in err, err
    run("--standalone", "--nproc_per_node=2", "train.py", f"--out_dir={tmp_path}", "--resume=True",
        f"--stop_at_step={UNTIL}", launcher=torchrun)
    diff = max_diff(read_log(tmp_path), uninterrupted)
    assert diff < 1e-5, f"two ranks, stopped and resumed, differ from one process by up to {diff:.3e}"


# ----------------------------------------------------------------------------- Ctrl-C at start-up

# Every file a user runs: those with a __main__ guard, at the root and a folder down (course/,
# experiments/), outside tests/ and hidden folders (a .venv's packages are not ours).
SCRIPTS = sorted(rel.as_posix() for p in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py")]
                 if (rel := p.relative_to(ROOT)).parts[0] != "tests"
                 and not rel.parts[0].startswith(".")
                 and 'if __name__ == "__main__":' in p.read_text())

# A sitecustomize for the started script: its first import of a package from outside the standard
# library and the repository (torch, numpy: seconds of import in real life) says so on stdout and
# waits there for the signal, so the test knows, without a guess at the time, that the Ctrl-C
# lands inside the script's imports.
PAUSE_AT_FIRST_IMPORT = f"""
import signal, sys
from importlib.machinery import PathFinder
from pathlib import Path

class Pause:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        ours = Path({str(ROOT)!r}, top).is_dir() or Path({str(ROOT)!r}, top + ".py").is_file()
        running = hasattr(sys.modules["__main__"], "__file__")  # not site's usercustomize
        # one that is there: copy.py asks for Jython's org.python.core
        if running and top not in sys.stdlib_module_names and not ours and \
                PathFinder.find_spec(name, path):
            print("importing", name, flush=True)
            signal.pause()

sys.meta_path.insert(0, Pause())
"""


def interrupt_at_import(script, tmp_path, rank="0"):
    """Start script as a user does (experiments/ as modules: python -m experiments.NAME), send
    Ctrl-C once it is inside its imports; (returncode, stderr)."""
    (tmp_path / "sitecustomize.py").write_text(PAUSE_AT_FIRST_IMPORT)
    command = ["-m", script[:-3].replace("/", ".")] if script.startswith("experiments/") \
        else [script]
    proc = subprocess.Popen([sys.executable, *command], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONPATH": str(tmp_path), "RANK": rank})
    line = proc.stdout.readline()  # blocks until the pause says where it is, or the end
    assert line.startswith("importing "), f"{script} never imported a package: {proc.communicate()}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize("script", SCRIPTS)
def test_ctrl_c_while_a_script_imports_is_one_line_and_130(script, tmp_path):
    """It was a traceback of the import in flight (45 lines inside torch) and death by SIGINT."""
    code, err = interrupt_at_import(script, tmp_path)
    assert (code, err.splitlines()) == (130, ["interrupted"]), (code, err[-3000:])


def test_ctrl_c_while_importing_is_said_by_rank_0_alone(tmp_path):
    """Under torchrun every rank gets the Ctrl-C of the terminal; one line, not one a rank."""
    assert interrupt_at_import("train.py", tmp_path, rank="1") == (130, "")


def first_import_outside_the_standard_library(path):
    """The first module, in the file's order, that the standard library does not hold."""
    imports = sorted((n for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno)
    names = [name for n in imports for name in
             ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or "."])]
    return next(n for n in names if n.partition(".")[0] not in sys.stdlib_module_names)


def test_every_script_first_imports_the_quiet_ctrl_c():
    """support.interrupt before anything that takes time to import, in every script a user runs:
    a new script without it fails here (and in the test above)."""
    assert {"train.py", "course/grade.py", "experiments/recall.py"} <= set(SCRIPTS), SCRIPTS
    firsts = {s: first_import_outside_the_standard_library(ROOT / s) for s in SCRIPTS}
    late = {s: first for s, first in firsts.items() if first != "support.interrupt"}
    assert not late, f"scripts whose first import outside the standard library is not " \
                     f"support.interrupt: {late}"
