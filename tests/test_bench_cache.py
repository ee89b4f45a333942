"""bench_cache.py end to end on a tiny model: the JSON it writes, and the paper's Table 2 it
reproduces; bad input stops it with one `error:` line before it measures."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench_cache
from support.errors import USER_ERRORS, ShowHelp
from helpers import ROOT

GiB = 2 ** 30

# A big vocabulary on purpose: the prefill's logits (2 x 32 x 50304 floats, 12 MiB) must raise the
# RSS of the measuring process well above page noise, or a peak of 0 would pass for "measured".
TINY_BENCH = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--n_kv_head=2", "--head_dim=16", "--mlp_hidden=128",
        "--block_size=64", "--batch=2", "--prompt_len=32", "--new_tokens=4", "--warmup=1", "--repeats=1",
        "--device=cpu", "--modes=vanilla,value,mhc,keyless,keyless+value"]


def test_bench_cache_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench_cache.py"), *TINY_BENCH,
                           f"--json={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    modes = res["modes"]
    assert list(modes) == ["vanilla", "value", "mhc", "keyless", "keyless+value"]

    # The paper's claim, read from the cache object itself: mixing changes no byte of the persistent
    # state, and neither do the hidden-state baselines. A keyless cache holds V alone: half, with
    # or without the depth step.
    keyed = [m for label, m in modes.items() if not label.startswith("keyless")]
    assert {m["cache_bytes"] for m in keyed} == {modes["vanilla"]["cache_bytes"]} and \
        modes["vanilla"]["cache_bytes"] > 0
    assert modes["value"]["ratios"]["cache_bytes"] == 1.0
    assert modes["keyless"]["ratios"]["cache_bytes"] == modes["keyless+value"]["ratios"][
        "cache_bytes"] == 0.5
    for label, m in modes.items():
        # The measured prefill peak includes allocating the cache, so it cannot be below the cache's
        # size.
        assert m["prefill_peak_bytes"] >= m["cache_bytes"], (label, m["prefill_peak_bytes"], m["cache_bytes"])
        assert m["train_peak_bytes"] > 0, label  # at least the gradients
        for metric, ratio in m["ratios"].items():
            assert math.isfinite(ratio) and ratio > 0, (label, metric, ratio)
        assert set(m["ratios"]) == {"cache_bytes", "prefill_peak_bytes", "train_peak_bytes",
                                    "prefill_s", "decode_s_per_token", "train_step_s"}
        assert m["baseline"] == "vanilla"
        if label in ("denseformer", "attnres", "mhc"):
            assert m["depth_cost"] is None  # the depth step's formulas do not describe a baseline
        else:
            assert m["depth_cost"]["extra_persistent_bytes"] == 0
    assert modes["vanilla"]["depth_cost"]["flops_per_token"] == 0 < modes["value"]["depth_cost"]["flops_per_token"]

    t2 = res["paper_3b_table2"]
    assert t2["candidates"] == 117
    da = t2["rows"]["Depth-Attention"]
    assert da["flops_per_token"] == 4 * 512 * 117 == 239616                    # 2.40e5
    assert round(da["flops_per_token"], -3) == 2.40e5
    assert da["io_bytes_per_token"] == 2 * (2 * 117 + 48) * 512 == 282 * 1024  # 282 KiB
    assert da["extra_prefill_bytes_128k"] == 0
    rows = t2["rows"]
    assert rows["DenseFormer"]["extra_prefill_bytes_128k"] == 24 * GiB
    assert rows["AttnRes"]["extra_prefill_bytes_128k"] == 4 * GiB
    assert rows["mHC"]["extra_prefill_bytes_128k"] == 1.5 * GiB
    assert (rows["DenseFormer"]["quoted_flops_per_token"],
            rows["AttnRes"]["quoted_flops_per_token"],
            rows["mHC"]["quoted_flops_per_token"]) == (5.01e6, 4.26e6, 4.72e7)


# ----------------------------------------------------------------------------- bad input: one line,
# before measuring

def refused(args, monkeypatch):
    """The one `error:` line bench_cache.py stops with, before it measures anything."""
    def measure(cfg):
        raise AssertionError("measured before the input was checked")
    monkeypatch.setattr(bench_cache, "measure", measure)
    with pytest.raises(USER_ERRORS) as stop:
        bench_cache.main(args)
    msg = f"error: {stop.value}"  # the one line run_main prints
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("flags, expected", [
    # was a traceback
    (["--prompt_len=60", "--new_tokens=8"], "60 + 8 = 68 exceeds the model's block_size 64"),
    (["--prompt_len=64"], "64 + 4 = 68 exceeds the model's block_size 64"),
    (["--prompt_len=100000", "--new_tokens=100000"], "exceeds the model's block_size 64"),
    (["--threads=100000"], "cores"),  # used to hang
    ([f"--seed={2 ** 64}"], "below 2**64"),
    (["--batch=None"], "--batch=None"),
    (["--modes=value@0"], "mode value@0: "),  # it used to name the baseline added for it, vanilla@0
], ids=["prompt_and_new_tokens", "prompt_at_block_size", "huge", "threads", "seed", "batch_none", "loops_0"])
def test_out_of_range_flags_are_one_line(flags, expected, monkeypatch):
    assert expected in refused(TINY_BENCH + flags, monkeypatch)


@pytest.mark.parametrize("flag, expected", [
    ("--repeats=0", "--repeats must be a finite number >= 1, got 0"),
    ("--warmup=-1", "--warmup must be a finite number >= 0, got -1"),
    ("--dtype=float8", "--dtype=float8 is not a choice; did you mean float32? choices: auto, "
                       "float32, bfloat16, float16"),
    ("--attention=dense", "--attention=dense is not a choice; choices: standard, keyless"),
])
def test_the_key_table_refuses_a_value_outside_its_range_or_choices(flag, expected, monkeypatch):
    assert refused(TINY_BENCH + [flag], monkeypatch) == f"error: {expected}"


def test_help_lists_every_key_with_its_default_and_help():
    with pytest.raises(ShowHelp) as usage:
        bench_cache.parse_args(["--help"])
    for key, default in bench_cache.DEFAULTS.items():
        assert f"--{key}={default!r}" in str(usage.value), key
        assert bench_cache.HELP[key] and bench_cache.HELP[key] in str(usage.value), key


def test_prompt_and_new_tokens_may_fill_the_context():
    assert bench_cache.resolve(TINY_BENCH + ["--prompt_len=60",
                                             "--new_tokens=4"])["prompt_len"] == 60


@pytest.mark.parametrize("case", ["folder", "under_a_file", "unwritable", "a_user_file",
                                  "another_programs_json"])
def test_json_path_is_checked_before_measuring(case, tmp_path, monkeypatch):
    """--json used to be opened only after the benchmark, which takes minutes at a real size, and
    replaced any file: now only an earlier result of bench_cache.py is replaced."""
    (tmp_path / "a_file").write_text("mine")
    path = {"folder": tmp_path, "under_a_file": tmp_path / "a_file" / "bench.json",
            "unwritable": Path("/proc/bench.json"),  # /proc takes no new file, even from root
            "a_user_file": tmp_path / "a_file", "another_programs_json": tmp_path / "a_file"}[case]
    if case == "another_programs_json":  # the keys of a bench result, but not bench_cache.py's mark
        (tmp_path / "a_file").write_text('{"modes": {}}')
    msg = refused(TINY_BENCH + [f"--json={path}"], monkeypatch)
    assert f"--json={path}" in msg, msg
    assert (tmp_path / "a_file").read_text() in ("mine", '{"modes": {}}')


def test_out_of_memory_is_one_line(monkeypatch):
    """A batch no machine holds: the allocation error becomes one line, not a traceback."""
    with pytest.raises(USER_ERRORS) as stop:
        bench_cache.main(TINY_BENCH + ["--batch=1000000000000"])
    msg = f"error: {stop.value}"
    assert msg.startswith("error: out of memory") and "--batch=1000000000000" in msg and "\n" not in msg, msg


def test_transformers_mode_computes_what_vanilla_computes():
    """--modes=transformers times transformers' Qwen3 with vanilla's weights: the same logits and
    loss, and its cached decode (DynamicCache) the same as its full forward, so the timings compare
    like with like."""
    cfg = bench_cache.resolve(TINY_BENCH + ["--modes=vanilla,transformers"])
    ours, theirs = bench_cache.build(cfg, "vanilla").eval(), bench_cache.build(cfg, "transformers").eval()
    toks = bench_cache.tokens(cfg)
    P = cfg["prompt_len"]
    with torch.no_grad():
        (mine, my_loss), (ref, loss) = (m(toks[:, :P], targets=toks[:, 1:P + 1]) for m in (ours,
                                                                                           theirs))
        cache = theirs.new_cache(cfg["batch"], P + 1)
        theirs(toks[:, :P - 1], cache=cache)
        last, _ = theirs(toks[:, P - 1:P], cache=cache)
    assert (mine - ref).abs().max() < 1e-4 and abs(my_loss - loss) < 1e-5
    assert (last[:, -1] - ref[:, -1]).abs().max() < 1e-4
    # K and V, 2 layers, P tokens
    assert bench_cache.cache_nbytes(cache) == 2 * 2 * cfg["batch"] * 2 * P * 16 * 4
    assert theirs.num_params() == ours.num_params()


def test_transformers_mode_refuses_what_qwen3_cannot_compute(monkeypatch):
    assert "transformers' Qwen3" in refused(TINY_BENCH + ["--modes=vanilla,transformers",
                                                          "--n_loops=2"], monkeypatch)


def test_transformers_mode_shares_vanilla_weights(tmp_path):
    """One set of weights serves every mode: transformers' Qwen3 is given vanilla's parameters (a
    tied head under both names), so a 1.5B comparison holds one copy and one optimizer state."""
    cfg = bench_cache.resolve(TINY_BENCH + ["--modes=vanilla,transformers",
                                            "--tie_embeddings=True"])
    ref, theirs = bench_cache.build(cfg, "vanilla"), bench_cache.build(cfg, "transformers")
    assert bench_cache.share_weights(theirs.hf, ref, bench_cache.hf.our_name) == []
    ours = {id(p) for p in ref.parameters()}
    assert {id(p) for p in theirs.parameters()} == ours
    assert theirs.hf.lm_head.weight is ref.embed_tokens.weight
