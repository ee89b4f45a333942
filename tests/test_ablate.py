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
    # vocab_size = None as in the shipped bases: a resumed run must accept it (the data's vocabulary)
    base.write_text(f'dataset = "tiny"\ndata_root = "{data_root}"\nvocab_size = None\nn_layer = 4\nn_head = 2\n'
                    f'n_kv_head = 1\nhead_dim = 8\nn_embd = 16\nmlp_hidden = 32\nblock_size = 32\nmicro_batch = 4\n'
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


@pytest.fixture(scope="module")
def protocols(data_root, tmp_path_factory):
    """The per-method learning-rate protocols on the tiny config: sweep, best rate, longer runs."""
    out = tmp_path_factory.mktemp("protocols")
    base = out / "base.py"
    base.write_text(f'dataset = "tiny"\ndata_root = "{data_root}"\nn_layer = 4\nn_head = 2\nn_kv_head = 1\n'
                    f'head_dim = 8\nn_embd = 16\nmlp_hidden = 32\nblock_size = 32\nbatch_tokens = 128\n'
                    f'max_iters = 4\neval_interval = 2\neval_seqs = 4\nlearning_rate = 1e-2\n')
    common = [f"--base={base}", f"--out={out}", "--runs=vanilla,value", "--lrs=1e-3,1e-2", "--jobs=2"]
    ablate(*common, "--protocol=lr_sweep")
    best_lr = ablate(*common, "--protocol=best_lr", "--seeds=2")
    ablate(*common, "--protocol=long", "--long_runs=vanilla,value", "--long_factor=2", "--seeds=2")
    return out, best_lr


def final(out, run, lr, seed, sub="lr"):
    log = [json.loads(l) for l in (out / run / f"{sub}{lr:g}" / f"seed{seed}" / "log.jsonl").read_text().splitlines()]
    return [r for r in log if r["kind"] == "eval"]


def test_lr_sweep_picks_each_runs_best_rate(protocols):
    out, best_lr = protocols
    sweep = json.loads((out / "results_lr_sweep.json").read_text())
    for run in ("vanilla", "value"):
        losses = {lr: final(out, run, lr, 0)[-1]["val_loss"] for lr in (1e-3, 1e-2)}
        assert sweep["means"][run] == {f"{lr:g}": v for lr, v in losses.items()}
        assert sweep["best"][run] == min(losses, key=losses.get)
    # best_lr reuses the sweep's seed-0 runs at the shared rate (1e-2) and at each best rate
    reused = {(run, lr) for run in ("vanilla", "value") for lr in (1e-2, sweep["best"][run])}
    assert best_lr.count("seed 0 lr") == best_lr.count("done already") == len(reused)


def test_best_lr_reports_both_protocols_paired(protocols):
    out, _ = protocols
    res = json.loads((out / "results_best_lr.json").read_text())
    assert res["shared_rate"] == 1e-2
    for key, rates in (("tables_shared", {"vanilla": 1e-2, "value": 1e-2}), ("tables_best", res["best"])):
        row = next(r for r in res[key][0]["rows"] if r["run"] == "value")
        d = [final(out, "value", rates["value"], s)[-1]["val_loss"] - final(out, "vanilla", rates["vanilla"], s)[-1]
             ["val_loss"] for s in (0, 1)]
        assert row["n"] == 2 and row["diff"] == pytest.approx(np.mean(d)), key
    assert "each at its best peak rate" in (out / "results_best_lr.md").read_text()


def test_long_runs_give_the_gap_against_tokens(protocols):
    out, _ = protocols
    res = json.loads((out / "results_long.json").read_text())
    best = res["best"]
    curve = res["gaps"]["value"]
    runs = {r: [final(out, r, best[r], s, sub="long2x_lr") for s in (0, 1)] for r in ("vanilla", "value")}
    assert [p[0] for p in curve] == [r["step"] * 128 for r in runs["value"][0]]  # steps 0, 2, ..., 8 in tokens
    assert runs["value"][0][-1]["step"] == 8  # twice the base's 4 steps
    d = [runs["value"][s][-1]["val_loss"] - runs["vanilla"][s][-1]["val_loss"] for s in (0, 1)]
    assert curve[-1][1] == pytest.approx(np.mean(d)) and curve[-1][3] == 2
    # beside them, the finished short runs at the same best rates (best_lr's), ending at the base's 4 steps
    short = res["gaps_short"]["value"][-1]
    d = [final(out, "value", best["value"], s)[-1]["val_loss"] - final(out, "vanilla", best["vanilla"], s)[-1]
         ["val_loss"] for s in (0, 1)]
    assert short[0] == 4 * 128 and short[1] == pytest.approx(np.mean(d)) and short[3] == 2
    assert f"| value | short | 0.00 | {short[1]:+.4f} |" in (out / "results_long.md").read_text()
    img = matplotlib.image.imread(out / "gap_vs_tokens.png")
    assert img.ndim == 3 and np.ptp(img) > 0


def test_gap_table_shows_the_short_runs_only_at_their_end():
    """An unfinished short pair's last evaluation is mid-schedule: it must not be labelled as the short runs' end."""
    sys.path.insert(0, str(ROOT))
    from ablate import gap_markdown
    long = {"value": [(0, 0.0, None, 2), (256, -0.02, 0.01, 2), (512, -0.01, 0.005, 2)]}
    unfinished = {"value": [(0, 0.0, None, 2), (256, -0.05, 0.02, 2)]}
    finished = {"value": unfinished["value"] + [(512, -0.04, 0.01, 2)]}
    assert "| short |" not in gap_markdown(long, unfinished, "vanilla", 512)
    md = gap_markdown(long, finished, "vanilla", 512)
    assert md.count("| short |") == 1 and "| value | short | 0.00 | -0.0400 | 0.0100 | 2 |" in md


def test_best_lr_without_a_sweep_fails_clearly(tmp_path):
    proc = subprocess.run([sys.executable, "ablate.py", f"--out={tmp_path}", "--runs=vanilla", "--protocol=best_lr"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "run `python ablate.py --protocol=lr_sweep`" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_main_comparison_table(tmp_path):
    """Table 1 at CPU scale: the five runs paired by seed, with perplexity = exp(val loss) and the paper's 3B figures."""
    sys.path.insert(0, str(ROOT))
    from ablate import MAIN, RUN_SETS, collect, markdown, summarize
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
    _, tables = summarize(collect(tmp_path, MAIN, 2))
    main = tables[0]
    assert main["main"] and [r["run"] for r in main["rows"]] == MAIN
    value = main["rows"][1]
    assert value["diff"] == pytest.approx(-0.15) and value["ppl"] == pytest.approx((np.exp(1.9) + np.exp(2.0)) / 2)
    md = markdown(tables)
    assert "| value | 2 | 1.9500 ± 0.0707 | -0.1500 ± 0.0707 | -3.0 | 7.037 ± 0.497 | 7.25 | 55.69 |" in md
    assert "| mhc | 2 |" in md and "| n/a | 54.68 |" in md
