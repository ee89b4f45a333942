r"""
The paper's main comparison (section 3.1, Table 1: vanilla, Depth-Attention and the three hidden-state
baselines) and its ablations (section 3.3: Tables 5-6, Figure 4, looped), as a sweep of train.py runs x seeds.

    python ablate.py --runs=ablations                    # the CPU ablation sweep on Shakespeare (~1 h, 2 cores)
    python ablate.py --runs=main --out=out/ablate_main   # Table 1 at CPU scale: vanilla, value and the baselines
    python ablate.py --base=configs/ablations/base.py --out=out/ablate_minipile --seeds=2 --jobs=1 \
        --runs=vanilla,value -- --compile=True           # on a GPU: MiniPile, 85M; after `--`: train.py keys

Every run is the base config, then its delta files from configs/ablations/, then the overrides after `--`,
then --seed and --out_dir: every mode gets the same budget and hyperparameters. A finished run (its log has
the final evaluation) is skipped and a started one resumed from its checkpoint, so re-running the same
command completes a partial sweep. Writes <out>/results.{md,json}, <out>/curves.png and
<out>/depth_weights*.png (matplotlib, optional: `pip install matplotlib`).

A peak learning rate that suits one method can handicap another, so three more protocols compare each method
at its own best rate and follow the gap as training lengthens (one command each, in this order):

    python ablate.py --protocol=lr_sweep --runs=vanilla,value   # every run at each of --lrs, --lr_seeds seeds
    python ablate.py --protocol=best_lr --runs=vanilla,value    # paired seeds at the shared and the best rates
    python ablate.py --protocol=long --long_runs=vanilla,value  # --long_factor x the steps, at the best rates
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

import paper
from checkpoint import model_from_checkpoint, read_checkpoint
from configurator import ConfigError, arg_updates, check_ranges, fail, parse_config, require

ROOT = Path(__file__).resolve().parent
DEFAULTS = {
    "base": "configs/ablations/cpu.py",  # the shared base config; GPU: configs/ablations/base.py
    "out": "out/ablate_cpu",              # one folder per run and seed below it, plus the results
    "runs": "all",                        # comma-separated names from RUNS or RUN_SETS (all, main, ablations)
    "seeds": 3,                           # seeds 0 .. seeds-1 for every run
    "jobs": 2,                            # train.py processes at once (CPU: one per core, one thread each)
    "threads": 0,                         # torch threads per process; 0 = the cores shared out among the jobs
    "protocol": "shared",                 # shared | lr_sweep | best_lr | long (see the docstring)
    "lrs": "1e-3,2e-3,3e-3,6e-3",         # lr_sweep: the peak learning rates tried for every run
    "lr_seeds": 1,                        # lr_sweep: seeds per rate; best_lr reuses its runs where seed and rate match
    "long_runs": "vanilla,value",         # long: the runs trained longer; the first is the baseline of the gap
    "long_factor": 5,                     # long: this many times the base's max_iters (and tokens)
}
PROTOCOLS = ("shared", "lr_sweep", "best_lr", "long")
# run name -> delta files in configs/ablations/, applied after the base
RUNS = {
    "vanilla": ["mode_vanilla"], "uniform": ["mode_uniform"], "value": ["mode_value"],
    "key": ["mode_key"], "kv": ["mode_kv"],
    "stride_first": ["stride_first"], "stride_quarter": ["stride_quarter"], "stride_full": ["stride_full"],
    "looped_vanilla": ["looped", "mode_vanilla"], "looped_value": ["looped", "mode_value"],
    "denseformer": ["residual_denseformer"], "attnres": ["residual_attnres"], "mhc": ["residual_mhc"],
}
MAIN, MAIN_TITLE = ["vanilla", "value", "denseformer", "attnres", "mhc"], "Main comparison (Table 1 at CPU scale)"
RUN_SETS = {"all": list(RUNS), "main": MAIN, "ablations": [n for n in RUNS if n not in MAIN[2:]]}
# the paper's tables (`value` is also the stride-half run), each compared with its own baseline
TABLES = [
    (MAIN_TITLE, MAIN, "vanilla"),
    ("Mixing rule (Table 5)", ["vanilla", "uniform", "value"], "vanilla"),
    ("Updated state (Table 6)", ["vanilla", "key", "kv", "value"], "vanilla"),
    ("Stride (Figure 4)", ["vanilla", "stride_first", "value", "stride_quarter", "stride_full"], "vanilla"),
    ("Looped, 3 loops", ["looped_vanilla", "looped_value"], "looped_vanilla"),
]
# runs whose seed-0 depth weights are drawn like the paper's Figure 3
DEPTH_FIGURES = [("value", "depth_weights.png"), ("stride_full", "depth_weights_full.png"),
                 ("looped_value", "depth_weights_looped.png")]
PAPER = paper.ABLATION_LOSS  # 500M models, validation loss (paper Tables 5-6, Figure 4)
# The 3B models of Table 1: (Pile validation perplexity or None, zero-shot average over the eight tasks).
PAPER_TABLE1 = {run: (paper.TABLE1_PPL.get(row), paper.TABLE1_AVG[0][row]) for run, row in paper.TABLE1_3B_RUNS.items()}
KEY_RANGES = {"seeds": ">= 1", "jobs": ">= 1", "threads": ">= 0", "lr_seeds": ">= 1", "long_factor": ">= 1"}


def read_log(run_dir):
    path = run_dir / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_val_loss(run_dir):
    """The last evaluation's loss if the run finished (evaluated at max_iters), else None."""
    cfg_path, evals = run_dir / "config.json", [r for r in read_log(run_dir) if r["kind"] == "eval"]
    if not cfg_path.exists() or not evals or evals[-1]["step"] != json.loads(cfg_path.read_text())["max_iters"]:
        return None
    return evals[-1]["val_loss"]


