"""memory.py's plan against the real model: the meta trace saves exactly what a CPU training forward
saves (flash kernel, math kernel and bf16 autocast alike), the plan's activations match the
allocator's measured peak, the parameter counts are the model's, FSDP shards the states,
checkpointing lowers the estimate, and the largest micro batch grows with the card."""
import runpy
import sys
from dataclasses import asdict, fields

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from support.variants import BaselineConfig, build_model, make_config
from conftest import tiny_config
from support import memory
from support.config import read_config_file
from helpers import ROOT

# Every depth mode and baseline, small (a meta trace runs its element-wise ops in Python).
MODES = [dict(depth_mode="value", n_layer=3, depth_stride=1), dict(depth_mode="kv", n_layer=2, n_loops=2),
         dict(depth_mode="key", n_layer=2), dict(depth_mode="uniform", n_layer=2, tie_embeddings=True),
         dict(depth_mode="vanilla", n_layer=2), dict(depth_mode="vanilla", n_layer=2, residual="denseformer"),
         dict(depth_mode="vanilla", n_layer=2, residual="attnres", attnres_block_size=2),
         dict(depth_mode="vanilla", n_layer=2, residual="mhc", mhc_num_streams=2, mhc_sinkhorn_iters=1)]
VALUE, KV_LOOPED, DENSEFORMER, ATTNRES, MHC = MODES[0], MODES[1], MODES[5], MODES[6], MODES[7]
B, T = 2, 32


def cpu_saved(config, bf16=False):
    """Bytes the real CPU model's training forward saves, distinct storages, outputs included."""
    torch.manual_seed(0)
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (B, T))
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        saved = memory.SavedTensors(model).run(idx, idx)
    return saved.total(saved.saved())


@pytest.mark.parametrize("overrides", [VALUE, KV_LOOPED, DENSEFORMER, ATTNRES, MHC], ids=str)
def test_the_meta_trace_saves_what_a_cpu_forward_saves(overrides):
    """Tolerance: none. The CPU runs PyTorch's flash kernel, which the meta trace emulates, and
    under bf16 autocast saves what the emulated autocast saves, its weight copies included."""
    config = tiny_config(**overrides)
    meta = memory.trace(config, B, T)
    assert meta.total(meta.saved()) == cpu_saved(config)
    autocast = memory.trace(config, B, T, bf16=True)
    assert autocast.total(autocast.saved()) + autocast.copy_bytes() == cpu_saved(config, bf16=True)
    assert set(meta.by_block()) == {*range(config.n_layer), memory.OUTSIDE}


def test_a_block_saves_what_one_more_layer_adds():
    """by_block's share of a block is what the model saves more with that block than without it
    (vanilla, where every block is alike): the labelling splits the trace, it does not invent
    bytes."""
    shallow, deep = (memory.trace(tiny_config(depth_mode="vanilla", n_layer=n), B, T) for n in (1,
                                                                                                2))
    assert deep.total(deep.saved()) - shallow.total(shallow.saved()) == deep.by_block()[1] > 0
    assert deep.by_block()[memory.OUTSIDE] == shallow.by_block()[memory.OUTSIDE] > 0


def test_flash_keeps_a_logsumexp_where_math_keeps_the_probabilities():
    """The flash emulation's claim, checked on CPU: forced onto the math kernel, a CPU forward saves
    what meta's own math path saves, the (B, H, T, T) probabilities among it; the flash kernel
    (CPU's default here) keeps a (B, H, T) float32 logsumexp instead, and saves less."""
    config = tiny_config(**VALUE)
    with sdpa_kernel(SDPBackend.MATH):
        math_bytes = cpu_saved(config)
    traces = {flash: memory.trace(config, B, T, flash=flash) for flash in (True, False)}
    assert traces[False].total(traces[False].saved()) == math_bytes > traces[True].total(traces[True].saved())
    shapes = {flash: {(tuple(t.shape), t.dtype) for t in s.keep} for flash, s in traces.items()}
    H = config.n_head
    assert ((B, H, T), torch.float32) in shapes[True] - shapes[False]
    assert ((B, H, T, T), torch.float32) in shapes[False] - shapes[True]


