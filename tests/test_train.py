"""train.py and sample.py end to end, as a user runs them: subprocesses on a tiny byte-level corpus.

One reference run (fixture) is the yardstick: two gloo ranks, a resumed run and a run killed while
writing its checkpoint must all reproduce its losses.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support.variants import make_config
from support import run_config
from support.errors import ConfigError
from helpers import ROOT, SINGLE, TINY, log_records, max_diff, read_log, run


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = run("train.py", *TINY, *SINGLE, f"--data_root={data_root}", f"--out_dir={out}",
               "--sample_tokens=20")
    return out, proc.stdout


def test_training_lowers_loss(reference):
    out, stdout = reference
    log = read_log(out)
    first, last = log[("eval", 0)], log[("eval", 16)]
    assert last < first - 1.0, f"val loss went from {first:.4f} to {last:.4f}"
    assert "eval step 16 | val_loss" in stdout and "step 16/16 | train_loss" in stdout
    # redirected (no bar), every printed line says the time left; a CPU has no MFU to say
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and all(" | eta " in line and "mfu" not in line for line in lines)
    assert all("eta_s" in r and "mfu" not in r for r in log_records(out) if r["kind"] == "train")
    assert "sample (20 tokens)" in stdout
    config = json.loads((out / "config.json").read_text())
    # vocab_size=None followed meta.json
    assert config["n_layer"] == 3 and config["vocab_size"] == 257


def test_the_first_screen_is_what_differs_from_the_defaults_then_the_summary(reference):
    """As nanoGPT's configurator prints it: one `key = value` line per key the command changed, the
    one-line summary, then the losses; the whole configuration is config.json's, not the screen's."""
    out, stdout = reference
    lines = stdout.splitlines()
    summary = next(i for i, line in enumerate(lines) if "M parameters | " in line)
    asked = run_config.parse_args([*TINY, *SINGLE, f"--data_root={out.parent}", f"--out_dir={out}",
                                   "--sample_tokens=20"])
    changed = [f"{k} = {asked[k]!r}" for k in run_config.DEFAULTS
               if asked[k] != run_config.DEFAULTS[k]]
    assert [line.split(" = ")[0] for line in lines[:summary]] == [c.split(" = ")[0] for c in changed]
    assert "n_layer = 3" in lines[:summary] and not any(  # derived from the data, not asked for
        line.startswith(("vocab_size", "seed")) for line in lines[:summary])
    assert lines[summary + 1].startswith("eval step 0 | val_loss"), lines[summary:summary + 2]


def eval_weights(out_dir):
    """{step: the depth_weights of its eval record} from out_dir/log.jsonl."""
    return {r["step"]: r.get("depth_weights") for r in log_records(out_dir) if r["kind"] == "eval"}


def test_every_evaluation_logs_the_depth_weights(reference):
    """Figure 3's numbers through training: each eval record holds every layer's mean weight on each
    candidate, over the validation windows; each layer's are a distribution, they move as the run
    trains, and the last equal the checkpoint's own over the same windows."""
    from support.checkpoint import model_from_checkpoint, read_checkpoint
    from support.depth_weights import as_record, mean_depth_weights
    out = reference[0]
    logged = eval_weights(out)
    assert sorted(logged) == [0, 4, 8, 12, 16] and logged[0] != logged[16]
    for weights in logged.values():
        assert sorted(weights) == ["1", "2"]  # layer 0 has no sources
        assert all(abs(sum(row.values()) - 1) < 1e-4 for row in weights.values())
    ckpt = read_checkpoint(out / "ckpt.pt")
    val = np.fromfile(Path(ckpt["data_dir"]) / "val.bin", dtype=np.uint16).astype(np.int64)
    T, n = ckpt["config"]["block_size"], ckpt["config"]["eval_seqs"]
    offsets = np.linspace(0, len(val) - T - 1, n).round().astype(np.int64)  # train.py's windows
    x = torch.from_numpy(np.stack([val[o:o + T] for o in offsets]))
    want = as_record(mean_depth_weights(model_from_checkpoint(ckpt).eval(), x))
    assert want.keys() == logged[16].keys() and all(
        abs(want[e][c] - w) < 1e-4 for e, row in logged[16].items() for c, w in row.items())


