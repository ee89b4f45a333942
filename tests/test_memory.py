"""lab/memory.py's plan against the real model: the meta trace saves exactly what a CPU training
forward saves (flash kernel, math kernel and bf16 autocast alike), the plan's activations match the
allocator's measured peak, which activation checkpointing lowers, the parameter counts are the
model's and the paper's, FSDP shards the states, the extrapolated terms equal a trace, the largest
micro batch fits; `train.py --memory_plan=True` prints the report and trains nothing, or says in
one line what it lacks."""
from dataclasses import asdict, fields

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import train
from baselines import BaselineConfig, build_model, make_config
from bench_cache import measured_peak
from conftest import tiny_config
from helpers import ROOT, cli
from lab import memory

# Every model class, small (a meta trace runs its element-wise ops in Python).
VALUE = dict(depth_mode="value", n_layer=3, depth_stride=1)
KV_LOOPED = dict(depth_mode="kv", n_layer=2, n_loops=2)
DENSEFORMER = dict(depth_mode="vanilla", n_layer=2, residual="denseformer")
ATTNRES = dict(depth_mode="vanilla", n_layer=2, residual="attnres", attnres_block_size=2)
MHC = dict(depth_mode="vanilla", n_layer=2, residual="mhc", mhc_num_streams=2,
           mhc_sinkhorn_iters=1)
LIME, KEYLESS = dict(depth_mode="lime", n_layer=2), dict(attention="keyless", n_layer=2)
B, T = 2, 32


def cpu_saved(config, bf16=False):
    """Bytes the real CPU model's training forward saves, distinct storages, outputs included."""
    torch.manual_seed(0)
    model = build_model(asdict(config))
    idx = torch.randint(0, config.vocab_size, (B, T))
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        saved = memory.SavedTensors(model).run(idx, idx)
    return saved.total(saved.saved())


@pytest.mark.parametrize("keys", [VALUE, KV_LOOPED, DENSEFORMER, ATTNRES, MHC, LIME, KEYLESS],
                         ids=str)
def test_the_meta_trace_saves_what_a_cpu_forward_saves_and_counts_its_parameters(keys):
    """Tolerance: none. The CPU runs PyTorch's flash kernel, which the meta trace emulates, and
    under bf16 autocast saves what the emulated autocast saves, its weight copies included."""
    config = tiny_config(**keys)
    meta = memory.trace(config, B, T)
    assert meta.total(meta.saved()) == cpu_saved(config)
    autocast = memory.trace(config, B, T, bf16=True)
    assert autocast.total(autocast.saved()) + autocast.copy_bytes() == cpu_saved(config, True)
    counts, model = memory.param_counts(memory.meta_model(config)), build_model(asdict(config))
    outside = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    assert (counts["total"], counts["root"], counts["block"]) == \
        (model.num_params(), sum(p.numel() for p in outside), max(blocks))


def test_a_block_saves_what_one_more_layer_adds():
    """by_block's share of a block (docs/memory.md's breakdown) is what the model saves more with
    that block than without it (vanilla: every block alike); the labels split the trace."""
    shallow, deep = (memory.trace(tiny_config(depth_mode="vanilla", n_layer=n), B, T)
                     for n in (1, 2))
    assert deep.total(deep.saved()) - shallow.total(shallow.saved()) == deep.by_block()[1] > 0
    assert deep.by_block()[memory.OUTSIDE] == shallow.by_block()[memory.OUTSIDE] > 0
    assert set(deep.by_block()) == {0, 1, memory.OUTSIDE}


def test_flash_keeps_a_logsumexp_where_math_keeps_the_probabilities():
    """The flash emulation's claim, checked on CPU: forced onto the math kernel, a CPU forward saves
    what meta's own math path saves, the (B, H, T, T) probabilities among it; the flash kernel
    (CPU's default here) keeps a (B, H, T) float32 logsumexp instead, and saves less."""
    config = tiny_config(**VALUE)
    with sdpa_kernel(SDPBackend.MATH):
        math_bytes = cpu_saved(config)
    traces = {flash: memory.trace(config, B, T, flash=flash) for flash in (True, False)}
    assert traces[False].total(traces[False].saved()) == math_bytes > \
        traces[True].total(traces[True].saved())
    shapes = {flash: {(tuple(t.shape), t.dtype) for t in s.keep} for flash, s in traces.items()}
    H = config.n_head
    assert ((B, H, T), torch.float32) in shapes[True] - shapes[False]
    assert ((B, H, T, T), torch.float32) in shapes[False] - shapes[True]


def test_the_plan_matches_the_allocator_peak_which_checkpointing_lowers():
    """The plan's activations against torch.profiler's peak of a real CPU forward and backward
    (float32), within 1% (the peak is at the loss's backward: the plan has every byte of it) and
    with activation checkpointing 10% (a unit's own backward temporaries are not in the plan); the
    measured peak with checkpointing is below half the peak without, and so is the plan's."""
    config = tiny_config(depth_mode="value", vocab_size=256, block_size=256, n_layer=4,
                         n_embd=64, n_head=4, head_dim=16, mlp_hidden=192)
    torch.manual_seed(0)
    model = build_model(asdict(config))
    idx = torch.randint(0, config.vocab_size, (B, 256))
    peak, plan = {}, {}
    for ac in (False, True):
        peak[ac] = measured_peak(model, idx, ac)
        plan[ac] = memory.plan(config, B, 256, 1, "ddp", ac, bf16=False)["activations"]
        assert abs(plan[ac] / peak[ac] - 1) <= (0.10 if ac else 0.01), (ac, plan[ac], peak[ac])
    assert peak[True] < 0.5 * peak[False] and plan[True] < 0.5 * plan[False], (peak, plan)


