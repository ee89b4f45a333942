"""Ctrl-C and SIGTERM stop train.py cleanly: the step in flight finishes, a checkpoint of it is
written, the process exits 128 + the signal with one line saying how to continue, and continuing
gives the run that was never stopped; under torchrun a signal to one rank stops every rank at the
same step."""
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
    log, deadline = Path(out_dir) / "log.jsonl", time.time() + 120
    while not (log.is_file() and log.read_text().count('"kind": "train"') >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
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
