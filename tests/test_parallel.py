"""--parallel=ddp|fsdp and --activation_checkpointing change memory, never the run: one process,
DDP and FSDP on 2 gloo ranks give the same losses (FSDP for every variant, with one process's
gradients and no false alarm on the screen) and resume exactly; activation checkpointing gives the
same gradients (its lower peak is tests/test_memory.py's). An FSDP run's sharded checkpoint
(ckpt.dcp) keeps ckpt.pt's promises: every file is checked against run.pt's record on every read
(a damaged, truncated, missing or swapped file named in one line, resume included), a failed
write keeps the previous checkpoint, a kill between the renames is recovered, a resume runs only
under the --parallel that wrote it, and readers (load_model, sample.py, export) read the whole
model. Every 2-rank run is in one torchrun launch of tests/parallel_driver.py."""
import json
import os
import shutil
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp

from baselines import build_model
from checkpoint import SHARDED, load_model, read_checkpoint
from configurator import CheckpointError, UserError
from conftest import tiny_config
from helpers import (FSDP_RUN, ROOT, SINGLE, TINY, TORCHRUN, assert_one_error_line, cli,
                     max_diff, read_log, run, train)
from lab.export import main as export
from lab.hf import from_pretrained
from lab.shards import digest_files
from outputs import lock_run_folder, save_checkpoint

SHARDS = ("__0_0.distcp", "__1_0.distcp", ".metadata")  # and run.pt, which records them
SHORT = ["--max_iters=8", "--ckpt_interval=0"]  # TINY's evaluations at 0, 4, 8; one checkpoint


@pytest.fixture(scope="module")
def launch(data_root, tmp_path_factory):
    """(the driver's folder, its variants.json, the exit status of each train.py run, the launch's
    stderr). The runs: FSDP and DDP through 8 steps, each also stopped at 3 and resumed, bf16
    under FSDP, then resumes of damaged copies of the FSDP run and of one whose write is blocked."""
    out = tmp_path_factory.mktemp("launch")
    data, ddp = f"--data_root={data_root}", [*TINY, *SHORT, "--micro_batch=2", "--batch_tokens=256"]
    fsdp_run = [*FSDP_RUN, *SHORT]
    fsdp = out / "fsdp"

    def resumed(name, action):  # a copy of the FSDP run, changed, resumed to step 10
        return [name, [f"--out_dir={out / name}", "--resume=True", "--max_iters=10"],
                ["copy", fsdp, out / name], [action[0], out / name / action[1]]]
    plan = [["fsdp", [*fsdp_run, data, f"--out_dir={fsdp}"]],
            ["ddp", [*ddp, data, f"--out_dir={out / 'ddp'}"]],
            *[step for name, args in (("fsdp_resumed", fsdp_run), ("ddp_resumed", ddp))
              for step in ([f"{name}_stop", [*args, data, f"--out_dir={out / name}",
                                             "--stop_at_step=3"]],
                           [name, [f"--out_dir={out / name}", "--resume=True"]])],
            ["bf16", [*fsdp_run, data, f"--out_dir={out / 'bf16'}", "--dtype=bfloat16",
                      "--max_iters=2", "--eval_interval=0", "--sample_tokens=5"]],
            resumed("flipped", ("flip", f"{SHARDED}/__1_0.distcp")),
            resumed("no_metadata", ("remove", f"{SHARDED}/.metadata")),
            resumed("blocked", ("block", f"{SHARDED}.tmp"))]
    (out / "plan.json").write_text(json.dumps(plan, default=str))
    proc = run(ROOT / "tests" / "parallel_driver.py", out, out / "plan.json", launcher=TORCHRUN)
    return (out, json.loads((out / "variants.json").read_text()),
            json.loads((out / "status.json").read_text()), proc.stderr)


def output(out, name, kind="err"):
    return [(out / f"{name}.rank{r}.{kind}").read_text() for r in (0, 1)]


def one_line(launch, name):
    """The error line a train.py run of the launch stopped with: exit 2, said by rank 0 alone."""
    out, _, status, _ = launch
    err = output(out, name)
    assert status[name] == 2 and "Traceback" not in "".join(err), err
    assert [x for x in "".join(err).splitlines() if x.startswith("error:")] == \
        err[0].strip().splitlines()[-1:], err
    return err[0].strip().splitlines()[-1]


def test_every_variant_trains_under_fsdp_as_in_one_process(launch):
    """Losses and grad norms of two steps, and every parameter's first gradient: FSDP2 warns when
    a unit returns a view (a block's record, its K and V for the depth step); nothing writes into
    one in place, so no pre-backward hook is lost, and the warning stays off the screen. The cases
    +ac (activation checkpointing) give the same losses and gradients as without."""
    out, variants, status, stderr = launch
    for case, runs in variants.items():
        one, fsdp = runs["single"], runs["fsdp"]
        diff = max(abs(a - b) for s, f in zip(one["steps"], fsdp["steps"]) for a, b in zip(s, f))
        assert diff < 1e-4, f"{case}: FSDP and one process differ by {diff:.2e}"
        for name, grad in one["grads"].items():
            diff = (torch.tensor(grad) - torch.tensor(fsdp["grads"][name])).abs().max().item()
            assert diff < 1e-6, f"{case}: the gradient of {name} differs under FSDP by {diff:.2e}"
    for case in ("value", "mhc"):
        plain, ac = variants[case]["single"], variants[f"{case}+ac"]["single"]
        assert max(abs(a - b) for s, c in zip(plain["steps"], ac["steps"])
                   for a, b in zip(s, c)) < 1e-5
        assert all(torch.allclose(torch.tensor(g), torch.tensor(ac["grads"][n]), atol=1e-6)
                   for n, g in plain["grads"].items())
    screen = stderr + "".join(e for name in status for e in output(out, name))
    assert "returned a view tensor" not in screen, screen[-2000:]