def run_dir(out, name, seed, lr=None, factor=1):
    """out/<run>/seed<s> at the base's own rate (the shared protocol); out/<run>/lr<rate>/seed<s> at an
    explicit peak rate; out/<run>/long<f>x_lr<rate>/seed<s> for f times the steps."""
    d = out / name
    if lr is not None:
        d = d / (f"long{factor}x_lr{lr:g}" if factor > 1 else f"lr{lr:g}")
    return d / f"seed{seed}"


def run_files(base, name):
    return [base] + [str(ROOT / "configs" / "ablations" / f"{d}.py") for d in RUNS[name]]


def planned(key, files, extra):
    """A train.py key as the config files, then the `--key=value` overrides, set it (None if they don't)."""
    value = None
    for arg in files + extra:
        value = arg_updates(arg).get(key, value)
    return value


def train_one(job, base, extra, out, threads):
    """Train (or resume, or skip when finished) one (run, seed, peak rate or None, step factor)."""
    name, seed, lr, factor = job
    label = f"{name} seed {seed}" + (f" lr {lr:g}" if lr is not None else "") + (f" x{factor}" if factor > 1 else "")
    where = run_dir(out, name, seed, lr, factor)
    if final_val_loss(where) is not None:
        return f"{label}: done already"
    files = run_files(base, name)
    schedule = [f"--learning_rate={lr!r}"] if lr is not None else []
    if factor > 1:
        schedule.append(f"--max_iters={planned('max_iters', files, extra) * factor}")
    args = files + extra + schedule + [f"--seed={seed}", f"--out_dir={where}", "--sample_tokens=0"]
    if (where / "ckpt.pt").exists():
        args.append("--resume=True")
    where.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(where / "train.out", "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {proc.returncode}); see {where / 'train.out'}")
    loss = final_val_loss(where)
    return f"{label}: " + (f"val_loss {loss:.4f}" if loss is not None else "stopped before the end")


def run_all(cfg, extra, out, threads, jobs):
    """Train the jobs, cfg["jobs"] at a time, in the order given (seed-major lists: early results cover every run)."""
    with ThreadPoolExecutor(cfg["jobs"]) as pool:
        try:
            for msg in pool.map(lambda job: train_one(job, cfg["base"], extra, out, threads), dict.fromkeys(jobs)):
                print(msg, flush=True)
        except RuntimeError as e:  # a train.py run failed; its train.out names the cause
            fail(e)


def collect(out, names, seeds, rates=None, factor=1):
    """{run: {seed: final val loss}} over the finished runs; rates: {run: peak rate}, None = the base's."""
    rates = rates or dict.fromkeys(names)
    return {n: {s: v for s in range(seeds) if (v := final_val_loss(run_dir(out, n, s, rates[n], factor))) is not None}
            for n in names}