def test_wandb_gets_the_depth_weights_as_one_series_each(tmp_path):
    from support.runlog import log

    class Run:  # what train.py calls of a wandb run
        def log(self, values, step):
            self.logged = (values, step)
    run = Run()
    record = {"kind": "eval", "step": 8, "val_loss": 2.5, "depth_weights": {"2": {"0": 0.25,
                                                                                  "2": 0.75}}}
    log(record, tmp_path, run)
    assert run.logged == ({"kind": "eval", "val_loss": 2.5, "depth_weight/2/0": 0.25,
                           "depth_weight/2/2": 0.75}, 8)
    assert json.loads((tmp_path / "log.jsonl").read_text()) == record


def test_two_gloo_ranks_match_one_process(reference, data_root, tmp_path):
    # Same global batch: 2 ranks x 2 micro-steps x 2 sequences = 1 process x 2 micro-steps x 4
    # sequences.
    run("--standalone", "--nproc_per_node=2", "train.py", *TINY, "--micro_batch=2", "--batch_tokens=256",
        f"--data_root={data_root}", f"--out_dir={tmp_path}",
        launcher=(sys.executable, "-m", "torch.distributed.run"))
    diff = max_diff(read_log(tmp_path), read_log(reference[0]))
    assert diff < 1e-5, f"DDP and single-process losses differ by up to {diff:.3e}"
    ranks, one = eval_weights(tmp_path), eval_weights(reference[0])  # each rank scored its windows
    assert all(abs(ranks[s][e][c] - w) < 1e-5 for s in one for e in one[s] for c,
               w in one[s][e].items())


def test_another_micro_batch_is_the_same_run_to_float_rounding(reference, data_root, tmp_path):
    """One micro-step of 8 sequences against the reference's two of 4: the micro-batches' gradients
    are summed in another order, so the losses agree to float rounding (about 1e-6), which is what
    the docs claim, not bit for bit."""
    run("train.py", *TINY, "--micro_batch=8", "--batch_tokens=256", f"--data_root={data_root}",
        f"--out_dir={tmp_path}")
    diff = max_diff(read_log(tmp_path), read_log(reference[0]))
    assert diff < 1e-5, f"another micro batch changes the losses by up to {diff:.3e}"
    doc = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert "Any micro batch gives the same run to float rounding, not bit for bit" in doc


def test_resume_reproduces_the_uninterrupted_run(reference, data_root, tmp_path):
    run("train.py", *TINY, *SINGLE, f"--data_root={data_root}", f"--out_dir={tmp_path}",
        "--stop_at_step=6")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 6
    # everything else comes from the checkpoint
    run("train.py", f"--out_dir={tmp_path}", "--resume=True")
    diff = max_diff(read_log(tmp_path), read_log(reference[0]))
    assert diff == 0, f"resumed losses differ from the uninterrupted run by up to {diff:.3e}"