@pytest.mark.parametrize("name, billions", [("paper_410m_value", 0.46),
                                            ("paper_1p5b_value", 1.34),
                                            ("paper_3b_value", 2.75)])
def test_the_paper_shapes_have_the_papers_parameter_counts(name, billions):
    cfg = train.read_config_file(ROOT / "configs" / f"{name}.py", train.table(True))
    config = make_config(**{k: v for k, v in cfg.items()
                            if k in {f.name for f in fields(BaselineConfig)}})
    assert round(memory.param_counts(memory.meta_model(config))["total"] / 1e9, 2) == billions


@pytest.mark.parametrize("bf16", [False, True])
def test_fsdp_shards_the_states_and_checkpointing_lowers_every_estimate(bf16):
    config = tiny_config(**VALUE)
    ddp = memory.plan(config, B, T, 8, "ddp", False, bf16)
    fsdp = memory.plan(config, B, T, 8, "fsdp", False, bf16)
    for key in ("weights", "gradients", "optimizer"):
        assert fsdp[key] == pytest.approx(ddp[key] / 8, abs=1)
    assert fsdp["gathered"] > 0
    assert memory.plan(config, B, T, 1, "fsdp", False, bf16)["weights"] == ddp["weights"]
    for keys in (VALUE, ATTNRES, MHC):  # the baselines recompute their own units
        for parallel in memory.PARALLEL:
            off, on = (memory.plan(tiny_config(**keys), B, T, 8, parallel, ac, bf16)
                       ["activations"] for ac in (False, True))
            assert on < off, (keys, parallel)


@pytest.mark.parametrize("keys, parallel, bf16", [(VALUE, "ddp", True), (KV_LOOPED, "ddp", False),
                                                  (MHC, "fsdp", True)], ids=str)
def test_the_extrapolated_terms_equal_a_trace(keys, parallel, bf16):
    """Beyond two sequences the plan's terms are extrapolated; a trace at five gives the same
    bytes."""
    config = tiny_config(**keys)
    direct = memory._traced(type(config), tuple(asdict(config).items()), 5, T, parallel, bf16)
    names = ("params", "saved", "kept", "recomputes", "loss_grads", "copies")
    assert dict(zip(names, direct)) == memory.traced(config, 5, T, parallel, bf16)


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
    assert memory.largest_micro_batch(*args, 2 ** 28) < largest[-1]  # the default headroom


MODEL = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--head_dim=16",
         "--mlp_hidden=64", "--block_size=64"]


def test_train_py_prints_the_plan_and_trains_nothing(tmp_path, monkeypatch):
    """The report of the model asked for (bf16, the default on a GPU), a row per world size,
    parallel mode and checkpointing, a tiny model's in MiB with digits that differ; under
    torchrun rank 0 alone prints it."""
    args = [*MODEL, "--vocab_size=300", f"--out_dir={tmp_path / 'run'}", "--memory_plan=True",
            "--micro_batch=2", "--batch_tokens=512"]
    code, out, err = cli("train.py", *args)
    assert code == 0 and not (tmp_path / "run").exists(), err  # nothing trained, nothing written
    config = make_config(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, head_dim=16, mlp_hidden=64,
                         block_size=64, vocab_size=300)
    assert out == memory.report(config, 2, 64, bf16=True) + "\n"
    assert out.startswith(f"{build_model(asdict(config)).num_params():,} parameters")
    assert " MiB per GPU" in out.splitlines()[0]
    rows = out.splitlines()[2:]
    assert len(rows) == 8 and len({row.split()[8] for row in rows}) > 1
    assert all(float(row.split()[8]) > 0.5 for row in rows)  # the total, in MiB
    monkeypatch.setenv("RANK", "1")
    assert cli("train.py", *args) == (0, "", "")


@pytest.mark.parametrize("args, world, message", [
    ([], 1, "--memory_plan needs --micro_batch"),
    (["--micro_batch=2", "--vocab_size=None"], 1, "--memory_plan needs --vocab_size"),
    (["--micro_batch=3"], 1, "--micro_batch=2 keeps the run"),
    (["--micro_batch=8"], 2, "--micro_batch=4 keeps the run"),  # 8 rows, 4 a rank
])
def test_the_plan_refuses_in_one_line_what_train_py_would(args, world, message, tmp_path,
                                                          monkeypatch):
    """A --micro_batch train.py would refuse at the launch's world size (the plan once took it),
    no --micro_batch, no vocabulary (no --vocab_size and no prepared data to read it from)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code, out, err = cli("train.py", *MODEL, "--vocab_size=300", "--batch_tokens=512",
                         f"--data_root={tmp_path}", "--memory_plan=True", *args)
    line = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and line.startswith("error: ") and message in line, err