@pytest.mark.parametrize("ac, tolerance", [(False, 0.01), (True, 0.10)])
def test_the_plan_matches_the_allocator_peak_of_a_cpu_step(ac, tolerance):
    """The plan's activations against torch.profiler's peak of a real CPU forward and backward
    (float32). Without checkpointing the peak is at the loss's backward and the plan has every byte
    of it; with checkpointing a unit's own backward temporaries are not in the plan, while the plan
    keeps what is freed before it runs."""
    config = tiny_config(**VALUE, vocab_size=512, n_embd=32)
    torch.manual_seed(0)
    model = build_model(config)
    measured = memory.measured_peak(model, torch.randint(0, config.vocab_size, (B, T)), ac)
    estimate = memory.plan(config, B, T, 1, "ddp", ac, bf16=False)["activations"]
    assert abs(estimate / measured - 1) <= tolerance, f"estimate {estimate} B, measured {measured} B"


@pytest.mark.parametrize("overrides", MODES, ids=str)
def test_parameter_counts_are_the_models(overrides):
    config = tiny_config(**overrides)
    counts = memory.param_counts(memory.meta_model(config))
    assert counts["total"] == build_model(config).num_params()
    assert counts["root"] + config.n_layer * counts["block"] == counts["total"]


def paper_config(name):
    """A config file's model, the keys it does not set at BaselineConfig's defaults (as train.py
    resolves them)."""
    cfg = read_config_file(ROOT / "configs" / f"{name}.py")
    return make_config(**{k: v for k, v in cfg.items() if k in {f.name
                                                                for f in fields(BaselineConfig)}})


@pytest.mark.parametrize("name, billions", [("paper_410m_value", 0.46), ("paper_1p5b_value", 1.34),
                                            ("paper_3b_value", 2.75)])
def test_the_paper_shapes_have_the_papers_parameter_counts(name, billions):
    config = paper_config(name)
    assert round(memory.param_counts(memory.meta_model(config))["total"] / 1e9, 2) == billions


@pytest.mark.parametrize("bf16", [False, True])
def test_fsdp_shards_the_states_over_the_world(bf16):
    config = tiny_config(**VALUE)
    ddp = memory.plan(config, B, T, 8, "ddp", False, bf16)
    fsdp = memory.plan(config, B, T, 8, "fsdp", False, bf16)
    for key in ("weights", "gradients", "optimizer"):
        assert fsdp[key] == pytest.approx(ddp[key] / 8, abs=1)
    assert fsdp["gathered"] > 0 and memory.plan(config, B, T, 1, "fsdp", False,
                                                bf16)["weights"] == ddp["weights"]


@pytest.mark.parametrize("overrides", [VALUE, ATTNRES, MHC], ids=str)
def test_checkpointing_lowers_the_estimate(overrides):
    config = tiny_config(**overrides)
    for parallel in memory.PARALLEL:
        off, on = (memory.plan(config, B, T, 8, parallel, ac, True)["activations"] for ac in (False,
                                                                                              True))
        assert on < off


@pytest.mark.parametrize("overrides, parallel, bf16", [(VALUE, "ddp", True), (KV_LOOPED, "ddp",
                                                                              False), (MHC, "fsdp",
                                                                                       True)],
                         ids=str)
def test_the_extrapolated_terms_equal_a_trace(overrides, parallel, bf16):
    """Beyond two sequences the plan's terms are extrapolated; a trace at five gives the same
    bytes."""
    config = tiny_config(**overrides)
    direct = memory._traced(type(config), tuple(asdict(config).items()), 5, T, parallel, bf16)
    keys = ("params", "saved", "kept", "recomputes", "loss_grads", "copies")
    assert dict(zip(keys, direct)) == memory.traced(config, 5, T, parallel, bf16)


def test_the_largest_micro_batch_fits_and_grows_with_the_card():
    config = tiny_config(**VALUE)
    args = (config, T, 8, "fsdp", True, True)
    states = memory.plan(config, 1, T, 8, "fsdp", True, True)["total"]
    cards = [states, 2 * states, 2 ** 20, 2 ** 24, 2 ** 28]
    no_headroom = (0.0, 0)
    largest = [memory.largest_micro_batch(*args, card, no_headroom) for card in cards]
    assert largest[0] == 1 and largest == sorted(largest) and largest[-1] > largest[-2]
    for card, mb in zip(cards, largest):
        assert memory.plan(config, mb, T, 8, "fsdp", True, True)["total"] <= card
        assert memory.plan(config, mb + 1, T, 8, "fsdp", True, True)["total"] > card
    assert memory.largest_micro_batch(*args, states - 1, no_headroom) == 0
    # the default headroom leaves room
    assert memory.largest_micro_batch(*args, 2 ** 28) < largest[-1]