def summarize(losses, title_suffix=""):
    """Mean and std over seeds, and the difference to the table's baseline, paired by seed.
    losses: {run: {seed: final val loss}} (see collect).

    Runs with the same seed start from the same weights (every run creates the shared parameters first and in
    the same order; a baseline's own come after them) and see the same batches, so the noise that matters is
    the spread of the per-seed differences: Δ/SE = mean(d) / (std(d) / sqrt(n)), d_s = loss(run, s) -
    loss(baseline, s). A table is left out when it would only repeat runs shown above it, and the main table
    when no baseline ran."""
    stats = {n: {"losses": list(v.values()), "mean": float(np.mean(list(v.values()))),
                 "std": float(np.std(list(v.values()), ddof=1)) if len(v) > 1 else None}
             for n, v in losses.items() if v}
    tables, shown = [], set()
    for title, rows, baseline in TABLES:
        rows = [n for n in rows if n in stats]
        no_baseline = title == MAIN_TITLE and not set(rows) - {"vanilla", "value"}
        if baseline not in stats or set(rows) <= shown or no_baseline:
            continue
        shown |= set(rows)
        lines = []
        for n in rows:
            d = [losses[n][s] - losses[baseline][s] for s in losses[n] if s in losses[baseline]]
            sd = float(np.std(d, ddof=1)) if len(d) > 1 else None
            ppl = np.exp(stats[n]["losses"])  # per seed
            lines.append({"run": n, "n": len(stats[n]["losses"]), "mean": stats[n]["mean"], "std": stats[n]["std"],
                          "diff": float(np.mean(d)), "diff_std": sd,
                          "diff_in_se": float(np.mean(d)) / (sd / math.sqrt(len(d))) if sd else None,
                          "ppl": float(ppl.mean()), "ppl_std": float(ppl.std(ddof=1)) if len(ppl) > 1 else None,
                          "paper": PAPER.get(n), "paper_diff": PAPER[n] - PAPER[baseline] if n in PAPER else None,
                          "paper_3b": PAPER_TABLE1.get(n)})
        tables.append({"title": title + title_suffix, "baseline": baseline, "main": title == MAIN_TITLE,
                       "rows": lines})
    return stats, tables


def markdown(tables):
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)
    out = []
    for t in tables:
        if t["main"]:
            out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, mean ± std over seeds; "
                    f"SE = std / √seeds; perplexity = exp(val loss) per seed)", "",
                    "| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | val perplexity | "
                    "paper 3B: Pile ppl | paper 3B: zero-shot avg |", "|" + " --- |" * 8]
            out += [f"| {r['run']} | {r['n']} | {r['mean']:.4f} ± {f(r['std'], '.4f')} | "
                    f"{r['diff']:+.4f} ± {f(r['diff_std'], '.4f')} | {f(r['diff_in_se'], '+.1f')} | "
                    f"{r['ppl']:.3f} ± {f(r['ppl_std'], '.3f')} | {f((r['paper_3b'] or (None,))[0], '.2f')} | "
                    f"{f((r['paper_3b'] or (None, None))[1], '.2f')} |" for r in t["rows"]]
            out.append("")
            continue
        out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, mean ± std over seeds; "
                f"SE = std / √seeds)", "",
                "| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | paper (500M) | paper Δ |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {r['run']} | {r['n']} | {r['mean']:.4f} ± {f(r['std'], '.4f')} | "
                f"{r['diff']:+.4f} ± {f(r['diff_std'], '.4f')} | {f(r['diff_in_se'], '+.1f')} | "
                f"{f(r['paper'], '.4f')} | {f(r['paper_diff'], '+.4f')} |" for r in t["rows"]]
        out.append("")
    return "\n".join(out)


def _pyplot():
    """matplotlib's pyplot drawing to files (no display); an ImportError with the pip line without it."""
    require("matplotlib", "drawing figures").use("Agg")
    return require("matplotlib.pyplot", "drawing figures", pip="matplotlib")


def plot_curves(out, names, seeds, path):
    plt = _pyplot()
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
    ax.set(xlabel="step", ylabel="validation loss (mean over seeds)", title=f"Validation loss, {out.name}")
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
    plt = _pyplot()
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


def best_rates(out, names, lrs, lr_seeds):
    """({run: the peak rate with the lowest mean final val loss in the lr_sweep}, {run: {rate: mean loss}})."""
    means = {n: {lr: float(np.mean(list(v.values()))) for lr in lrs
                 if (v := collect(out, [n], lr_seeds, {n: lr})[n])} for n in names}
    missing = [f"{n} at {lr:g}" for n in names for lr in lrs if lr not in means[n]]
    if missing:
        fail(f"the learning-rate sweep has no finished run for {', '.join(missing)}; run "
             f"`python ablate.py --protocol=lr_sweep` with the same --out, --runs, --lrs and --base first")
    return {n: min(means[n], key=means[n].get) for n in names}, means


