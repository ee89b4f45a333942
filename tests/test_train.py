"""train.py and sample.py end to end on a tiny byte-level corpus, run in this process as a user runs
them (helpers.cli, helpers.train). One reference run is the yardstick: a resumed run reproduces it
exactly, another micro batch to float rounding; the loss falls, every evaluation logs the depth
weights, a diverging run stops before a bad checkpoint, --init_from switches only what keeps the
weights. Two gloo ranks against one process: tests/test_robustness.py's SIGTERM to one of two
ranks, whose run one process finishes, every loss one process's."""
import json

import numpy as np
import pytest
import torch

import train as train_py
from checkpoint import load_model, read_checkpoint
from configurator import ConfigError
from data import load_meta, read_tokens
from helpers import SINGLE, TINY, TINY_SHORT, assert_one_error_line, cli, eval_losses
from helpers import log_records, max_diff, read_log, train

REF = [*TINY, *SINGLE]  # 3 layers, 16 steps, 2 micro-steps of 4 sequences, eval + ckpt every 4


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    code, stdout, err = cli("train.py", *REF, f"--data_root={data_root}", f"--out_dir={out}",
                            "--sample_tokens=20")
    assert code == 0, err[-3000:]
    return out, stdout


def test_training_lowers_the_loss_and_says_so(reference):
    out, stdout = reference
    log = read_log(out)
    assert log[("eval", 16)] < log[("eval", 0)] - 1.0, log
    assert "eval step 16 | val_loss" in stdout and "sample (20 tokens)" in stdout
    # every log_interval a line saying the time left; a CPU has no MFU to say
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and all(" | eta " in line and "mfu" not in line for line in lines)
    assert all("eta_s" in r and "mfu" not in r for r in log_records(out) if r["kind"] == "train")
    config = json.loads((out / "config.json").read_text())
    assert config["n_layer"] == 3 and config["vocab_size"] == 257  # None: meta.json's
    # as nanoGPT prints it: the keys the command changed, the summary, then the losses
    screen = stdout.splitlines()
    summary = next(i for i, line in enumerate(screen) if "M parameters | " in line)
    asked = train_py.parse_args([*REF, f"--data_root={out.parent}", f"--out_dir={out}",
                                 "--sample_tokens=20"])
    changed = [k for k, key in train_py.table().items() if asked[k] != key.default]
    assert [line.split(" = ")[0] for line in screen[:summary]] == changed
    assert screen[summary + 1].startswith("eval step 0 | val_loss")


def test_every_evaluation_logs_the_depth_weights(reference):
    """Figure 3's numbers through training: each eval record holds every layer's mean weight on
    each candidate over the validation windows; a distribution per layer, moving as the run
    trains, the last the checkpoint's own over the same windows."""
    out = reference[0]
    logged = {r["step"]: r["depth_weights"] for r in log_records(out) if r["kind"] == "eval"}
    assert sorted(logged) == [0, 4, 8, 12, 16] and logged[0] != logged[16]
    for weights in logged.values():
        assert sorted(weights) == ["1", "2"]  # layer 0 has no sources
        assert all(abs(sum(row.values()) - 1) < 1e-4 for row in weights.values())
    loaded = load_model(out)
    data_dir = read_checkpoint(out / "ckpt.pt")["data_dir"]
    val = read_tokens(data_dir, "val", load_meta(data_dir)).astype(np.int64)
    T, n = loaded.config["block_size"], loaded.config["eval_seqs"]
    offsets = np.linspace(0, len(val) - T - 1, n).round().astype(np.int64)  # train.py's windows
    x = torch.from_numpy(np.stack([val[o:o + T] for o in offsets]))
    with torch.no_grad(), train_py.capture_depth_weights(loaded.model) as alphas:
        loaded.model(x)
    for e, (src, alpha) in alphas.items():
        means = alpha.double().mean(dim=(0, 1, 3)).tolist()
        assert {str(c): round(w, 5) for c, w in zip([*src, e], means)} == pytest.approx(
            logged[16][str(e)], abs=2e-5)


def test_a_run_stopped_and_resumed_is_the_uninterrupted_run(reference, data_root, tmp_path,
                                                           monkeypatch):
    out = tmp_path / "run"
    assert train(monkeypatch, *REF, f"--data_root={data_root}", f"--out_dir={out}",
                 "--stop_at_step=6") is None
    assert read_checkpoint(out / "ckpt.pt")["step"] == 6
    assert max(step for _, step in read_log(out)) == 6
    assert train(monkeypatch, f"--out_dir={out}", "--resume") is None  # the rest: the checkpoint's
    diff = max_diff(read_log(out), read_log(reference[0]))
    assert diff == 0, f"resumed losses differ from the uninterrupted run by up to {diff:.3e}"


def test_another_micro_batch_is_the_same_run_to_float_rounding(reference, data_root, tmp_path,
                                                              monkeypatch):
    """One micro-step of 8 sequences against the reference's two of 4: the gradients are summed
    in another order, so the losses agree to float rounding, not bit for bit."""
    assert train(monkeypatch, *TINY, "--micro_batch=8", "--batch_tokens=256",
                 f"--data_root={data_root}", f"--out_dir={tmp_path}") is None
    diff = max_diff(read_log(tmp_path), read_log(reference[0]))
    assert diff < 1e-5, f"another micro batch changes the losses by up to {diff:.3e}"


