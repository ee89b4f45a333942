"""--init_from a vanilla checkpoint with --depth_mode set (issue 39): Depth-Attention adds no
parameter, so the vanilla weights start a Depth-Attention run exactly, said in one line; a mode
with parameters of its own, or any other shape setting, is still refused."""
import contextlib
import io
import json
from dataclasses import asdict

import pytest
import torch

import train as train_py
from conftest import tiny_model
from helpers import TINY_SHORT, log_records, read_log, train
from support import run_config
from support.run_dir import save_checkpoint
from support.data import load_meta


@pytest.fixture(scope="module")
def vanilla_ckpt(tmp_path_factory):
    """A vanilla checkpoint in train.py's format over the bytes tokenizer (data_root's)."""
    out = tmp_path_factory.mktemp("vanilla")
    model = tiny_model(vocab_size=257, depth_mode="vanilla")
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                     "tokenizer": "bytes", "step": 0}, out / "ckpt.pt")
    return out, model


def run_args(data_root, out_dir, *extra, lr=1e-2):
    """A short run over data_root/tiny, no model key but those in extra (--init_from fixes them);
    lr None: no --learning_rate."""
    return ["--dataset=tiny", f"--data_root={data_root}", f"--out_dir={out_dir}", "--max_iters=4",
            "--eval_interval=2", "--eval_seqs=6", "--log_interval=2", "--sample_tokens=0",
            "--micro_batch=4", "--batch_tokens=128", *([f"--learning_rate={lr}"] if lr else []),
            *extra]


def build(argv, data_root):
    """train.py's model for a command line, and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg, _, init = run_config.resolve(argv)
        model, _ = train_py.build(cfg, load_meta(data_root / "tiny"), data_root / "tiny", None,
                                  init)
    return model, out.getvalue()


@pytest.mark.parametrize("mode", ["value", "uniform", "key", "kv"])
def test_a_mode_without_parameters_starts_from_the_vanilla_weights_bit_for_bit(
        mode, vanilla_ckpt, data_root, tmp_path):
    path, vanilla = vanilla_ckpt
    model, printed = build(run_args(data_root, tmp_path, f"--init_from={path}",
                                    f"--depth_mode={mode}"), data_root)
    assert model.config.depth_mode == mode and model.config.depth_stride == 2  # the checkpoint's
    theirs, ours = vanilla.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert printed.count("\n") == 1 and f"depth_mode 'vanilla' -> '{mode}'" in printed \
        and "no parameter added" in printed, printed
    # the depth step is on: the same weights no longer compute vanilla's logits
    idx = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    assert not torch.allclose(model(idx)[0], vanilla.eval()(idx)[0])


def test_without_depth_mode_the_checkpoint_model_is_kept_silently(vanilla_ckpt, data_root,
                                                                  tmp_path):
    path, _ = vanilla_ckpt
    model, printed = build(run_args(data_root, tmp_path, f"--init_from={path}"), data_root)
    assert model.config.depth_mode == "vanilla" and printed == ""


@pytest.mark.parametrize("setting, fragment", [
    ("--depth_mode=lime", "other parameters than the checkpoint"),  # LIMe's routers
    ("--n_layer=6", "fixes the model"),
    ("--residual=denseformer", "fixes the model"),  # a baseline's weights
])
def test_a_switch_that_changes_the_parameters_is_refused(setting, fragment, vanilla_ckpt,
                                                         data_root, tmp_path):
    path, _ = vanilla_ckpt
    with pytest.raises(run_config.ConfigError, match=fragment) as e:
        build(run_args(data_root, tmp_path, f"--init_from={path}", setting), data_root)
    assert "\n" not in str(e.value) and setting[2:].split("=")[0] in str(e.value)


def test_an_upcycled_run_trains_as_depth_attention_and_resumes_exactly(vanilla_ckpt, data_root,
                                                                       tmp_path, monkeypatch):
    path, _ = vanilla_ckpt
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    args = [f"--init_from={path}", "--depth_mode=value"]
    assert train(monkeypatch, *run_args(data_root, whole, *args)) is None
    assert train(monkeypatch, *run_args(data_root, halves, *args, "--stop_at_step=2")) is None
    assert train(monkeypatch, *run_args(data_root, halves, *args, "--resume=True")) is None
    assert read_log(whole) == read_log(halves)  # the resume continued the same run
    saved = torch.load(halves / "ckpt.pt", weights_only=False)
    assert saved["model_config"]["depth_mode"] == "value" and saved["step"] == 4
    assert json.loads((halves / "config.json").read_text())["depth_mode"] == "value"
    evals = [r for r in log_records(whole) if r["kind"] == "eval"]
    assert evals and all(r.get("depth_weights") for r in evals)  # a depth step was measured


def test_a_vanilla_hugging_face_folder_starts_depth_attention_too(vanilla_ckpt, data_root,
                                                                  tmp_path, capsys):
    """An export of the vanilla model (a plain Qwen3 folder, as Qwen3 releases are) with
    --depth_mode=value: the folder's weights exactly, the depth step on."""
    import export as export_py
    path, vanilla = vanilla_ckpt
    folder = tmp_path / "qwen3_like"
    export_py.main([str(path), str(folder)])
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    capsys.readouterr()
    model, printed = build(run_args(data_root, tmp_path / "run", f"--init_from={folder}",
                                    "--depth_mode=value"), data_root)
    assert model.config.depth_mode == "value" and "no parameter added" in printed, printed
    theirs = vanilla.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def finished_run(data_root, tmp_path_factory):
    """A vanilla train.py run that finished its 4-step schedule: peak 1e-2, so its final rate (the
    cosine floor, min_lr_ratio 0.1 x the peak) is 1e-3."""
    out = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}", f"--out_dir={out}",
                     "--max_iters=4", "--eval_interval=0", "--depth_mode=vanilla") is None
    return out


