"""
The paper's ablations (paper section 3.3: Tables 5-6, Figure 4, looped), as a sweep of train.py runs x seeds.

    python ablate.py                                     # the CPU sweep on Shakespeare (about an hour, 2 cores)
    python ablate.py --base=configs/ablations/base.py --out=out/ablate_minipile --seeds=2 --jobs=1 \
        --runs=vanilla,value -- --compile=True           # on a GPU: MiniPile, 85M; after `--`: train.py keys

Every run is the base config, then its delta files from configs/ablations/, then the overrides after `--`,
then --seed and --out_dir: every mode gets the same budget and hyperparameters. A finished run (its log has
the final evaluation) is skipped and a started one resumed from its checkpoint, so re-running the same
command completes a partial sweep. Writes <out>/results.{md,json}, <out>/curves.png and
<out>/depth_weights*.png (matplotlib, optional: `pip install matplotlib`).
"""
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from checkpoint import model_from_checkpoint, read_checkpoint
from configurator import ConfigError, parse_config

ROOT = Path(__file__).resolve().parent
DEFAULTS = {
    "base": "configs/ablations/cpu.py",  # the shared base config; GPU: configs/ablations/base.py
    "out": "out/ablate_cpu",              # one folder per run and seed below it, plus the results
    "runs": "all",                        # comma-separated names from RUNS, or all
    "seeds": 3,                           # seeds 0 .. seeds-1 for every run
    "jobs": 2,                            # train.py processes at once (CPU: one per core, one thread each)
}
# run name -> delta files in configs/ablations/, applied after the base
RUNS = {
    "vanilla": ["mode_vanilla"], "uniform": ["mode_uniform"], "value": ["mode_value"],
    "key": ["mode_key"], "kv": ["mode_kv"],
    "stride_first": ["stride_first"], "stride_quarter": ["stride_quarter"], "stride_full": ["stride_full"],
    "looped_vanilla": ["looped", "mode_vanilla"], "looped_value": ["looped", "mode_value"],
}
# the paper's tables (`value` is also the stride-half run), each compared with its own baseline
TABLES = [
    ("Mixing rule (Table 5)", ["vanilla", "uniform", "value"], "vanilla"),
    ("Updated state (Table 6)", ["vanilla", "key", "kv", "value"], "vanilla"),
    ("Stride (Figure 4)", ["vanilla", "stride_first", "value", "stride_quarter", "stride_full"], "vanilla"),
    ("Looped, 3 loops", ["looped_vanilla", "looped_value"], "looped_vanilla"),
]
# runs whose seed-0 depth weights are drawn like the paper's Figure 3
DEPTH_FIGURES = [("value", "depth_weights.png"), ("stride_full", "depth_weights_full.png"),
                 ("looped_value", "depth_weights_looped.png")]
PAPER = {"vanilla": 2.2348, "uniform": 2.2153, "value": 2.2115, "key": 2.2354, "kv": 2.2198,
         "stride_first": 2.2127, "stride_quarter": 2.2140, "stride_full": 2.2139,
         "looped_vanilla": 2.208, "looped_value": 2.194}  # 500M models, validation loss (paper Tables 5-6, Figure 4)


def read_log(run_dir):
    path = run_dir / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_val_loss(run_dir):
    """The last evaluation's loss if the run finished (evaluated at max_iters), else None."""
    cfg_path, evals = run_dir / "config.json", [r for r in read_log(run_dir) if r["kind"] == "eval"]
    if not cfg_path.exists() or not evals or evals[-1]["step"] != json.loads(cfg_path.read_text())["max_iters"]:
        return None
    return evals[-1]["val_loss"]


def train_one(name, seed, base, extra, out, threads):
    run_dir = out / name / f"seed{seed}"
    if final_val_loss(run_dir) is not None:
        return f"{name} seed {seed}: done already"
    files = [base] + [str(ROOT / "configs" / "ablations" / f"{d}.py") for d in RUNS[name]]
    args = files + extra + [f"--seed={seed}", f"--out_dir={run_dir}", "--sample_tokens=0"]
    if (run_dir / "ckpt.pt").exists():
        args.append("--resume=True")
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(run_dir / "train.out", "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}); see {run_dir / 'train.out'}")
    loss = final_val_loss(run_dir)
    return f"{name} seed {seed}: " + (f"val_loss {loss:.4f}" if loss is not None else "stopped before the end")


