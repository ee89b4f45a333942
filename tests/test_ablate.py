"""ablate.py end to end on a tiny config: two runs x one seed, a couple of steps, the table and both figures."""
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def ablate(*args):
    proc = subprocess.run([sys.executable, "ablate.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, f"ablate.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def sweep(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    base = out / "base.py"  # the CPU base, shrunk further
    base.write_text(f'dataset = "tiny"\ndata_root = "{data_root}"\nn_layer = 4\nn_head = 2\nn_kv_head = 1\n'
                    f'head_dim = 8\nn_embd = 16\nmlp_hidden = 32\nblock_size = 32\nmicro_batch = 4\n'
                    f'batch_tokens = 128\nmax_iters = 3\neval_interval = 2\neval_seqs = 4\n')
    args = [f"--base={base}", f"--out={out}", "--runs=vanilla,value", "--seeds=1", "--jobs=2"]
    ablate(*args, "--", "--stop_at_step=2")  # an interrupted sweep: every run stops after step 2
    interrupted = {run: [json.loads(l)["step"] for l in (out / run / "seed0" / "log.jsonl").read_text().splitlines()]
                   for run in ("vanilla", "value")}
    return out, args, ablate(*args), interrupted


def test_a_partial_sweep_is_resumed(sweep):
    out, _, _, interrupted = sweep
    for run, steps in interrupted.items():
        assert max(steps) == 2, f"{run} should have stopped at step 2"
        log = [json.loads(l) for l in (out / run / "seed0" / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log if r["kind"] == "train"] == [1, 2, 3], "resumed, not restarted"
        assert "starting fresh" not in (out / run / "seed0" / "train.out").read_text()


def test_sweep_writes_the_table_and_figures(sweep):
    out, _, stdout, _ = sweep
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"vanilla", "value"}
    mixing = next(t for t in results["tables"] if t["title"].startswith("Mixing rule"))
    assert [r["run"] for r in mixing["rows"]] == ["vanilla", "value"]
    for run in ("vanilla", "value"):
        evals = [json.loads(l) for l in (out / run / "seed0" / "log.jsonl").read_text().splitlines()]
        final = [r["val_loss"] for r in evals if r["kind"] == "eval" and r["step"] == 3]
        assert results["runs"][run]["losses"] == final  # the table reads the runs' own final evaluations
    value = next(r for r in mixing["rows"] if r["run"] == "value")
    assert value["diff"] == pytest.approx(results["runs"]["value"]["mean"] - results["runs"]["vanilla"]["mean"])
    assert value["paper"] == 2.2115 and value["std"] is None  # one seed: no spread to report
    assert "| value | 1 |" in (out / "results.md").read_text() and "| value | 1 |" in stdout
    for png in ("curves.png", "depth_weights.png"):
        img = matplotlib.image.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and np.ptp(img) > 0, f"{png} is empty"


def test_rerun_skips_finished_runs(sweep):
    out, args, _, _ = sweep
    before = (out / "value" / "seed0" / "log.jsonl").read_text()
    assert "value seed 0: done already" in ablate(*args)
    assert (out / "value" / "seed0" / "log.jsonl").read_text() == before


def test_depth_weight_matrix_rows_are_distributions(sweep):
    sys.path.insert(0, str(ROOT))
    from ablate import depth_weight_matrix
    m = depth_weight_matrix(sweep[0] / "value" / "seed0" / "ckpt.pt", n_windows=2)
    assert np.isnan(m[0]).all()  # layer 0 only stores
    assert np.allclose(np.nansum(m[1:], 1), 1.0)
    assert not np.isnan(m[3, [0, 2, 3]]).any() and np.isnan(m[3, 1])  # 4 layers, stride 2: layer 3 reads 0, 2


def test_main_comparison_table(tmp_path):
    """Table 1 at CPU scale: the five runs paired by seed, with perplexity = exp(val loss) and the paper's 3B figures."""
    sys.path.insert(0, str(ROOT))
    from ablate import MAIN, RUN_SETS, markdown, summarize
    assert RUN_SETS["main"] == ["vanilla", "value", "denseformer", "attnres", "mhc"]
    assert set(RUN_SETS["main"]) | set(RUN_SETS["ablations"]) == set(RUN_SETS["all"])
    losses = {"vanilla": [2.0, 2.2], "value": [1.9, 2.0], "denseformer": [1.95, 2.1], "attnres": [2.0, 2.1],
              "mhc": [2.05, 2.15]}
    for run, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            d = tmp_path / run / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps({"max_iters": 10}))
            (d / "log.jsonl").write_text(json.dumps({"kind": "eval", "step": 10, "val_loss": loss}) + "\n")
    _, tables = summarize(tmp_path, MAIN, 2)
    main = tables[0]
    assert main["main"] and [r["run"] for r in main["rows"]] == MAIN
    value = main["rows"][1]
    assert value["diff"] == pytest.approx(-0.15) and value["ppl"] == pytest.approx((np.exp(1.9) + np.exp(2.0)) / 2)
    md = markdown(tables)
    assert "| value | 2 | 1.9500 ± 0.0707 | -0.1500 ± 0.0707 | -3.0 | 7.037 ± 0.497 | 7.25 | 55.69 |" in md
    assert "| mhc | 2 |" in md and "| n/a | 54.68 |" in md