KILLED_SAVE = """
import io, os, runpy, sys, torch
real_save, calls = torch.save, []
def dying_save(obj, f):  # the second checkpoint dies half-written, as a kill -9 would leave it
    calls.append(1)
    if len(calls) == 1:
        return real_save(obj, f)
    buf = io.BytesIO()
    real_save(obj, buf)
    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    f.flush()
    os._exit(9)
torch.save = dying_save
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_kill_during_checkpoint_write_keeps_the_previous_one(reference, data_root, tmp_path):
    # No --ckpt_interval: by default a checkpoint follows every evaluation (steps 4, 8, ...).
    args = [*(a for a in TINY if not a.startswith("--ckpt_interval")), *SINGLE, f"--data_root={data_root}",
            f"--out_dir={tmp_path}"]
    proc = run("-c", KILLED_SAVE, *args, check=False)
    assert proc.returncode == 9, proc.stderr[-3000:]
    torn = list(tmp_path.glob("ckpt.pt.tmp*"))
    assert len(torn) == 1, torn
    with pytest.raises(Exception):
        torch.load(torn[0], weights_only=True)  # the torn write is unreadable...
    # ...and never replaced ckpt.pt
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 4
    run("train.py", *args, "--resume=True")
    diff = max_diff(read_log(tmp_path), read_log(reference[0]))
    assert diff == 0, f"losses after the crash and resume differ by up to {diff:.3e}"


def test_sample_generates_the_requested_tokens(reference):
    proc = run("sample.py", f"--out_dir={reference[0]}", "--prompt=the cat", "--num_samples=2",
               "--max_new_tokens=12")
    headers = [line for line in proc.stdout.splitlines() if line.startswith("--- sample")]
    assert headers == [f"--- sample {i}/2: 7 prompt + 12 new tokens" for i in (1, 2)]
    assert proc.stdout.count("\nthe cat") == 2


@pytest.mark.parametrize("args, message", [
    (["--dataset=absent"], "python prepare_data.py text --input FILE ... --name absent"),
    (["--n_layers=2"], "unknown config key 'n_layers'"),
    (["--vocab_size=100"], "set --vocab_size=257 or more"),
    (["--block_size=100000"], "lower --block_size"),
    (["--batch_tokens=100"], "must be a multiple of block_size * world_size = 32 * 1; --batch_tokens=96"),
    (["--micro_batch=3"], "this rank's share of the batch, batch_tokens / block_size / world_size = 256 / 32 / 1 "
                          "= 8 sequences; --micro_batch=2 keeps the run, to float rounding"),
    (["--resume=True"], "no checkpoint at"),
])
def test_train_bad_inputs_fail_clearly(data_root, tmp_path, args, message):
    proc = run("train.py", *TINY, *SINGLE, f"--data_root={data_root}", f"--out_dir={tmp_path}",
               *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_sample_prompt_too_long_fails_clearly(reference):
    proc = run("sample.py", f"--out_dir={reference[0]}", "--prompt=" + "x" * 40,
               "--max_new_tokens=5", check=False)
    assert proc.returncode != 0 and "exceeds the context length block_size=32" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_files_resolve():
    """Every shipped config (ablations on top of their base) names only known keys and builds a
    ModelConfig; each vanilla twin differs from its value run in depth_mode, out_dir and the stride
    it has no use for; shakespeare.py is the default. None sets a key its model ignores (train.py
    would warn)."""
    defaults, configs = run_config.DEFAULTS, ROOT / "configs"

    def resolve(*names):
        cfg = run_config.parse_args([str(configs / n) for n in names])
        make_config(**{k: cfg[k] for k in run_config.MODEL_KEYS} | {"vocab_size": cfg["vocab_size"]
                                                                    or 257})
        assert not run_config.ignored_keys(cfg), names
        return cfg

    runs = {p.name: resolve(p.name) for p in configs.glob("*.py")}
    assert runs["shakespeare.py"] == defaults
    # torchrun --nproc_per_node=2 of any shipped config runs as it is
    for name, cfg in runs.items():
        for world in (1, 2, 8):
            mb, accum, rows = run_config.batch_layout(cfg, world)
            assert mb * accum * world == rows == cfg["batch_tokens"] // cfg["block_size"], (name,
                                                                                            world)
    for name in [n for n in runs if n.endswith("_vanilla.py")]:
        twin, ours = runs[name.replace("_vanilla", "_value")], runs[name]
        assert {k for k in ours if ours[k] != twin[k]} <= {"depth_mode", "out_dir",
                                                           "depth_stride"}, name
        assert ours["depth_stride"] is None and ours["depth_mode"] == "vanilla", name
    deltas = [p.name for p in (configs / "ablations").glob("*.py") if p.name not in ("base.py",
                                                                                     "cpu.py")]
    for base in ("base.py", "cpu.py"):  # the GPU and the CPU base of the sweep take the same deltas
        runs = {d: resolve(f"ablations/{base}", f"ablations/{d}") for d in deltas}
        # the same run: None means n_layer // 2
        half, value = runs["stride_half.py"], runs["mode_value.py"]
        assert {k for k in half if half[k] != value[k]} == {"depth_stride", "out_dir"}
        assert value["depth_stride"] is None and half["depth_stride"] == value["n_layer"] // 2


def test_micro_batch_follows_the_world_size():
    """micro_batch=None takes each rank's whole share; an explicit one that cannot divide it names
    the fix."""
    layout = run_config.batch_layout
    cfg = {"block_size": 256, "batch_tokens": 4096, "micro_batch": None}
    assert layout(cfg, 1) == (16, 1, 16) and layout(cfg, 2) == (8, 1, 16) and layout(cfg, 16) == (1, 1, 16)
    assert layout({**cfg, "micro_batch": 4}, 2) == (4, 2, 16)
    with pytest.raises(ConfigError, match="--micro_batch=8 keeps the run, to float rounding"):
        layout({**cfg, "micro_batch": 16}, 2)
    with pytest.raises(ConfigError, match="--batch_tokens=4096 is the nearest"):
        layout({**cfg, "batch_tokens": 4000}, 2)


@pytest.mark.parametrize("script", ["train.py", "sample.py", "prepare_data.py", "bench_cache.py",
                                    "ablate.py"])
def test_every_script_answers_help(script):
    for flag in ("--help", "-h") if script == "train.py" else ("--help",):  # -h takes the same path
        proc = run(script, flag)
        # argparse's or support.config's
        shown = "usage:" in proc.stdout or "keys (--key=value" in proc.stdout
        assert proc.returncode == 0 and shown and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr


def test_help_lists_every_key_with_its_help():
    """--help is the key table (support/run_config.py): every key, its default, its help; the
    model's keys say what their field's help in model.py or support/variants.py says."""
    text = run("train.py", "--help").stdout
    for key, value in run_config.DEFAULTS.items():
        line = next((l for l in text.splitlines() if l.strip().startswith(f"--{key}={value!r}")),
                    None)
        assert line is not None and len(line.split(None, 1)) == 2, f"--{key} has no line or no help in --help"
        assert run_config.TRAIN_KEYS[key].help in line, key
    assert "None = at every evaluation; 0 = at the end" in text
    assert "distinct blocks (paper 3B: 48)" in text  # n_layer's help in model.py
    from baselines import DEPTH_MODES  # the choices come from the table itself, LIMe's row included
    line = next(l for l in text.splitlines() if "--depth_mode='value'" in l)
    assert "a row of model.DEPTH_MODES" in line and line.endswith(f"one of {', '.join(DEPTH_MODES)}")


@pytest.mark.parametrize("extra, tol", [(["--dtype=bfloat16"], 0.05), (["--compile=True"], 1e-4)])
def test_gpu_paths_run_on_cpu(reference, data_root, tmp_path, extra, tol):
    """The paths every GPU user takes, on the CPU: bf16 autocast and torch.compile train to finite
    losses that stay close to the float32 eager reference (bf16 rounds, so its tolerance is
    looser)."""
    run("train.py", *TINY, *SINGLE, f"--data_root={data_root}", f"--out_dir={tmp_path}",
        "--stop_at_step=4", *extra)
    ours, ref = read_log(tmp_path), read_log(reference[0])
    assert all(math.isfinite(v) for v in ours.values())
    diff = max(abs(ours[k] - ref[k]) for k in ours)
    assert diff < tol, f"{extra}: losses differ from float32 eager by up to {diff:.3e}"