def sweep_markdown(means, lrs, best):
    edge = {min(lrs), max(lrs)}
    out = ["**Learning-rate sweep** (final validation loss, mean over the sweep's seeds; bold = best; a best "
           "rate at the edge of the grid means the grid should widen)", "",
           "| run | " + " | ".join(f"{lr:g}" for lr in lrs) + " | best |", "|" + " --- |" * (len(lrs) + 2)]
    for n, m in means.items():
        cells = [f"**{m[lr]:.4f}**" if lr == best[n] else f"{m[lr]:.4f}" for lr in lrs]
        out.append(f"| {n} | " + " | ".join(cells) + f" | {best[n]:g}{' (edge)' if best[n] in edge else ''} |")
    return "\n".join(out) + "\n"


def gap_curves(out, names, seeds, rates, factor, batch_tokens):
    """The paired gap of every run to names[0] at each evaluation, over the seeds both finished logging:
    {run: [(tokens seen, mean gap, SE or None, seeds)]}."""
    def evals(n, s):
        return {r["step"]: r["val_loss"] for r in read_log(run_dir(out, n, s, rates[n], factor)) if r["kind"] == "eval"}
    curves = {}
    for n in names[1:]:
        pairs = [(evals(n, s), evals(names[0], s)) for s in range(seeds)]
        pairs = [(a, b) for a, b in pairs if a and b]
        steps = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs))) if pairs else []
        curves[n] = []
        for st in steps:
            d = [a[st] - b[st] for a, b in pairs]
            se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
            curves[n].append((st * batch_tokens, float(np.mean(d)), se, len(d)))
    return curves


def gap_markdown(curves, short, baseline, short_tokens):
    out = [f"**Gap against training length** (Δ = run − `{baseline}` with the same seed, each at its best rate; "
           f"mean ± SE over seeds; the short runs end at {short_tokens / 1e6:.2f}M tokens; a long run's rows "
           f"before its end are mid-schedule, at a higher learning rate than a finished run)", "",
           "| run | length | tokens (M) | Δ val loss | SE | seeds |", "| --- | --- | --- | --- | --- | --- |"]
    for n, pts in curves.items():
        # the short runs' end, then the long runs' first evaluation after step 0, every multiple of the short
        # runs' length, and the last
        rows = [("short", p) for p in short.get(n, []) if p[0] == short_tokens]  # only a finished pair's end
        rows += [("long", p) for p in dict.fromkeys(pts[1:2] + [p for p in pts if p[0] and p[0] % short_tokens == 0]
                                                    + pts[-1:])]
        for length, (tok, gap, se, k) in rows:
            out.append(f"| {n} | {length} | {tok / 1e6:.2f} | {gap:+.4f} | {'n/a' if se is None else f'{se:.4f}'} | "
                       f"{k} |")
    return "\n".join(out) + "\n"


def plot_gaps(curves, short, baseline, short_tokens, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, pts in curves.items():
        for length, ls, run in (("long runs", "-", pts), ("short runs", "--", short.get(n, []))):
            tok, gap, se = (np.array([p[i] if p[i] is not None else np.nan for p in run[1:]]) for i in range(3))
            if len(tok):
                line, = ax.plot(tok / 1e6, gap, ls=ls, label=f"{n} − {baseline}, {length}")
                ax.fill_between(tok / 1e6, gap - se, gap + se, alpha=0.2, color=line.get_color())
    ax.axhline(0, color="k", lw=0.8)
    ax.axvline(short_tokens / 1e6, color="grey", ls=":", label="end of the short runs")
    ax.set(xlabel="tokens seen (M)", ylabel="paired Δ validation loss (± SE over seeds)",
           title="The gap as training lengthens, each method at its best rate")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out, stem, payload, text):
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(text)


def report_shared(out, names, cfg, extra):
    stats, tables = summarize(collect(out, names, cfg["seeds"]))
    write_results(out, "results", {"config": cfg, "train_overrides": extra, "runs": stats, "tables": tables},
                  markdown(tables))
    try:
        plot_curves(out, names, cfg["seeds"], out / "curves.png")
        figures = [out / "curves.png"]
        for run, png in DEPTH_FIGURES:
            if run in names:
                plot_depth_weights(out / run / "seed0" / "ckpt.pt", out / png, f"Depth weights, {run}, seed 0")
                figures.append(out / png)
        print("figures:", ", ".join(map(str, figures)))
    except ImportError as e:
        print(f"no figures: {e}")


