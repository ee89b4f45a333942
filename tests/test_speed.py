"""A run says how fast it goes (issue 39): MFU against a given or known peak, never an invented
one, and the time left, on every printed line and in log.jsonl."""
import pytest
import torch

from conftest import tiny_model
from helpers import TINY_SHORT, log_records, train
from support.cost import depth_cost
from support import speed


def test_flops_per_token_is_6n_plus_attention_plus_the_depth_step():
    vanilla, value = tiny_model(depth_mode="vanilla"), tiny_model(depth_mode="value")
    c = vanilla.config
    attention = 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
    assert speed.train_flops_per_token(vanilla) == 6 * vanilla.num_params() + attention
    extra = depth_cost(value.config)["flops_per_token"]
    assert extra > 0 and speed.train_flops_per_token(value) == 6 * value.num_params() \
        + attention + 3 * extra
    looped = tiny_model(depth_mode="vanilla", n_loops=2)
    assert speed.train_flops_per_token(looped) == 12 * looped.num_params() + 2 * attention


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("Some Future GPU", 0.0)])
def test_the_peak_of_a_known_gpu_is_looked_up_and_an_unknown_one_is_none(name, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert speed.peak_flops(0.0, "cuda:0") == peak
    assert speed.peak_flops(5e12, "cuda:0") == 5e12  # --peak_flops wins


def test_a_cpu_has_no_peak_unless_given():
    assert speed.peak_flops(0.0, "cpu") == 0.0 and speed.peak_flops(1e9, "cpu") == 1e9


def test_progress_counts_the_wall_clock_since_the_first_step(monkeypatch):
    clock = iter([100.0, 104.0, 106.0])  # step 10 ends, then 11 two steps' worth of time later
    monkeypatch.setattr(speed.time, "perf_counter", lambda: next(clock))
    progress = speed.Progress(flops_per_token=1e6, peak=1e9, world=2, max_iters=20)
    first = progress(10, tok_per_s=500.0, step_s=3.0)
    assert first == {"eta_s": 3.0 * 10, "mfu": 1e6 * 500 / 2e9}
    assert progress(11, 500.0, 1.0)["eta_s"] == 4.0 * 9  # evals between steps count too
    assert progress(12, 500.0, 1.0)["eta_s"] == 3.0 * 8
    assert speed.describe({"eta_s": 3725.4, "mfu": 0.4134}) == " | mfu 41.3% | eta 1h02m"
    assert speed.describe({"eta_s": 61}) == " | eta 1m01s"


def test_peak_flops_puts_mfu_on_every_line_and_record(data_root, tmp_path, monkeypatch, capsys):
    assert train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}", f"--out_dir={tmp_path}",
                 "--max_iters=4", "--eval_interval=0", "--peak_flops=1e9") is None
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert lines and all(" | mfu " in x and " | eta " in x for x in lines), lines
    records = [r for r in log_records(tmp_path) if r["kind"] == "train"]
    assert len(records) == 4 and all(0 < r["mfu"] and r["eta_s"] >= 0 for r in records)
    assert records[-1]["eta_s"] == 0


