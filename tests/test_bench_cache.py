"""bench_cache.py end to end on a tiny model: the JSON it writes (every mode's cache read from the
cache object, the peaks, the ratios to vanilla) and the paper's Table 2 it reproduces; transformers'
Qwen3 computes vanilla's logits on vanilla's weights, so its timings compare like with like; bad
input stops it in one `error:` line before it measures."""
import json
import math

import pytest
import torch

import bench_cache
from configurator import UserError
from helpers import cli

GiB = 2 ** 30
TINY_BENCH = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--n_kv_head=2", "--head_dim=16",
              "--mlp_hidden=128", "--block_size=64", "--batch=2", "--prompt_len=32",
              "--new_tokens=4", "--warmup=0", "--repeats=1", "--device=cpu"]


@pytest.fixture
def threads():
    """bench_cache.py sets torch's thread count (--threads); the suite's is put back after."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_cache_writes_its_json_and_the_papers_table_2(tmp_path, threads):
    out = tmp_path / "bench.json"
    code, stdout, err = cli("bench_cache.py", *TINY_BENCH, f"--json={out}",
                            "--modes=value,mhc,keyless,keyless+value")
    assert code == 0, err[-3000:]
    res = json.loads(out.read_text())
    modes = res["modes"]
    assert list(modes) == ["vanilla", "value", "mhc", "keyless", "keyless+value"]
    # The paper's claim, read from the cache objects: mixing changes no byte of the persistent
    # state, nor do the hidden-state baselines; a keyless cache holds V alone, half.
    assert modes["vanilla"]["cache_bytes"] > 0
    for label, m in modes.items():
        assert m["ratios"]["cache_bytes"] == (0.5 if label.startswith("keyless") else 1.0), label
        assert m["prefill_peak_bytes"] >= m["cache_bytes"], label  # the peak allocates the cache
        assert m["train_peak_bytes"] > 0 and m["baseline"] == "vanilla", label
        assert set(m["ratios"]) == set(bench_cache.METRICS)
        assert all(math.isfinite(r) and r > 0 for r in m["ratios"].values()), (label, m["ratios"])
        assert (m["depth_cost"] is None) == (label == "mhc"), label  # not a baseline's formulas
    assert modes["vanilla"]["depth_cost"]["flops_per_token"] == 0 < \
        modes["value"]["depth_cost"]["flops_per_token"]
    t2 = res["paper_3b_table2"]
    da, rows = t2["rows"]["Depth-Attention"], t2["rows"]
    assert t2["candidates"] == 117
    assert da["flops_per_token"] == 4 * 512 * 117 and round(da["flops_per_token"], -3) == 2.40e5
    assert da["io_bytes_per_token"] == 2 * (2 * 117 + 48) * 512 == 282 * 1024
    assert da["extra_prefill_bytes_128k"] == 0
    assert [rows[n]["extra_prefill_bytes_128k"] for n in ("DenseFormer", "AttnRes", "mHC")] == \
        [24 * GiB, 4 * GiB, 1.5 * GiB]
    assert f"wrote {out}" in stdout


def test_transformers_mode_computes_what_vanilla_computes_on_vanillas_weights(threads):
    """The same logits and loss; its cached decode (DynamicCache) equals its full forward; one set
    of weights serves both (a tied head under both names), as the benchmark shares them."""
    cfg = bench_cache.resolve([*TINY_BENCH, "--modes=vanilla,transformers",
                               "--tie_embeddings=True"])
    ours, theirs = (bench_cache.build(cfg, mode).eval() for mode in ("vanilla", "transformers"))
    toks, P = bench_cache.tokens(cfg), cfg["prompt_len"]
    with torch.no_grad():
        (mine, my_loss), (ref, loss) = (m(toks[:, :P], targets=toks[:, 1:P + 1])
                                        for m in (ours, theirs))
        cache = theirs.new_cache(cfg["batch"], P + 1)
        theirs(toks[:, :P - 1], cache=cache)
        last, _ = theirs(toks[:, P - 1:P], cache=cache)
    assert (mine - ref).abs().max() < 1e-4 and abs(my_loss - loss) < 1e-5
    assert (last[:, -1] - ref[:, -1]).abs().max() < 1e-4
    assert bench_cache.cache_nbytes(cache) == 2 * 2 * cfg["batch"] * 2 * P * 16 * 4  # K, V of P
    assert theirs.num_params() == ours.num_params()
    assert bench_cache.share_weights(theirs.hf, ours, lambda n: n.removeprefix("model.")) == []
    assert {id(p) for p in theirs.parameters()} == {id(p) for p in ours.parameters()}
    assert theirs.hf.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.parametrize("flags, expected", [
    (["--prompt_len=60", "--new_tokens=8"], "60 + 8 = 68 exceeds the model's block_size 64"),
    (["--threads=100000"], "cores"),  # used to hang
    ([f"--seed={2 ** 64}"], "below 2**64"),
    (["--modes=value@0"], "mode value@0: "),  # it named the baseline added for it, vanilla@0
    (["--modes=vanilla,transformers", "--n_loops=2"], "transformers' Qwen3"),
    (["--repeats=0"], "--repeats must be a finite number >= 1, got 0"),
    (["--json={tmp}"], "--json={tmp}"),  # a folder
    (["--json={tmp}/mine.json"], "--json={tmp}/mine.json"),  # a file bench_cache.py did not write
    (["--batch=1000000000000"], "out of memory"),
])
def test_bad_input_is_one_line(flags, expected, tmp_path, threads, monkeypatch):
    """Checked before the benchmark measures (which takes minutes at a real size), but for the
    batch no machine holds, whose allocation error is said in one line."""
    (tmp_path / "mine.json").write_text('{"modes": {}}')
    if "out of memory" not in expected:
        monkeypatch.setattr(bench_cache, "measure", lambda cfg: pytest.fail("measured"))
    flags = [f.format(tmp=tmp_path) for f in flags]
    with pytest.raises(UserError) as stop:
        bench_cache.main([*TINY_BENCH, *flags])
    assert "\n" not in str(stop.value) and expected.format(tmp=tmp_path) in str(stop.value)
    assert (tmp_path / "mine.json").read_text() == '{"modes": {}}'
