"""A run says how fast it goes: MFU against a given peak (never an invented one: none on a CPU
without --peak_flops) from 6N + attention's FLOPs per token, the time left, and the run's elapsed
time, which a resume continues; on every printed line and in log.jsonl. A wandb without a login is
one line."""
import sys
import types

import pytest

from checkpoint import load_model, read_checkpoint
from helpers import TINY_SHORT, log_records, train


def test_a_run_says_how_fast_it_goes_across_a_resume(data_root, tmp_path, monkeypatch, capsys):
    args = [*TINY_SHORT, f"--data_root={data_root}", f"--out_dir={tmp_path}", "--max_iters=4",
            "--eval_interval=2", "--log_interval=1"]
    assert train(monkeypatch, *args, "--stop_at_step=2") is None
    first, saved = log_records(tmp_path), read_checkpoint(tmp_path / "ckpt.pt")["elapsed_s"]
    assert train(monkeypatch, *args, "--resume=True", "--peak_flops=1e9") is None
    records = log_records(tmp_path)
    steps = [r for r in records if r["kind"] == "train"]
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert len(steps) == len(lines) == 4 and records[:len(first)] == first
    assert all(" | eta " in x and (" | mfu " in x) == (r["step"] > 2) for x, r in zip(lines, steps))
    assert ["mfu" in r for r in steps] == [False, False, True, True]
    model = load_model(tmp_path).model
    c = model.config
    flops = 6 * model.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
    for r in steps[2:]:
        assert r["mfu"] * 1e9 / r["tok_per_s"] == pytest.approx(flops, rel=1e-9)
    assert all(r["eta_s"] >= 0 for r in steps) and steps[-1]["eta_s"] == 0
    times = [r["elapsed_s"] for r in records]
    assert 0 < times[0] and times == sorted(times) and times[len(first)] > saved, times


def test_wandb_without_a_login_is_one_line_naming_offline_and_login(data_root, tmp_path,
                                                                    monkeypatch):
    """wandb.init with no API key and no terminal raises its UsageError: it was a traceback after
    the run had started."""
    fake, errors = types.ModuleType("wandb"), types.ModuleType("wandb.errors")
    usage = type("UsageError", (Exception,), {"__module__": "wandb.errors"})

    def init(**kwargs):
        raise usage("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
    fake.init, fake.errors, errors.UsageError = init, errors, usage
    monkeypatch.setitem(sys.modules, "wandb", fake)
    line = train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}", f"--out_dir={tmp_path}",
                 "--max_iters=2", "--wandb_log=True")
    assert line.startswith("error: ") and "api_key not configured" in line, line
    assert "WANDB_MODE=offline" in line and "wandb login" in line