def lrs(out_dir):
    return [r["lr"] for r in log_records(out_dir) if r["kind"] == "train"]


@pytest.mark.parametrize("extra, peak, notice", [
    ([], 1e-3, True),  # --init_lr=last, the default: re-warms to the final rate
    (["--init_lr=peak"], 3e-3, False),  # the old behaviour: learning_rate's default peak
    (["--learning_rate=5e-4"], 5e-4, False),  # a rate asked for is the rate
])
def test_continuing_a_finished_run_rewarms_to_its_final_rate(extra, peak, notice, finished_run,
                                                             data_root, tmp_path, monkeypatch,
                                                             capsys):
    """The schedule of a run --init_from a finished one: warmup to `peak`, then the cosine to
    min_lr_ratio x peak, as a new run's; the peak is the finished run's final rate unless asked."""
    out = tmp_path / "continued"
    capsys.readouterr()
    assert train(monkeypatch, *run_args(data_root, out, f"--init_from={finished_run}",
                                        "--depth_mode=value", "--warmup_frac=0.25", *extra,
                                        lr=None)) is None
    printed = capsys.readouterr().out
    assert lrs(out)[0] == pytest.approx(peak) and lrs(out)[-1] > 0.1 * peak, lrs(out)
    assert ("finished its schedule: the rate re-warms to its final 0.001" in printed) == notice
    assert json.loads((out / "config.json").read_text())["learning_rate"] == pytest.approx(peak)


def test_an_unfinished_run_continues_at_the_configured_peak(finished_run, data_root, tmp_path,
                                                             monkeypatch):
    """A run stopped early (its rate still high) keeps the old rule: --init_lr acts on finished
    runs only."""
    stopped = tmp_path / "stopped"
    assert train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}", f"--out_dir={stopped}",
                 "--max_iters=8", "--stop_at_step=2", "--eval_interval=0") is None
    out = tmp_path / "continued"
    assert train(monkeypatch, *run_args(data_root, out, f"--init_from={stopped}",
                                        "--warmup_frac=0.25", lr=None)) is None
    assert lrs(out)[0] == pytest.approx(3e-3)