def main(argv):
    split = argv.index("--") if "--" in argv else len(argv)
    extra = argv[split + 1:]
    try:
        cfg = parse_config(DEFAULTS, argv[:split], __doc__, [__file__])
        check_ranges(cfg, KEY_RANGES)
        for arg in extra:  # train.py's arguments: read now, so a malformed one stops the sweep before it starts
            arg_updates(arg)
        lrs = sorted({float(x) for x in cfg["lrs"].split(",") if x.strip()})
    except ConfigError as e:
        fail(e)
    except ValueError:
        fail(f"--lrs must be comma-separated numbers, got {cfg['lrs']!r}")
    protocol = cfg["protocol"]
    if protocol not in PROTOCOLS:
        fail(f"unknown --protocol={protocol}; choose one of {', '.join(PROTOCOLS)}")
    if not lrs or min(lrs) <= 0 or not all(map(math.isfinite, lrs)):
        fail(f"--lrs must list positive, finite peak rates, got {cfg['lrs']!r}")
    runs = cfg["long_runs"] if protocol == "long" else cfg["runs"]
    names = list(dict.fromkeys(n for part in runs.split(",") for n in RUN_SETS.get(part, [part])))
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        fail(f"unknown runs {unknown}; choose from {', '.join(RUNS)} or a set: {', '.join(RUN_SETS)}")
    if not Path(cfg["base"]).is_file():
        fail(f"base config {cfg['base']} not found")
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    threads = cfg["threads"] or max(1, (os.cpu_count() or 1) // cfg["jobs"])

    seeds = range(cfg["seeds"])
    if protocol == "shared":
        run_all(cfg, extra, out, threads, [(n, s, None, 1) for s in seeds for n in names])
        return report_shared(out, names, cfg, extra)
    if protocol == "lr_sweep":
        run_all(cfg, extra, out, threads,
                [(n, s, lr, 1) for s in range(cfg["lr_seeds"]) for lr in lrs for n in names])
        best, means = best_rates(out, names, lrs, cfg["lr_seeds"])
        return write_results(out, "results_lr_sweep", {"config": cfg, "train_overrides": extra, "best": best,
                             "means": {n: {f"{lr:g}": v for lr, v in m.items()} for n, m in means.items()}},
                             sweep_markdown(means, lrs, best))
    best, _ = best_rates(out, names, lrs, cfg["lr_seeds"])
    if protocol == "best_lr":
        shared = planned("learning_rate", [cfg["base"]], extra)
        if not isinstance(shared, (int, float)):
            fail(f"{cfg['base']} sets no learning_rate, the shared rate to compare with")
        run_all(cfg, extra, out, threads,
                [(n, s, lr, 1) for s in seeds for n in names for lr in (float(shared), best[n])])
        at_shared = summarize(collect(out, names, cfg["seeds"], dict.fromkeys(names, float(shared))),
                              f", all at the shared peak rate {shared:g}")
        at_best = summarize(collect(out, names, cfg["seeds"], best), ", each at its best peak rate")
        rates = "Best peak rates: " + ", ".join(f"{n} {lr:g}" for n, lr in best.items()) + "\n\n"
        return write_results(out, "results_best_lr", {"config": cfg, "train_overrides": extra, "best": best,
                             "shared_rate": shared, "tables_shared": at_shared[1], "tables_best": at_best[1]},
                             rates + markdown(at_shared[1]) + "\n" + markdown(at_best[1]))
    factor = cfg["long_factor"]
    run_all(cfg, extra, out, threads, [(n, s, best[n], factor) for s in seeds for n in names])
    batch_tokens = planned("batch_tokens", [cfg["base"]], extra)
    short_tokens = planned("max_iters", [cfg["base"]], extra) * batch_tokens
    curves = gap_curves(out, names, cfg["seeds"], best, factor, batch_tokens)
    short = gap_curves(out, names, cfg["seeds"], best, 1, batch_tokens)  # best_lr's runs, where they exist
    write_results(out, "results_long", {"config": cfg, "train_overrides": extra, "best": best, "gaps": curves,
                                        "gaps_short": short}, gap_markdown(curves, short, names[0], short_tokens))
    try:
        plot_gaps(curves, short, names[0], short_tokens, out / "gap_vs_tokens.png")
        print("figure:", out / "gap_vs_tokens.png")
    except ImportError as e:
        print(f"no figure: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
