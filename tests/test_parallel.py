"""--parallel=fsdp and --activation_checkpointing (parallel.py) change memory, never the run: FSDP on 2 gloo ranks
reproduces one process for every mode and baseline, a sharded checkpoint resumes exactly and reads back whole
(sample.py, the export), and activation checkpointing gives the same losses with less memory, measured."""
import json
import runpy
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp

from baselines import build_model, make_config
from conftest import tiny_config
import export
import sample
from support import checkpoint, hf, memory
from support.checkpoint import CheckpointError, load_model
from test_train import ENV, ROOT, TINY, max_diff, read_log, run

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
DRIVER = ROOT / "tests" / "parallel_driver.py"


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    """The driver's losses and grad norms for every case, one process and FSDP on 2 ranks."""
    out = tmp_path_factory.mktemp("driver")
    run(DRIVER, out / "single.json", "single")
    run(DRIVER, out / "fsdp.json", "fsdp", launcher=TORCHRUN)
    return json.loads((out / "single.json").read_text()), json.loads((out / "fsdp.json").read_text())


def test_fsdp_reproduces_one_process_in_every_mode(driven):
    single, fsdp = driven
    for case in single:
        diff = max(abs(a - b) for s, f in zip(single[case], fsdp[case]) for a, b in zip(s, f))
        assert diff < 1e-4, f"{case}: FSDP on 2 ranks and one process differ by {diff:.2e} (losses, grad norms)"


def test_activation_checkpointing_changes_no_loss(driven):
    single, _ = driven
    for case in ("value", "mhc"):
        diff = max(abs(a - b) for s, c in zip(single[case], single[f"{case}+ac"]) for a, b in zip(s, c))
        assert diff < 1e-5, f"{case}: activation checkpointing changed the losses by {diff:.2e}"


@pytest.mark.parametrize("residual", ["add", "mhc"])
def test_activation_checkpointing_lowers_the_peak_memory(residual):
    """The allocator's peak of a forward and backward at 2 x 1,024 tokens (torch.profiler's allocation records:
    exact on CPU, where the resident size also moves with what glibc keeps), with the units train.py recomputes."""
    torch.manual_seed(0)
    model = build_model(make_config(vocab_size=256, block_size=1024, n_layer=8, n_head=4, n_kv_head=2, head_dim=32,
                                    n_embd=128, mlp_hidden=384, residual=residual,
                                    depth_mode="value" if residual == "add" else "vanilla"))
    idx = torch.randint(0, 256, (2, 1024))
    peak = {ac: memory.measured_peak(model, idx, activation_checkpointing=ac) / 2**20 for ac in (False, True)}
    bound = 0.5 if residual == "add" else 0.8  # mHC keeps its streams' mixing (parallel.RECOMPUTED)
    assert peak[True] < bound * peak[False], \
        f"activation checkpointing: peak {peak[True]:.0f} MiB, without {peak[False]:.0f} MiB"


FSDP_RUN = [*TINY, "--micro_batch=2", "--batch_tokens=256", "--parallel=fsdp"]


