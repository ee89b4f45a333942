"""--parallel=fsdp and --activation_checkpointing (support/parallel.py) change memory, never the
run: FSDP on 2 gloo ranks reproduces one process's losses, grad norms and gradients for every mode
and baseline, with no false alarm from FSDP on the screen, and activation checkpointing gives the
same losses with less memory, measured. The sharded checkpoint an FSDP run writes is
tests/test_sharded.py's."""
import json
import runpy
import sys

import pytest
import torch

from support.variants import build_model, make_config
from support import memory
from helpers import ROOT, TINY, run

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
DRIVER = ROOT / "tests" / "parallel_driver.py"


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    """The driver's record of every case, one process and FSDP on 2 ranks, and FSDP's stderr."""
    out = tmp_path_factory.mktemp("driver")
    run(DRIVER, out / "single.json", "single")
    proc = run(DRIVER, out / "fsdp.json", "fsdp", launcher=TORCHRUN)
    return (json.loads((out / "single.json").read_text()),
            json.loads((out / "fsdp.json").read_text()), proc.stderr)


def test_fsdp_reproduces_one_process_in_every_mode(driven):
    single, fsdp, _ = driven
    for case in single:
        steps = zip(single[case]["steps"], fsdp[case]["steps"])
        diff = max(abs(a - b) for s, f in steps for a, b in zip(s, f))
        assert diff < 1e-4, f"{case}: FSDP on 2 ranks and one process differ by {diff:.2e} (losses, grad norms)"


def test_fsdp_gives_one_process_gradients_without_a_false_alarm(driven):
    """FSDP2 warns when a wrapped module returns a view: a block's record, its K and V for later
    layers' depth steps, is one. Nothing writes into a record in place, so its pre-backward hook
    stays: the gradients of every parameter equal one process's, and the warning is kept off the
    screen."""
    single, fsdp, stderr = driven
    for case in single:
        for name, grad in single[case]["grads"].items():
            diff = (torch.tensor(grad) - torch.tensor(fsdp[case]["grads"][name])).abs().max().item()
            assert diff < 1e-6, f"{case}: the gradient of {name} differs under FSDP by {diff:.2e}"
    assert "returned a view tensor" not in stderr and "Warning" not in stderr, stderr[-2000:]


def test_activation_checkpointing_changes_no_loss(driven):
    single, _, _ = driven
    for case in ("value", "mhc"):
        steps = zip(single[case]["steps"], single[f"{case}+ac"]["steps"])
        diff = max(abs(a - b) for s, c in steps for a, b in zip(s, c))
        assert diff < 1e-5, f"{case}: activation checkpointing changed the losses by {diff:.2e}"


@pytest.mark.parametrize("residual", ["add", "mhc"])
def test_activation_checkpointing_lowers_the_peak_memory(residual):
    """The allocator's peak of a forward and backward at 2 x 1,024 tokens (torch.profiler's
    allocation records: exact on CPU, where the resident size also moves with what glibc keeps),
    with the units train.py recomputes."""
    torch.manual_seed(0)
    model = build_model(make_config(vocab_size=256, block_size=1024, n_layer=8, n_head=4,
                                    n_kv_head=2, head_dim=32, n_embd=128, mlp_hidden=384,
                                    residual=residual,
                                    depth_mode="value" if residual == "add" else "vanilla"))
    idx = torch.randint(0, 256, (2, 1024))
    peak = {ac: memory.measured_peak(model, idx, activation_checkpointing=ac) / 2**20
            for ac in (False, True)}
    bound = 0.5 if residual == "add" else 0.8  # mHC keeps its streams' mixing (baselines.MHC.recomputed)
    assert peak[True] < bound * peak[False], \
        f"activation checkpointing: peak {peak[True]:.0f} MiB, without {peak[False]:.0f} MiB"


@pytest.mark.parametrize("args, message", [
    (["--parallel=fsdp"], "launch with `torchrun"),
    (["--parallel=zero3"], "--parallel=zero3 is not a choice; choices: ddp, fsdp"),
])
def test_bad_parallel_settings_fail_clearly(data_root, tmp_path, args, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py", *TINY, f"--data_root={data_root}",
                                      f"--out_dir={tmp_path}", *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and message in err, err


def test_fsdp_mixed_precision_trains_and_samples(data_root, tmp_path):
    """bf16 under FSDP (a GPU's default): float32 parameters compute in bf16, so the end-of-run
    sample's KV cache must be bf16 too (a float32 one stopped the run with a dtype error after its
    last checkpoint)."""
    proc = run("train.py", *TINY, "--micro_batch=2", "--batch_tokens=256", "--parallel=fsdp",
               "--dtype=bfloat16", "--max_iters=2", "--eval_interval=0", "--sample_tokens=5",
               f"--data_root={data_root}", f"--out_dir={tmp_path}", launcher=TORCHRUN)
    assert "cpu bf16" in proc.stdout and "sample (5 tokens)" in proc.stdout and "done: step 2" in proc.stdout