def test_bf16_autocast_trains_close_to_float32(reference, data_root, tmp_path, monkeypatch):
    """The path every GPU user takes, on the CPU: bf16 autocast rounds, so close, not equal."""
    assert train(monkeypatch, *REF, "--dtype=bfloat16", "--stop_at_step=1",
                 f"--data_root={data_root}", f"--out_dir={tmp_path}") is None
    ours, ref = read_log(tmp_path), read_log(reference[0])
    assert all(abs(loss - ref[k]) < 0.05 for k, loss in ours.items()), ours


def test_the_batch_layout_follows_the_world_size():
    """micro_batch=None takes each rank's whole share; one that cannot divide it, or a batch that
    is no multiple of block_size * world, names the nearest that can."""
    layout, cfg = train_py.batch_layout, {"block_size": 256, "batch_tokens": 4096,
                                          "micro_batch": None}
    assert [layout(cfg, w) for w in (1, 2, 16)] == [(16, 1, 16), (8, 1, 16), (1, 1, 16)]
    assert layout({**cfg, "micro_batch": 4}, 2) == (4, 2, 16)
    with pytest.raises(ConfigError, match="--micro_batch=8 "):
        layout({**cfg, "micro_batch": 16}, 2)
    with pytest.raises(ConfigError, match="--micro_batch=2 "):
        layout({**cfg, "micro_batch": 3}, 1)
    with pytest.raises(ConfigError, match="--batch_tokens=4096 "):
        layout({**cfg, "batch_tokens": 4000}, 2)


def test_divergence_stops_before_a_bad_checkpoint(data_root, tmp_path):
    out = tmp_path / "diverged"
    code, stdout, err = cli("train.py", *TINY_SHORT, "--max_iters=8", "--eval_interval=4",
                            "--learning_rate=1e6", "--ckpt_interval=1",
                            f"--data_root={data_root}", f"--out_dir={out}")
    assert_one_error_line(code, stdout, err, "diverged at step")
    step = int(err.split("diverged at step ")[1].split()[0])
    ckpt = read_checkpoint(out / "ckpt.pt")  # verified: intact, finite, the step before
    assert ckpt["step"] == step - 1 and f"(step {step - 1}) is kept" in err
    assert all(t.isfinite().all() for t in ckpt["model"].values())
    assert max(r["step"] for r in log_records(out)) == step - 1


def test_sample_generates_the_requested_tokens(reference):
    code, out, err = cli("sample.py", f"--init_from={reference[0]}", "--prompt=the cat",
                         "--num_samples=2", "--max_new_tokens=12")
    headers = [line for line in out.splitlines() if line.startswith("--- sample")]
    assert code == 0 and headers == [f"--- sample {i}/2: 7 prompt + 12 new tokens"
                                     for i in (1, 2)], err
    assert out.count("\nthe cat") == 2 and "step 16" in err
    code, out, err = cli("sample.py", f"--init_from={reference[0]}", "--prompt=" + "x" * 40,
                         "--max_new_tokens=5")
    assert_one_error_line(code, out, err, "block_size=32")


@pytest.fixture(scope="module")
def vanilla(data_root, tmp_path_factory):
    """A vanilla 2-layer run of 2 steps, and its command line less the depth mode and out_dir."""
    short = [*TINY_SHORT, "--max_iters=2", "--eval_interval=2", f"--data_root={data_root}"]
    out = tmp_path_factory.mktemp("vanilla") / "run"
    code, _, err = cli("train.py", *short, "--depth_mode=vanilla", f"--out_dir={out}")
    assert code == 0, err[-2000:]
    return out, short


def test_init_from_switches_only_what_keeps_the_weights(vanilla, tmp_path, monkeypatch):
    """A vanilla run's weights start a value run (the switch said in one line); a setting that
    would change the parameters is refused naming it, typed equal to the default or not; a resume
    continues from the weights it began from, and refuses others."""
    (run, short), tune = vanilla, tmp_path / "tune"
    for setting in ("--n_layer=6", "--n_embd=32"):  # n_layer=6 is the default: typed, refused
        line = train(monkeypatch, *short, f"--init_from={run}", setting,
                     f"--out_dir={tmp_path / 'refused'}")
        assert line.startswith("error:") and setting[2:].split("=")[0] in line, line
    code, out, err = cli("train.py", *short, f"--init_from={run}", "--depth_mode=value",
                         f"--out_dir={tune}")
    assert code == 0 and "switched depth_mode 'vanilla' -> 'value'" in out, err[-2000:]
    assert load_model(tune).model.config.depth_mode == "value"
    assert train(monkeypatch, f"--out_dir={tune}", "--resume", f"--init_from={run}",
                 "--max_iters=4") is None
    assert read_checkpoint(tune / "ckpt.pt")["step"] == 4 and 4 in eval_losses(tune)
    line = train(monkeypatch, f"--out_dir={tune}", "--resume", f"--init_from={tmp_path}")
    assert line.startswith("error:") and "--init_from" in line, line


def test_a_resume_takes_its_weights_however_spelled(vanilla, tmp_path, monkeypatch):
    (run, short), tune = vanilla, tmp_path / "tune"
    assert train(monkeypatch, *short, f"--init_from={run}", f"--out_dir={tune}") is None
    assert train(monkeypatch, f"--out_dir={tune}", "--resume", f"--init_from={run}/",
                 "--max_iters=4") is None
