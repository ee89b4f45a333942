"""bench_cache.py end to end on a tiny model: the JSON it writes, and the paper's Table 2 it reproduces."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2 ** 30

# A big vocabulary on purpose: the prefill's logits (2 x 32 x 50304 floats, 12 MiB) must raise the RSS of the
# measuring process well above page noise, or a peak of 0 would pass for "measured".
TINY = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--n_kv_head=2", "--head_dim=16", "--mlp_hidden=128",
        "--block_size=64", "--batch=2", "--prompt_len=32", "--new_tokens=4", "--warmup=1", "--repeats=1",
        "--device=cpu", "--modes=vanilla,value,mhc"]


def test_bench_cache_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench_cache.py"), *TINY, f"--json={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    modes = res["modes"]
    assert list(modes) == ["vanilla", "value", "mhc"]

    # The paper's claim, read from the cache object itself: mixing changes no byte of the persistent state,
    # and neither do the hidden-state baselines.
    assert {m["cache_bytes"] for m in modes.values()} == {modes["vanilla"]["cache_bytes"]} and \
        modes["vanilla"]["cache_bytes"] > 0
    assert modes["value"]["ratios"]["cache_bytes"] == 1.0
    for label, m in modes.items():
        # The measured prefill peak includes allocating the cache, so it cannot be below the cache's size.
        assert m["prefill_peak_bytes"] >= m["cache_bytes"], (label, m["prefill_peak_bytes"], m["cache_bytes"])
        assert m["train_peak_bytes"] > 0, label  # at least the gradients
        for metric, ratio in m["ratios"].items():
            assert math.isfinite(ratio) and ratio > 0, (label, metric, ratio)
        assert set(m["ratios"]) == {"cache_bytes", "prefill_peak_bytes", "train_peak_bytes", "prefill_s",
                                    "decode_s_per_token", "train_step_s"}
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
    assert (rows["DenseFormer"]["quoted_flops_per_token"], rows["AttnRes"]["quoted_flops_per_token"],
            rows["mHC"]["quoted_flops_per_token"]) == (5.01e6, 4.26e6, 4.72e7)