def test_one_process_ddp_and_fsdp_are_the_same_run_and_resume_exactly(launch, data_root, tmp_path,
                                                                      monkeypatch):
    out, _, status, _ = launch
    assert all(status[n] == 0 for n in ("fsdp", "ddp", "fsdp_resumed", "ddp_resumed")), status
    assert train(monkeypatch, *TINY, *SINGLE, *SHORT, f"--data_root={data_root}",
                 f"--out_dir={tmp_path}") is None
    for name in ("fsdp", "ddp"):
        diff = max_diff(read_log(out / name), read_log(tmp_path))
        assert diff < 1e-4, f"{name} on 2 ranks and one process differ by up to {diff:.2e}"
        assert read_log(out / f"{name}_resumed") == read_log(out / name), name
    assert (out / "fsdp_resumed" / SHARDED / "run.pt").is_file()
    assert not (out / "fsdp_resumed" / "ckpt.pt").exists()


def test_fsdp_mixed_precision_trains_and_samples(launch):
    """bf16 under FSDP (a GPU's default): the parameters compute in bf16, so the end-of-run
    sample's KV cache must be bf16 too (a float32 one stopped the run after its last checkpoint)."""
    out, _, status, _ = launch
    stdout = output(out, "bf16", "out")[0]
    assert status["bf16"] == 0 and "cpu bf16" in stdout and "sample (5 tokens)" in stdout
    assert "done: step 2" in stdout


@pytest.mark.parametrize("name, file", [("flipped", "__1_0.distcp"), ("no_metadata", ".metadata")])
def test_a_damaged_sharded_checkpoint_stops_the_resume_in_one_line(launch, name, file):
    """Every rank checks its share of the files and hears the others' findings: rank 0 names the
    file, the other stops without a word (it was five tracebacks for a missing .metadata)."""
    assert f"{SHARDED} is damaged: {file}" in one_line(launch, name)


def test_a_failed_sharded_write_is_one_line_and_keeps_the_previous_checkpoint(launch):
    """A file where ckpt.dcp.tmp goes, as a full disk or a read-only folder would stop the write:
    torch.distributed.checkpoint raises on every rank; the run says it once."""
    out = launch[0]
    line = one_line(launch, "blocked")
    assert f"could not write {out / 'blocked' / SHARDED} at step 10 (rank 0: " in line
    assert "File exists" in line and "FrameSummary" not in line  # the cause, not its stack
    assert "the checkpoint of step 8 is kept" in line
    assert read_checkpoint(out / "blocked" / SHARDED)["step"] == 8


@pytest.mark.parametrize("args, message", [(["--parallel=fsdp"], "launch `torchrun"),
                                           (["--parallel=zero3"], "--parallel=zero3 is not a "
                                            "choice; choices: ddp, fsdp")])
def test_bad_parallel_settings_are_one_line(data_root, tmp_path, args, message, monkeypatch):
    line = train(monkeypatch, *TINY, f"--data_root={data_root}", f"--out_dir={tmp_path}", *args)
    assert line.startswith("error: ") and message in line, line

# ----------------------------------------------------------------------------- the sharded
# checkpoint, read in one process


def copy_of(launch, tmp_path, name="fsdp"):
    return shutil.copytree(launch[0] / name, tmp_path / name)


def test_readers_read_the_whole_model_and_sample_and_export_it(launch, tmp_path, capsys):
    out = launch[0]
    files = read_checkpoint(out / "fsdp" / SHARDED)["files"]
    assert sorted(files) == sorted(SHARDS)
    loaded, whole = load_model(out / "fsdp"), load_model(out / "ddp").model.state_dict()
    assert loaded.step == 8 and loaded.source.endswith(SHARDED)
    assert all(torch.allclose(v, whole[k], atol=1e-4) for k, v in loaded.model.state_dict().items())
    greedy = ["--prompt=the cat", "--max_new_tokens=6", "--temperature=0"]
    texts = [cli("sample.py", f"--init_from={out / 'fsdp'}", *greedy)[1].split("--- sample")[-1]]
    export([str(out / "fsdp"), str(tmp_path / "hf")])
    again = from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(again[k], v) for k, v in loaded.model.state_dict().items())
    texts.append(cli("sample.py", f"--init_from={tmp_path / 'hf'}", *greedy)[1]
                 .split("--- sample")[-1])
    assert texts[0] == texts[1] and len(texts[0]) > len("the cat")