def summarize(out, names, seeds):
    """Mean and std over seeds, and the difference to the table's baseline, paired by seed.

    Runs with the same seed start from the same weights (every mode has the same parameters, created in the
    same order) and see the same batches, so the noise that matters is the spread of the per-seed
    differences: Δ/SE = mean(d) / (std(d) / sqrt(n)), d_s = loss(run, s) - loss(baseline, s)."""
    losses = {n: {s: v for s in range(seeds) if (v := final_val_loss(out / n / f"seed{s}")) is not None}
              for n in names}
    stats = {n: {"losses": list(v.values()), "mean": float(np.mean(list(v.values()))),
                 "std": float(np.std(list(v.values()), ddof=1)) if len(v) > 1 else None}
             for n, v in losses.items() if v}
    tables = []
    for title, rows, baseline in TABLES:
        rows = [n for n in rows if n in stats]
        if baseline not in stats or len(rows) < 2:
            continue
        lines = []
        for n in rows:
            d = [losses[n][s] - losses[baseline][s] for s in losses[n] if s in losses[baseline]]
            sd = float(np.std(d, ddof=1)) if len(d) > 1 else None
            lines.append({"run": n, "n": len(stats[n]["losses"]), "mean": stats[n]["mean"], "std": stats[n]["std"],
                          "diff": float(np.mean(d)), "diff_std": sd,
                          "diff_in_se": float(np.mean(d)) / (sd / math.sqrt(len(d))) if sd else None,
                          "paper": PAPER.get(n), "paper_diff": PAPER[n] - PAPER[baseline] if n in PAPER else None})
        tables.append({"title": title, "baseline": baseline, "rows": lines})
    return stats, tables


def markdown(tables):
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)
    out = []
    for t in tables:
        out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, mean ± std over seeds; "
                f"SE = std / √seeds)", "",
                "| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | paper (500M) | paper Δ |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {r['run']} | {r['n']} | {r['mean']:.4f} ± {f(r['std'], '.4f')} | "
                f"{r['diff']:+.4f} ± {f(r['diff_std'], '.4f')} | {f(r['diff_in_se'], '+.1f')} | "
                f"{f(r['paper'], '.4f')} | {f(r['paper_diff'], '+.4f')} |" for r in t["rows"]]
        out.append("")
    return "\n".join(out)


def plot_curves(out, names, seeds, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for n in names:
        curves = [[(r["step"], r["val_loss"]) for r in read_log(out / n / f"seed{s}") if r["kind"] == "eval"]
                  for s in range(seeds)]
        curves = [c for c in curves if c]
        if not curves:
            continue
        k = min(len(c) for c in curves)  # steps every seed has reached
        steps = [st for st, _ in curves[0][:k]]
        mean = np.mean([[v for _, v in c[:k]] for c in curves], 0)
        ax.plot(steps[1:], mean[1:], label=n, ls="--" if n.startswith("looped") else "-")  # skip the step-0 eval
    ax.set(xlabel="step", ylabel="validation loss (mean over seeds)", title="Depth-Attention ablations")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def depth_weight_matrix(ckpt_path, n_windows=16):
    """Average depth weight each effective layer puts on each candidate (its sources, then itself),
    over fixed validation windows, batch rows, KV heads and positions: (L, L), NaN where not a candidate."""
    ckpt = read_checkpoint(ckpt_path)
    model = model_from_checkpoint(ckpt).eval()
    T = model.config.block_size
    val = np.memmap(Path(ckpt["data_dir"]) / "val.bin", dtype=np.uint16, mode="r")
    starts = np.linspace(0, len(val) - T - 1, n_windows).astype(np.int64)
    x = torch.from_numpy(np.stack([val[s:s + T].astype(np.int64) for s in starts]))
    with model.capture_depth_weights() as alphas:
        model(x)
    L = model.config.n_eff_layer
    matrix = np.full((L, L), np.nan)
    for e, (src, a) in alphas.items():
        matrix[e, src + [e]] = a.mean(dim=(0, 1, 2)).numpy()
    return matrix


def plot_depth_weights(ckpt_path, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = depth_weight_matrix(ckpt_path)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, origin="upper")
    for (i, j), v in np.ndenumerate(m):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    ax.set(xlabel="candidate layer (diagonal = the layer itself)", ylabel="layer", title=title)
    fig.colorbar(im, ax=ax, label="mean depth weight")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return m


def main(argv):
    split = argv.index("--") if "--" in argv else len(argv)
    try:
        cfg = parse_config(DEFAULTS, argv[:split], __doc__, [__file__])
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    extra = argv[split + 1:]
    names = list(RUNS) if cfg["runs"] == "all" else cfg["runs"].split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"error: unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if not Path(cfg["base"]).is_file():
        raise SystemExit(f"error: base config {cfg['base']} not found")
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(n, s) for s in range(cfg["seeds"]) for n in names]  # seed-major: early results cover every run
    threads = max(1, (os.cpu_count() or 1) // cfg["jobs"])
    with ThreadPoolExecutor(cfg["jobs"]) as pool:
        for msg in pool.map(lambda job: train_one(*job, cfg["base"], extra, out, threads), jobs):
            print(msg, flush=True)

    stats, tables = summarize(out, names, cfg["seeds"])
    (out / "results.json").write_text(json.dumps({"config": cfg, "train_overrides": extra, "runs": stats,
                                                  "tables": tables}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(tables))
    print(markdown(tables))
    try:
        plot_curves(out, names, cfg["seeds"], out / "curves.png")
        figures = [out / "curves.png"]
        for run, png in DEPTH_FIGURES:
            if run in names:
                plot_depth_weights(out / run / "seed0" / "ckpt.pt", out / png, f"Depth weights, {run}, seed 0")
                figures.append(out / png)
        print("figures:", ", ".join(map(str, figures)))
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)")


if __name__ == "__main__":
    main(sys.argv[1:])
