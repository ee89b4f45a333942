"""An FSDP run's sharded checkpoint (ckpt.dcp) keeps ckpt.pt's promises: it resumes exactly and
reads back whole (sample.py, eval.py, export.py); every one of its files is checked on every read
against the sizes and digests run.pt recorded, so a flipped bit, a truncated, missing, swapped or
foreign file stops the read in one line naming it (resume included, on every rank); a write that
fails or a rank that dies mid-write is one true line, the previous checkpoint kept; and no export
lands inside a run."""
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp

import export
import sample
from conftest import tiny_config
from support.variants import build_model
from support import checkpoint, hf, run_dir, sharded
from support.checkpoint import CheckpointError, load_model
from support.errors import USER_ERRORS
from helpers import ENV, FSDP_RUN, ROOT, TINY, TORCHRUN, max_diff, read_log, run

SHARDS = ("__0_0.distcp", "__1_0.distcp", ".metadata")


@pytest.fixture(scope="module")
def fsdp_run(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run("train.py", *FSDP_RUN, f"--data_root={data_root}", f"--out_dir={out}", "--sample_tokens=8",
        launcher=TORCHRUN)
    return out


def copy_of(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def one_line(proc):
    """The error line of a failed command, checked to be its only one, with no traceback of ours
    (torchrun itself reports a failed worker with a traceback of the launcher's, ChildFailedError:
    cut off)."""
    text = proc.stdout + proc.stderr
    if "ChildFailedError" in text:
        text = text[:text.rindex("Traceback", 0, text.index("ChildFailedError"))]
    assert proc.returncode != 0 and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


def test_fsdp_training_matches_one_process_and_resumes_exactly(fsdp_run, data_root, tmp_path):
    single = tmp_path / "single"
    run("train.py", *TINY, "--micro_batch=4", "--batch_tokens=256", f"--data_root={data_root}",
        f"--out_dir={single}")
    diff = max_diff(read_log(fsdp_run), read_log(single))
    assert diff < 1e-4, f"train.py --parallel=fsdp on 2 ranks and one process differ by up to {diff:.2e}"
    resumed = tmp_path / "resumed"
    run("train.py", *FSDP_RUN, f"--data_root={data_root}", f"--out_dir={resumed}",
        "--stop_at_step=6", launcher=TORCHRUN)
    assert (resumed / checkpoint.SHARDED / "run.pt").is_file() and not (resumed / "ckpt.pt").exists()
    # the rest from the checkpoint
    run("train.py", f"--out_dir={resumed}", "--resume=True", launcher=TORCHRUN)
    diff = max_diff(read_log(resumed), read_log(fsdp_run))
    assert diff == 0, f"stopped and resumed under FSDP, the run differs from the uninterrupted one by {diff:.2e}"


def test_a_sharded_checkpoint_records_every_file_and_samples_and_exports(fsdp_run, tmp_path,
                                                                         capsys):
    files = torch.load(fsdp_run / checkpoint.SHARDED / "run.pt", weights_only=True)["files"]
    assert sorted(files) == sorted(SHARDS)
    assert all(files[n]["bytes"] == (fsdp_run / checkpoint.SHARDED / n).stat().st_size
               for n in files)
    loaded = load_model(fsdp_run)
    assert loaded.step == 16 and loaded.source.endswith(checkpoint.SHARDED)
    sample.main([f"--init_from={fsdp_run}", "--prompt=the cat", "--max_new_tokens=6",
                 "--temperature=0"])
    text = capsys.readouterr().out.split("--- sample")[-1]
    export.main([str(fsdp_run), str(tmp_path / "hf")])
    again = hf.from_pretrained(tmp_path / "hf").state_dict()
    assert all((again[k] == v).all() for k, v in loaded.model.state_dict().items())
    sample.main([f"--init_from={tmp_path / 'hf'}", "--prompt=the cat", "--max_new_tokens=6",
                 "--temperature=0"])
    assert capsys.readouterr().out.split("--- sample")[-1] == text


def damage(folder, name, how):
    path = folder / name
    data = path.read_bytes()
    if how == "flipped bit":
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    elif how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "removed":
        path.unlink()
    elif how == "grown":
        path.write_bytes(data + b"\0")
    elif how == "swapped":
        other = folder / ("__1_0.distcp" if name != "__1_0.distcp" else "__0_0.distcp")
        path.write_bytes(other.read_bytes())
        other.write_bytes(data)


@pytest.mark.parametrize("name", SHARDS)
@pytest.mark.parametrize("how", ["flipped bit", "truncated", "removed", "grown", "swapped"])
def test_every_damaged_file_is_named_on_read(how, name, fsdp_run, tmp_path, capsys):
    """Before the file checks, a flipped bit in the head's weights sampled 'AAAAAAAAAA' and exited
    0."""
    folder = copy_of(fsdp_run, tmp_path) / checkpoint.SHARDED
    damage(folder, name, how)
    with pytest.raises(CheckpointError, match=f"{folder} is damaged: .*{name}"):
        load_model(folder.parent)
    with pytest.raises(USER_ERRORS) as stop:
        sample.main([f"--init_from={folder.parent}", "--max_new_tokens=4", "--temperature=0"])
    assert name in str(stop.value)
    assert "--- sample" not in capsys.readouterr().out


@pytest.mark.parametrize("damaged", ["a flipped bit in the optimizer's shard", "no .metadata"])
def test_a_damaged_checkpoint_stops_the_resume_in_one_line(damaged, fsdp_run, tmp_path):
    """Every rank checks its share of the files and hears the others' findings: rank 0 names the
    file, the others stop without repeating it (it was five tracebacks for a folder without
    .metadata)."""
    folder = copy_of(fsdp_run, tmp_path)
    name = "__1_0.distcp" if damaged.startswith("a flipped") else ".metadata"
    damage(folder / checkpoint.SHARDED, name,
           "flipped bit" if damaged.startswith("a flipped") else "removed")
    proc = run("train.py", f"--out_dir={folder}", "--resume=True", "--max_iters=20",
               launcher=TORCHRUN, check=False)
    assert f"{checkpoint.SHARDED} is damaged: {name}" in one_line(proc)


def test_a_failed_sharded_write_is_one_line_and_keeps_the_previous_checkpoint(fsdp_run, tmp_path):
    """A file where the write goes (as a disk full or a folder made read-only would stop it): the
    exception torch.distributed.checkpoint raises on every rank, which the run used to print as
    tracebacks."""
    folder = copy_of(fsdp_run, tmp_path)
    (folder / f"{checkpoint.SHARDED}.tmp").write_text("in the way")
    before = {p.name: p.read_bytes() for p in (folder / checkpoint.SHARDED).iterdir()}
    proc = run("train.py", f"--out_dir={folder}", "--resume=True", "--max_iters=20",
               launcher=TORCHRUN, check=False)
    line = one_line(proc)
    assert f"could not write {folder / checkpoint.SHARDED} at step 20" in line
    assert "the checkpoint of step 16 is kept" in line
    assert {p.name: p.read_bytes() for p in (folder / checkpoint.SHARDED).iterdir()} == before


KILLED_RANK = """
import os, runpy, sys
sys.path.insert(0, os.getcwd())  # the repository, where torchrun starts it
import support.sharded as sharded
digest_files = sharded.digest_files
def dying(folder, names):  # rank 1 dies as kill -9 would leave it, its shard written, unhashed
    if os.environ["RANK"] == "1":
        os._exit(9)
    return digest_files(folder, names)
sharded.digest_files = dying
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_rank_killed_during_the_first_sharded_write_is_told_as_it_is(data_root, tmp_path):
    """Rank 0 used to say 'the previous checkpoint is kept: free space' (there was none, the disk
    was fine), and the resume then looked for ckpt.pt."""
    out = tmp_path / "run"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RANK)
    proc = run(script, *FSDP_RUN, f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=4",
               "--ckpt_interval=0", launcher=TORCHRUN, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "a rank stopped while" in text and "no checkpoint was written: rerun" in text
    assert "free space" not in text and "is kept" not in text
    proc = run("train.py", f"--out_dir={out}", "--resume=True", check=False)
    line = one_line(proc)
    assert f"{out / 'ckpt.pt'} or {out / checkpoint.SHARDED}" in line and "ckpt.dcp.tmp" in line


def test_a_checkpoint_resumes_only_under_its_own_parallel_mode(fsdp_run, data_root, tmp_path):
    copy = copy_of(fsdp_run, tmp_path)
    proc = subprocess.run([sys.executable, "train.py", f"--out_dir={copy}", "--resume=True",
                           "--parallel=ddp", "--max_iters=20"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "written with --parallel=fsdp" in proc.stderr.strip().splitlines()[-1]


def test_a_kill_during_a_sharded_save_keeps_the_previous_checkpoint(fsdp_run, tmp_path):
    """Killed between rank 0's two renames, the previous checkpoint is ckpt.dcp.old and the new one
    half written in ckpt.dcp.tmp: the next run into the folder restores the first and drops the
    second."""
    copy = copy_of(fsdp_run, tmp_path)
    (copy / checkpoint.SHARDED).rename(copy / f"{checkpoint.SHARDED}.old")
    (copy / f"{checkpoint.SHARDED}.tmp").mkdir()
    run_dir.claim_out_dir(copy, resuming=True, overwrite=False).close()
    assert sorted(p.name for p in copy.iterdir()
                  if p.name.startswith("ckpt")) == [checkpoint.SHARDED]
    assert load_model(copy).step == 16
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        run_dir.claim_out_dir(copy, resuming=False, overwrite=False)
    run_dir.claim_out_dir(copy, resuming=False, overwrite=True).close()
    assert not (copy / checkpoint.SHARDED).exists()


@pytest.mark.parametrize("where", ["the checkpoint", "inside the checkpoint",
                                   "the folder holding the run", "another run's checkpoint"])
def test_no_export_lands_in_a_run(where, fsdp_run, tmp_path):
    """`export.py RUN RUN/ckpt.dcp --overwrite` exited 0 and replaced the FSDP checkpoint with an
    export."""
    src = copy_of(fsdp_run, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(fsdp_run, other)
    dest = {"the checkpoint": src / checkpoint.SHARDED,
            "inside the checkpoint": src / checkpoint.SHARDED / "hf",
            "the folder holding the run": tmp_path,
            "another run's checkpoint": other / checkpoint.SHARDED}[where]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(USER_ERRORS) as stop:
        export.main([str(src), str(dest), "--overwrite"])
    assert "which this command reads" in str(stop.value) or "sharded checkpoint" in str(stop.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_checkpoint_without_file_checksums_still_loads(fsdp_run, tmp_path, capsys):
    """One written before the file checksums: read unverified, with a warning, as an old ckpt.pt
    is."""
    folder = copy_of(fsdp_run, tmp_path) / checkpoint.SHARDED
    ckpt = checkpoint.read_checkpoint(folder)
    run_dir.save_checkpoint({k: v for k, v in ckpt.items() if k not in ("files", "shards")},
                               folder / "run.pt")
    assert torch.equal(load_model(folder.parent).model.lm_head.weight,
                       load_model(fsdp_run).model.lm_head.weight)
    assert "has no file checksums" in capsys.readouterr().err


def test_shards_are_read_into_the_model_itself(tmp_path, monkeypatch):
    """model_from_checkpoint reads ckpt.dcp straight into the model's parameters (state_dict's
    tensors are their storage): the weights are the saved ones, not the fresh model's, with no
    second copy made (the parameters' storage is the one the model was built with)."""
    built, build = [], checkpoint.build_model

    def recording(config):  # where the model's parameters live when it is built
        model = build(config)
        built.append([p.data_ptr() for p in model.parameters()])
        return model
    monkeypatch.setattr(checkpoint, "build_model", recording)
    torch.manual_seed(0)
    saved = build_model(tiny_config(depth_mode="value"))
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1.0)  # away from what a fresh model with the same seed holds
    with pytest.warns(UserWarning, match="single process"):  # no process group here, as intended
        dcp.save({"model": saved.state_dict()}, checkpoint_id=tmp_path / "ckpt.dcp")
    files = sharded.digest_files(tmp_path / "ckpt.dcp", os.listdir(tmp_path / "ckpt.dcp"))
    torch.manual_seed(0)
    model = checkpoint.model_from_checkpoint({"model_config": asdict(saved.config),
                                              "shards": tmp_path / "ckpt.dcp", "files": files})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 saved.state_dict().values()))
    assert built == [[p.data_ptr() for p in model.parameters()]]