def test_curves_draws_one_run_from_its_log(tmp_path, capsys):
    """ablate.py --curves=RUN: a PNG from log.jsonl alone (no checkpoint), with or without depth
    weights; a folder that has not trained is one line."""
    pytest.importorskip("matplotlib")
    import json
    import ablate
    from support.depth_weights import self_share
    from support.errors import UserError
    weights = {"1": {"0": 0.25, "1": 0.75}, "2": {"0": 0.5, "2": 0.5}}
    assert self_share(weights) == 0.625
    records = [{"kind": "eval", "step": 0, "val_loss": 3.0, "depth_weights": weights}]
    records += [{"kind": "train", "step": s, "train_loss": 3.0 - s / 10, "lr": 1e-3,
                 "grad_norm": 1.0, "tok_per_s": 100.0 + s, "eta_s": 4 - s} for s in (1, 2, 3, 4)]
    for depth in (True, False):
        run = tmp_path / f"run{depth}"
        run.mkdir()
        kept = [r if depth else {k: v for k, v in r.items() if k != "depth_weights"}
                for r in records]
        (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        ablate.main([f"--curves={run}"])
        assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
        assert f"4 steps of {run} drawn" in capsys.readouterr().out
    with pytest.raises(UserError, match="no training step to draw"):
        ablate.main([f"--curves={tmp_path}"])
    ablate.main([f"--curves={run}", f"--figure={tmp_path / 'elsewhere.png'}"])
    assert (tmp_path / "elsewhere.png").exists()
    ablate.main([f"--curves={run}"])  # its own figure: replaced
    (tmp_path / "mine.png").write_bytes(b"\x89PNG not ablate's")
    with pytest.raises(UserError):  # a file it did not draw: kept
        ablate.main([f"--curves={run}", f"--figure={tmp_path / 'mine.png'}"])
    assert (tmp_path / "mine.png").read_bytes() == b"\x89PNG not ablate's"


def test_curves_reads_the_log_as_resume_does(tmp_path, capsys):
    """--curves reads log.jsonl with --resume's reader (support.runlog.read_log): a last line cut
    short (kill -9 mid-write, or a live run's line being written) is dropped with its warning, a
    column an older train.py did not log (tok_per_s) is left out, named in one line, and only a
    damaged line before the last is an error."""
    pytest.importorskip("matplotlib")
    import json
    import ablate
    from support.errors import CheckpointError
    records = [{"kind": "train", "step": s, "train_loss": 3.0 - s / 10, "lr": 1e-3}
               for s in (1, 2, 3)]
    lines = [json.dumps(r) for r in records]
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:20])
    ablate.main([f"--curves={tmp_path}"])
    out, err = capsys.readouterr()
    assert "last line was cut short (a kill or a full disk mid-write); dropped it" in err, err
    assert f"{tmp_path}/log.jsonl has no tok_per_s; left out of the figure" in err, err
    assert f"3 steps of {tmp_path} drawn" in out
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "log.jsonl").write_text("\n".join([lines[0], lines[1][:20], lines[2]]) + "\n")
    with pytest.raises(CheckpointError, match="log.jsonl line 2 is not a train.py record"):
        ablate.main([f"--curves={tmp_path}"])


def test_wandb_without_a_login_is_one_line_naming_offline_and_login(tmp_path, monkeypatch):
    """wandb.init with no API key and no terminal raises its UsageError: a traceback after the
    run had started."""
    import sys
    import types
    from support import run_config
    from support.errors import ConfigError
    from support.runlog import start_log
    fake, errors = types.ModuleType("wandb"), types.ModuleType("wandb.errors")
    usage = type("UsageError", (Exception,), {"__module__": "wandb.errors"})

    def init(**kwargs):
        raise usage("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
    fake.init, fake.errors, errors.UsageError = init, errors, usage
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = {**run_config.DEFAULTS, "wandb_log": True}
    with pytest.raises(ConfigError) as e:
        start_log(cfg, [], tmp_path, 0)
    line = str(e.value)
    assert "\n" not in line and "WANDB_MODE=offline" in line and "wandb login" in line, line
    assert "api_key not configured" in line


def test_every_record_carries_the_runs_elapsed_time_across_a_resume(data_root, tmp_path,
                                                                    monkeypatch, capsys):
    """log.jsonl's elapsed_s counts the run's wall time over its invocations: a resume continues
    from its checkpoint's count (a restart from zero would go backwards); the done line and the
    curves figure say the duration."""
    args = [*TINY_SHORT, f"--data_root={data_root}", f"--out_dir={tmp_path}", "--max_iters=4",
            "--eval_interval=2"]
    assert train(monkeypatch, *args, "--stop_at_step=2") is None
    first = log_records(tmp_path)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["elapsed_s"]
    assert train(monkeypatch, *args, "--resume=True") is None
    records = log_records(tmp_path)
    times = [r["elapsed_s"] for r in records]
    assert records[:len(first)] == first and len(records) == 4 + 3  # 4 steps, 3 evaluations
    assert 0 < times[0] and times == sorted(times) and times[len(first)] > saved, times
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert done[-1].startswith("done: step 4 in 0m"), done
    pytest.importorskip("matplotlib")
    from support import report
    titles = []
    monkeypatch.setattr(report, "save_figure",
                        lambda fig, *a, **k: titles.append(fig._suptitle.get_text()))
    report.plot_run(tmp_path, tmp_path / "curves.png")
    assert titles == [f"{tmp_path}: 4 steps in {speed.clock(times[-1])}"]