@pytest.fixture(scope="module")
def fsdp_run(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run("train.py", *FSDP_RUN, f"--data_root={data_root}", f"--out_dir={out}", "--sample_tokens=8",
        launcher=TORCHRUN)
    return out


def test_fsdp_training_matches_one_process_and_resumes_exactly(fsdp_run, data_root, tmp_path):
    single = tmp_path / "single"
    run("train.py", *TINY, "--micro_batch=4", "--batch_tokens=256", f"--data_root={data_root}", f"--out_dir={single}")
    diff = max_diff(read_log(fsdp_run), read_log(single))
    assert diff < 1e-4, f"train.py --parallel=fsdp on 2 ranks and one process differ by up to {diff:.2e}"
    resumed = tmp_path / "resumed"
    run("train.py", *FSDP_RUN, f"--data_root={data_root}", f"--out_dir={resumed}", "--stop_at_step=6",
        launcher=TORCHRUN)
    assert (resumed / checkpoint.SHARDED / "run.pt").is_file() and not (resumed / "ckpt.pt").exists()
    run("train.py", f"--out_dir={resumed}", "--resume=True", launcher=TORCHRUN)  # the rest from the checkpoint
    diff = max_diff(read_log(resumed), read_log(fsdp_run))
    assert diff == 0, f"stopped and resumed under FSDP, the run differs from the uninterrupted one by {diff:.2e}"


def test_a_sharded_checkpoint_samples_and_exports(fsdp_run, tmp_path, capsys):
    loaded = load_model(fsdp_run)
    assert loaded.step == 16 and loaded.source.endswith(checkpoint.SHARDED)
    sample.main([f"--init_from={fsdp_run}", "--prompt=the cat", "--max_new_tokens=6", "--temperature=0"])
    text = capsys.readouterr().out.split("--- sample")[-1]
    export.main([str(fsdp_run), str(tmp_path / "hf")])
    again = hf.from_pretrained(tmp_path / "hf").state_dict()
    assert all((again[k] == v).all() for k, v in loaded.model.state_dict().items())
    sample.main([f"--init_from={tmp_path / 'hf'}", "--prompt=the cat", "--max_new_tokens=6", "--temperature=0"])
    assert capsys.readouterr().out.split("--- sample")[-1] == text


def test_a_damaged_sharded_checkpoint_is_one_error(fsdp_run, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(fsdp_run, broken)
    (broken / checkpoint.SHARDED / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="shards cannot be read"):
        load_model(broken)
    (broken / checkpoint.SHARDED / "run.pt").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_model(broken)


@pytest.mark.parametrize("args, message", [
    (["--parallel=fsdp"], "launch with `torchrun"),
    (["--parallel=zero3"], "--parallel must be one of ddp, fsdp"),
])
def test_bad_parallel_settings_fail_clearly(data_root, tmp_path, args, message, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", *TINY, f"--data_root={data_root}", f"--out_dir={tmp_path}", *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    assert str(e.value.code).startswith("error: ") and message in str(e.value.code)


def test_a_checkpoint_resumes_only_under_its_own_parallel_mode(fsdp_run, data_root, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(fsdp_run, copy)
    proc = subprocess.run([sys.executable, "train.py", f"--out_dir={copy}", "--resume=True", "--parallel=ddp",
                           "--max_iters=20"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "written with --parallel=fsdp" in proc.stderr.strip().splitlines()[-1]


def test_a_kill_during_a_sharded_save_keeps_the_previous_checkpoint(fsdp_run, tmp_path):
    """Killed between rank 0's two renames, the previous checkpoint is ckpt.dcp.old and the new one half written
    in ckpt.dcp.tmp: the next run into the folder restores the first and drops the second."""
    copy = tmp_path / "run"
    shutil.copytree(fsdp_run, copy)
    (copy / checkpoint.SHARDED).rename(copy / f"{checkpoint.SHARDED}.old")
    (copy / f"{checkpoint.SHARDED}.tmp").mkdir()
    checkpoint.claim_out_dir(copy, resuming=True, overwrite=False).close()
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith("ckpt")) == [checkpoint.SHARDED]
    assert load_model(copy).step == 16
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        checkpoint.claim_out_dir(copy, resuming=False, overwrite=False)
    checkpoint.claim_out_dir(copy, resuming=False, overwrite=True).close()
    assert not (copy / checkpoint.SHARDED).exists()


def test_fsdp_mixed_precision_trains_and_samples(data_root, tmp_path):
    """bf16 under FSDP (a GPU's default): float32 parameters compute in bf16, so the end-of-run sample's KV cache
    must be bf16 too (a float32 one stopped the run with a dtype error after its last checkpoint)."""
    proc = run("train.py", *TINY, "--micro_batch=2", "--batch_tokens=256", "--parallel=fsdp", "--dtype=bfloat16",
               "--max_iters=2", "--eval_interval=0", "--sample_tokens=5", f"--data_root={data_root}",
               f"--out_dir={tmp_path}", launcher=TORCHRUN)
    assert "cpu bf16" in proc.stdout and "sample (5 tokens)" in proc.stdout and "done: step 2" in proc.stdout


def test_shards_are_read_into_the_model_itself(tmp_path):
    """model_from_checkpoint reads ckpt.dcp straight into the model's parameters (state_dict's tensors are their
    storage): the weights are the saved ones, not the fresh model's, with no second copy made."""
    torch.manual_seed(0)
    saved = build_model(tiny_config(depth_mode="value"))
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1.0)  # away from what a fresh model with the same seed holds
    with pytest.warns(UserWarning, match="single process"):  # no process group here, as intended
        dcp.save({"model": saved.state_dict()}, checkpoint_id=tmp_path / "ckpt.dcp")
    torch.manual_seed(0)
    model = checkpoint.model_from_checkpoint({"model_config": asdict(saved.config), "shards": tmp_path / "ckpt.dcp"})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