def damage(folder, name, how):
    path, other = folder / name, folder / ("__1_0.distcp" if name != "__1_0.distcp" else
                                           "__0_0.distcp")
    data = path.read_bytes()
    if how == "swapped":
        path.write_bytes(other.read_bytes())
        other.write_bytes(data)
    elif how == "removed":
        path.unlink()
    else:
        i = len(data) // 2
        path.write_bytes({"flipped bit": data[:i] + bytes([data[i] ^ 1]) + data[i + 1:],
                          "truncated": data[:i], "grown": data + b"\0"}[how])


def test_every_damaged_file_is_named_on_read(launch, tmp_path):
    """Each file flipped by a bit, truncated, grown, removed or swapped with another: load_model
    (sample.py's, export's, --init_from's reader) names it; sample.py says so in one line. Before
    the file checks, a flipped bit in the head's weights sampled 'AAAAAAAAAA' and exited 0."""
    for how in ("flipped bit", "truncated", "grown", "removed", "swapped"):
        for name in SHARDS:
            run_dir = copy_of(launch, tmp_path / how.replace(" ", "_") / name)
            damage(run_dir / SHARDED, name, how)
            with pytest.raises(CheckpointError, match=f"{run_dir / SHARDED} is damaged: .*{name}"):
                load_model(run_dir)
    code, out, err = cli("sample.py", f"--init_from={run_dir}", "--max_new_tokens=4")
    assert_one_error_line(code, out, err, f"is damaged: {name}")
    assert "--- sample" not in out


def test_a_kill_between_the_renames_keeps_the_previous_checkpoint(launch, tmp_path):
    """Killed between rank 0's two renames, the checkpoint is ckpt.dcp.old and the new one half
    written in ckpt.dcp.tmp: readers take the first, and the next run into the folder puts it back
    and drops the second."""
    run_dir = copy_of(launch, tmp_path)
    (run_dir / SHARDED).rename(run_dir / f"{SHARDED}.old")
    (run_dir / f"{SHARDED}.tmp").mkdir()
    assert load_model(run_dir).step == 8
    lock_run_folder(run_dir, resuming=True, overwrite=False).close()
    assert sorted(p.name for p in run_dir.glob("ckpt*")) == [SHARDED]
    assert load_model(run_dir).step == 8
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        lock_run_folder(run_dir, resuming=False, overwrite=False)


@pytest.mark.parametrize("name, other", [("fsdp", "ddp"), ("ddp", "fsdp")])
def test_a_checkpoint_resumes_only_under_the_parallel_that_wrote_it(launch, name, other,
                                                                   tmp_path, monkeypatch):
    line = train(monkeypatch, f"--out_dir={copy_of(launch, tmp_path, name)}", "--resume=True",
                 f"--parallel={other}", "--max_iters=10")
    assert line.startswith("error: ") and f"--parallel={name}" in line, line


def test_no_export_lands_in_or_around_a_run(launch, tmp_path):
    """`export.py RUN RUN/ckpt.dcp --overwrite` once replaced the FSDP checkpoint with an
    export."""
    src, other = copy_of(launch, tmp_path), shutil.copytree(launch[0] / "fsdp", tmp_path / "other")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for dest in (src / SHARDED, src / SHARDED / "hf", tmp_path, other / SHARDED):
        with pytest.raises(UserError):
            export([str(src), str(dest), "--overwrite"])
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_checkpoint_without_file_checksums_still_loads(launch, tmp_path, capsys):
    """One written before the file record: read unverified, with a warning, as an old ckpt.pt."""
    folder = copy_of(launch, tmp_path) / SHARDED
    ckpt = read_checkpoint(folder)
    save_checkpoint({k: v for k, v in ckpt.items() if k not in ("files", "shards")},
                    folder / "run.pt")
    assert torch.equal(load_model(folder.parent).model.lm_head.weight,
                       load_model(launch[0] / "fsdp").model.lm_head.weight)
    assert "has no file checksums" in capsys.readouterr().err


def test_shards_are_read_into_the_model_itself(tmp_path, monkeypatch):
    """The reader fills the model's own parameters from the shards (state_dict's tensors are their
    storage): the saved weights, not a fresh model's, and no second copy."""
    import checkpoint
    built, build = [], checkpoint.build_model

    def recording(keys):  # where the model's parameters live when it is built
        model = build(keys)
        built.append([p.data_ptr() for p in model.parameters()])
        return model
    monkeypatch.setattr(checkpoint, "build_model", recording)
    torch.manual_seed(0)
    saved = build_model(asdict(tiny_config(depth_mode="value")))
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1.0)  # away from what a fresh model with the same seed holds
    folder = tmp_path / SHARDED
    with pytest.warns(UserWarning, match="single process"):  # no process group here, as intended
        dcp.save({"model": saved.state_dict()}, checkpoint_id=folder)
    save_checkpoint({"model_config": asdict(saved.config),
                     "files": digest_files(folder, os.listdir(folder))}, folder / "run.pt")
    _, _, model = checkpoint.read_model(folder)
    assert built == [[p.data_ptr() for p in model.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 saved.state_dict().values()))