def test_the_report_has_a_row_per_setting():
    config = tiny_config(**VALUE)
    lines = memory.report(config, 2, T, bf16=True, gpu_gbs=(0.001, 2), worlds=(1, 8)).splitlines()
    assert len(lines) == 2 + 2 * 2 * 2
    assert lines[1].split()[:4] == ["world", "parallel", "act_ckpt", "weights"]
    assert all(row.split()[-2] == "-" and row.split()[-1].isdigit() for row in lines[2:])


def train_py(monkeypatch, capsys, *args):
    """train.py as a user runs it, in this process: (exit message or None, stdout)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as e:
        captured = capsys.readouterr()
        return (captured.err.strip().splitlines()[-1] if e.code else None), captured.out
    return None, capsys.readouterr().out


def test_train_py_prints_the_plan_and_trains_nothing(monkeypatch, capsys, tmp_path):
    model = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--head_dim=16",
             "--mlp_hidden=64", "--block_size=64", "--vocab_size=300",
             f"--out_dir={tmp_path / 'run'}"]
    planned, report = [], memory.report
    monkeypatch.setattr(memory, "report", lambda *args, **kw: planned.append((args, kw))
                        or report(*args, **kw))
    error, out = train_py(monkeypatch, capsys, *model, "--micro_batch=2", "--memory_plan=True")
    assert error is None and not (tmp_path / "run").exists()  # nothing trained, nothing written
    (config, micro_batch, block_size), kw = planned[0]
    assert (config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.head_dim,
            config.mlp_hidden, config.vocab_size, micro_batch, block_size, kw) == (2, 32, 2, 1, 16,
                                                                                   64, 300, 2, 64,
                                                                                   {"bf16": True})
    # the plan of the model asked for, as printed
    assert out == report(config, 2, 64, bf16=True) + "\n"
    error, _ = train_py(monkeypatch, capsys, *model, "--memory_plan=True")
    assert error.startswith("error: --memory_plan needs --micro_batch")
    error, _ = train_py(monkeypatch, capsys, *model[:-2], "--micro_batch=2", "--memory_plan=True",
                        f"--data_root={tmp_path}")
    assert error.startswith("error: --memory_plan needs --vocab_size")


def test_the_plan_checks_the_layout_prints_once_and_shows_a_tiny_model(monkeypatch, capsys,
                                                                       tmp_path):
    """Found by trying it: the plan took a --micro_batch train.py refuses, every torchrun rank
    printed the table, and a tiny model read 0.00 GiB in every column (and 0.0M parameters)."""
    model = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--head_dim=16",
             "--mlp_hidden=64", "--block_size=64", "--vocab_size=300",
             f"--out_dir={tmp_path / 'run'}", "--memory_plan=True"]
    error, _ = train_py(monkeypatch, capsys, *model, "--micro_batch=3", "--batch_tokens=512")
    assert error.startswith("error: micro_batch=3 must divide this rank's share") and "--micro_batch=2" in error
    # 8 rows over 2 ranks: 4 each, which 4 divides and 8 does not
    monkeypatch.setenv("WORLD_SIZE", "2")
    error, _ = train_py(monkeypatch, capsys, *model, "--micro_batch=8", "--batch_tokens=512")
    assert "--micro_batch=4" in error
    error, out = train_py(monkeypatch, capsys, *model, "--micro_batch=4", "--batch_tokens=512")
    params = build_model(make_config(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, head_dim=16,
                                     mlp_hidden=64, block_size=64, vocab_size=300)).num_params()
    assert error is None and out.startswith(f"{params:,} parameters") and " MiB per GPU" in out
    totals = [float(row.split()[8]) for row in out.splitlines()[2:]]
    assert len(totals) == 8 and min(totals) > 1  # in MiB, each with digits that differ
    monkeypatch.setenv("RANK", "1")
    assert train_py(monkeypatch, capsys, *model, "--micro_batch=4", "--batch_tokens=512") == (None,
                                                                                              "")
