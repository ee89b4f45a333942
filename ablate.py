r"""
The paper's main comparison (section 3.1, Table 1: vanilla, Depth-Attention and the three hidden-state
baselines) and its ablations (section 3.3: Tables 5-6, Figure 4, looped), as a sweep of train.py runs x seeds.

    python ablate.py --runs=ablations                    # the CPU ablation sweep on Shakespeare (~1 h, 2 cores)
    python ablate.py --runs=main --out=out/ablate_main   # Table 1 at CPU scale: vanilla, value and the baselines
    python ablate.py --base=configs/ablations/base.py --out=out/ablate_minipile --seeds=2 --jobs=1 \
        --runs=vanilla,value -- --compile=True           # on a GPU: MiniPile, 85M; after `--`: train.py keys

Every run is the base config, then its delta files from configs/ablations/, then the overrides after `--`,
then --seed and --out_dir: every mode gets the same budget and hyperparameters. A run in --out is reused if
finished, or resumed from its checkpoint, only when train.py recorded the config asked for, so re-running the
same command completes a partial sweep; any other run there (other settings, an unreadable log or checkpoint)
stops the command before it trains, naming it: pick a new --out, or --overwrite=True retrains it from scratch.
Writes <out>/results.{md,json}, and with matplotlib <out>/curves.png and <out>/depth_weights*.png.

    python ablate.py --depth_weights=out/ablate_cpu/value/seed0   # one run's depth weights (Figure 3),
                                                                  # printed and drawn; trains nothing

A peak learning rate that suits one method can handicap another, so three more protocols compare each method
at its own best rate and follow the gap as training lengthens (one command each, in this order):

    python ablate.py --protocol=lr_sweep --runs=vanilla,value   # every run at each of --lrs, --lr_seeds seeds
    python ablate.py --protocol=best_lr --runs=vanilla,value    # paired seeds at the shared and the best rates
    python ablate.py --protocol=long --long_runs=vanilla,value  # --long_factor x the steps, at the best rates
"""
import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from baselines import DEPTH_MODES
from support import paper
from support.checkpoint import (CheckpointError, checkpoint_path, model_from_checkpoint,
                                read_checkpoint)
from support.cli import ConfigError, fail, output_file, require, write_atomically
from support.config import arg_updates, check_ranges, parse_config
from support.depth_weights import as_matrix, mean_depth_weights, table
from support.sweep import (final_val_loss, read_log, run_dir, survey, train_config, train_defaults,
                           unset_key)

ROOT = Path(__file__).resolve().parent
DEFAULTS = {
    "base": "configs/ablations/cpu.py",  # the shared base config; GPU: configs/ablations/base.py
    "out": "out/ablate_cpu",              # one folder per run and seed below it, plus the results
    "runs": "all",                        # comma-separated names from RUNS or RUN_SETS (all, main,
                                          # ablations)
    "seeds": 3,                           # seeds 0 .. seeds-1 for every run
    "jobs": 2,                            # train.py processes at once (CPU: one per core, one
                                          # thread each)
    "threads": 0,                         # torch threads per process; 0 = the cores shared out
                                          # among the jobs
    "protocol": "shared",                 # shared | lr_sweep | best_lr | long (see the docstring)
    "lrs": "1e-3,2e-3,3e-3,6e-3",         # lr_sweep: the peak learning rates tried for every run
    "lr_seeds": 1,                        # lr_sweep: seeds per rate; best_lr reuses its runs where
                                          # seed and rate match
    "long_runs": "vanilla,value",         # long: the runs trained longer; the first is the baseline
                                          # of the gap
    "long_factor": 5,                     # long: this many times the base's max_iters (and tokens)
    "depth_weights": "",                  # a run folder or checkpoint: print and draw its depth
                                          # weights, training nothing (Figure 3)
    "figure": "",                         # where --depth_weights draws; default
                                          # <run>/depth_weights.png
    "overwrite": False,                   # retrain from scratch, deleting them, the runs in --out
                                          # that cannot be reused (trained with other settings, or
                                          # with an unreadable record)
}
PROTOCOLS = {"shared": "results", "lr_sweep": "results_lr_sweep", "best_lr": "results_best_lr",
             "long": "results_long"}  # protocol -> the name of its results.{md,json}
# run name -> delta files in configs/ablations/, applied after the base: every row of the table of
# depth modes is a run (its file mode_<name>.py), then the strides, the looped pair and the
# baselines
RUNS = {
    **{mode: [f"mode_{mode}"] for mode in DEPTH_MODES},
    "stride_first": ["stride_first"], "stride_quarter": ["stride_quarter"],
    "stride_full": ["stride_full"],
    "looped_vanilla": ["looped", "mode_vanilla"], "looped_value": ["looped", "mode_value"],
    "denseformer": ["residual_denseformer"], "attnres": ["residual_attnres"],
    "mhc": ["residual_mhc"],
}
MAIN = ["vanilla", "value", "lime", "denseformer", "attnres", "mhc"]  # lime: LIMe, the closest
                                                                      # prior work
MAIN_TITLE = "Main comparison (Table 1 at CPU scale)"
RUN_SETS = {"all": list(RUNS), "main": MAIN, "ablations": [n for n in RUNS if n not in MAIN[2:]]}
# the paper's tables (`value` is also the stride-half run), each compared with its own baseline
TABLES = [
    (MAIN_TITLE, MAIN, "vanilla"),
    ("Mixing rule (Table 5; lime: LIMe, static learned routing)",
     ["vanilla", "uniform", "lime", "value"], "vanilla"),
    ("Updated state (Table 6)", ["vanilla", "key", "kv", "value"], "vanilla"),
    ("Stride (Figure 4)", ["vanilla", "stride_first", "value", "stride_quarter", "stride_full"],
     "vanilla"),
    ("Looped, 3 loops", ["looped_vanilla", "looped_value"], "looped_vanilla"),
]
OTHER_MODES = [m for m in DEPTH_MODES
               if not any(m in rows for _, rows, _ in TABLES)]  # a fork's row
if OTHER_MODES:
    TABLES.append(("Other depth modes", ["vanilla", *OTHER_MODES, "value"], "vanilla"))
# runs whose seed-0 depth weights are drawn like the paper's Figure 3
DEPTH_FIGURES = [("value", "depth_weights.png"), ("stride_full", "depth_weights_full.png"),
                 ("looped_value", "depth_weights_looped.png")]
PAPER = paper.ABLATION_LOSS  # 500M models, validation loss (paper Tables 5-6, Figure 4)
# The 3B models of Table 1: (Pile validation perplexity or None, zero-shot average over the eight
# tasks).
PAPER_TABLE1 = {run: (paper.TABLE1_PPL.get(row), paper.TABLE1_AVG[0][row])
                for run, row in paper.TABLE1_3B_RUNS.items()}
KEY_RANGES = {"seeds": ">= 1", "jobs": ">= 1", "threads": ">= 0", "lr_seeds": ">= 1",
              "long_factor": ">= 1"}
# train.py keys that ablate.py sets for every run: given after `--`, they would be overridden or
# fight it
OWN_KEYS = {"seed": "the seeds are 0 .. --seeds-1",
            "out_dir": "every run has its folder below --out",
            "resume": "a started run is resumed anyway",
            "overwrite": "ablate.py's own --overwrite retrains"}


def run_files(base, name):
    return [base] + [str(ROOT / "configs" / "ablations" / f"{d}.py") for d in RUNS[name]]


def label(job):
    name, seed, lr, factor = job
    return (f"{name} seed {seed}" + (f" lr {lr:g}" if lr is not None else "")
            + (f" x{factor}" if factor > 1 else ""))


def train_args(job, base, extra, out):
    """train.py's arguments for one job (run, seed, peak rate or None, step factor), --resume
    aside."""
    name, seed, lr, factor = job
    files = run_files(base, name)
    schedule = [f"--learning_rate={lr!r}"] if lr is not None else []
    if factor > 1:
        schedule.append(f"--max_iters={train_config(files + extra)['max_iters'] * factor}")
    return files + extra + schedule + [f"--seed={seed}", f"--out_dir={run_dir(out, *job)}",
                                       "--sample_tokens=0"]


def plan(cfg, base, extra, out, jobs, reads=(), figures=()):
    """{job: (state, train.py arguments)}, from every folder this command trains in (jobs) or reads
    (reads: runs of the protocol before it) checked before anything trains. A run that cannot be
    reused stops the command, unless --overwrite and it is one of the jobs; figures: the jobs whose
    checkpoints the report reads."""
    jobs, plans = dict.fromkeys(jobs), {}
    for job in dict.fromkeys([*jobs, *reads]):
        args = train_args(job, base, extra, out)
        plans[job] = (*survey(run_dir(out, *job), args, job in figures), args)
    stale = {job: why for job, (state, why, _) in plans.items()
             if state == "stale" and not (cfg["overwrite"] and job in jobs)}
    if stale:
        shown = "; ".join(f"{label(job)} ({why})" for job, why in list(stale.items())[:4])
        more = f"; and {len(stale) - 4} more" if len(stale) > 4 else ""
        fix = ("pick a new --out, or rerun with --overwrite=True to delete and retrain them"
               if set(stale) <= set(jobs)
               else "rerun the protocols that train them (lr_sweep, then best_lr) with these "
                    "settings and --overwrite=True first, or pick a new --out")
        fail(f"{len(stale)} run(s) in {out} cannot be reused: {shown}{more}; {fix}")
    # the folders of the runs to train: made now, or found unwritable before anything trains
    for job in jobs:
        if plans[job][0] != "done":
            output_file(run_dir(out, *job) / "train.out", "--out")
    return {job: (state, args) for job, (state, _, args) in plans.items() if job in jobs}


def train_one(job, state, args, out, threads):
    """Train (or resume, or report when finished) one job; a stale run goes wholly first
    (--overwrite)."""
    where = run_dir(out, *job)
    if state == "done":
        return f"{label(job)}: done already"
    if state == "stale":
        shutil.rmtree(where)
    where.mkdir(parents=True, exist_ok=True)
    resume = ["--resume=True"] if state == "resume" else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # a resume's output follows the run's before
    with open(where / "train.out", "a" if resume else "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *resume], stdout=log,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:  # train.py's last line says why: its error line, or a traceback's last
        why = ((where / "train.out").read_text(errors="replace").strip().splitlines()
               or ["no output"])[-1]
        raise RuntimeError(f"{label(job)} failed (exit {proc.returncode}: {why}); "
                           f"see {where / 'train.out'}")
    loss = final_val_loss(where)
    return f"{label(job)}: " + (f"val_loss {loss:.4f}" if loss is not None
                                else "stopped before the end")


def run_all(cfg, out, threads, plans):
    """Train the planned jobs, cfg["jobs"] at a time, in the order given (seed-major lists: early
    results cover every run). A failed run or Ctrl-C starts no further run; the ones started end
    (Ctrl-C stops them too)."""
    pool = ThreadPoolExecutor(cfg["jobs"])
    try:
        for msg in pool.map(lambda job: train_one(job, *plans[job], out, threads), plans):
            print(msg, flush=True)
    except RuntimeError as e:  # a train.py run failed; its train.out names the cause
        pool.shutdown(cancel_futures=True)
        fail(e)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        fail("interrupted; every started run keeps its last checkpoint: rerun the same command to "
             "continue")
    pool.shutdown()


def collect(out, names, seeds, rates=None, factor=1):
    """{run: {seed: final val loss}} over the finished runs; rates: {run: peak rate}, None = the
    base's."""
    rates = rates or dict.fromkeys(names)
    return {n: {s: v for s in range(seeds)
                if (v := final_val_loss(run_dir(out, n, s, rates[n], factor))) is not None}
            for n in names}


def summarize(losses, title_suffix=""):
    """Mean and std over seeds, and the difference to the table's baseline, paired by seed.
    losses: {run: {seed: final val loss}} (see collect).

    Runs with the same seed start from the same weights (every run creates the shared parameters
    first and in the same order; a baseline's own come after them) and see the same batches, so the
    noise that matters is the spread of the per-seed differences: Δ/SE = mean(d) / (std(d) /
    sqrt(n)), d_s = loss(run, s) - loss(baseline, s). A table is left out when it would only repeat
    runs shown above it, and the main table when no baseline ran."""
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
            lines.append({"run": n, "n": len(stats[n]["losses"]), "mean": stats[n]["mean"],
                          "std": stats[n]["std"],
                          "diff": float(np.mean(d)), "diff_std": sd,
                          "diff_in_se": (float(np.mean(d)) / (sd / math.sqrt(len(d))) if sd
                                         else None),
                          "ppl": float(ppl.mean()),
                          "ppl_std": float(ppl.std(ddof=1)) if len(ppl) > 1 else None,
                          "paper": PAPER.get(n),
                          "paper_diff": PAPER[n] - PAPER[baseline] if n in PAPER else None,
                          "paper_3b": PAPER_TABLE1.get(n)})
        tables.append({"title": title + title_suffix, "baseline": baseline,
                       "main": title == MAIN_TITLE, "rows": lines})
    return stats, tables


def markdown(tables):
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)
    out = []
    for t in tables:
        if t["main"]:
            out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, "
                    f"mean ± std over seeds; SE = std / √seeds; "
                    f"perplexity = exp(val loss) per seed)", "",
                    "| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | "
                    "val perplexity | paper 3B: Pile ppl | paper 3B: zero-shot avg |",
                    "|" + " --- |" * 8]
            out += [f"| {r['run']} | {r['n']} | {r['mean']:.4f} ± {f(r['std'], '.4f')} | "
                    f"{r['diff']:+.4f} ± {f(r['diff_std'], '.4f')} | "
                    f"{f(r['diff_in_se'], '+.1f')} | "
                    f"{r['ppl']:.3f} ± {f(r['ppl_std'], '.3f')} | "
                    f"{f((r['paper_3b'] or (None,))[0], '.2f')} | "
                    f"{f((r['paper_3b'] or (None, None))[1], '.2f')} |" for r in t["rows"]]
            out.append("")
            continue
        out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, "
                f"mean ± std over seeds; SE = std / √seeds)", "",
                "| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | "
                "paper (500M) | paper Δ |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {r['run']} | {r['n']} | {r['mean']:.4f} ± {f(r['std'], '.4f')} | "
                f"{r['diff']:+.4f} ± {f(r['diff_std'], '.4f')} | "
                f"{f(r['diff_in_se'], '+.1f')} | "
                f"{f(r['paper'], '.4f')} | {f(r['paper_diff'], '+.4f')} |" for r in t["rows"]]
        out.append("")
    return "\n".join(out)


def _pyplot():
    """matplotlib's pyplot drawing to files (no display); an ImportError with the pip line without
    it."""
    require("matplotlib", "drawing figures").use("Agg")
    return require("matplotlib.pyplot", "drawing figures", pip="matplotlib")


def plot_curves(out, names, seeds, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for n in names:
        curves = [[(r["step"], r["val_loss"]) for r in read_log(out / n / f"seed{s}")
                   if r["kind"] == "eval"]
                  for s in range(seeds)]
        curves = [c for c in curves if c]
        if not curves:
            continue
        k = min(len(c) for c in curves)  # steps every seed has reached
        steps = [st for st, _ in curves[0][:k]]
        mean = np.mean([[v for _, v in c[:k]] for c in curves], 0)
        ax.plot(steps[1:], mean[1:], label=n,
                ls="--" if n.startswith("looped") else "-")  # skip the step-0 eval
    ax.set(xlabel="step", ylabel="validation loss (mean over seeds)",
           title=f"Validation loss, {out.name}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


DEPTH_WINDOWS = 16  # the figures' validation windows (train.py's log: its eval_seqs windows)


def depth_weight_matrix(ckpt_path, n_windows=DEPTH_WINDOWS):
    """Average depth weight each effective layer puts on each candidate (its sources, then itself),
    over fixed validation windows, batch rows, KV heads and positions: (L, L), NaN where not a
    candidate."""
    ckpt = read_checkpoint(ckpt_path, verify=("model", "model_config", "files"))
    model = model_from_checkpoint(ckpt).eval()
    T = model.config.block_size
    val = np.memmap(ROOT / ckpt["data_dir"] / "val.bin",
                    dtype=np.uint16, mode="r")  # train.py ran in ROOT
    starts = np.linspace(0, len(val) - T - 1, n_windows).astype(np.int64)
    x = torch.from_numpy(np.stack([val[s:s + T].astype(np.int64) for s in starts]))
    return as_matrix(mean_depth_weights(model, x), model.config.n_eff_layer)


def plot_depth_weights(m, path, title):
    """Figure 3's heatmap of depth_weight_matrix's m: layer by candidate, the weight in each
    cell."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, origin="upper")
    for (i, j), v in np.ndenumerate(m):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="w" if v < 0.6 else "k")
    ax.set(xlabel="candidate layer (diagonal = the layer itself)", ylabel="layer", title=title)
    fig.colorbar(im, ax=ax, label="mean depth weight")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def show_depth_weights(source, figure):
    """ablate.py --depth_weights=RUN: a checkpoint's depth weights printed as a table and drawn."""
    path = checkpoint_path(source)
    figure = output_file(figure or path.parent / "depth_weights.png", "--figure")
    if (figure.is_file() and figure.stat().st_size
            and figure.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n"):
        fail(f"--figure={figure} exists and is not a figure; pick another path, or delete the file "
             f"if it may go")
    try:
        m = depth_weight_matrix(path)
    except CheckpointError as e:
        fail(e)
    except FileNotFoundError as e:
        fail(f"{e.filename} is missing: the depth weights are read on the run's validation data; "
             f"prepare it again (python prepare_data.py) where the run found it")
    if np.isnan(m).all():
        fail(f"{source}'s model computes no per-token depth weights (vanilla, the baselines and "
             f"LIMe have none); give a run of a Depth-Attention mode")
    print(f"mean depth weights of {path} over {DEPTH_WINDOWS} validation windows "
          f"(row: layer, column: candidate)")
    print(table(m))
    try:
        run = path.parent.resolve()
        plot_depth_weights(m, figure, f"Depth weights, {run.parent.name}/{run.name}")
        print("figure:", figure)
    except ImportError as e:
        print(f"no figure: {e}")


def best_rates(out, names, lrs, lr_seeds):
    """({run: the peak rate with the lowest mean final val loss in the lr_sweep}, {run: {rate: mean
    loss}})."""
    means = {n: {lr: float(np.mean(list(v.values()))) for lr in lrs
                 if (v := collect(out, [n], lr_seeds, {n: lr})[n])} for n in names}
    missing = [f"{n} at {lr:g}" for n in names for lr in lrs if lr not in means[n]]
    if missing:
        fail(f"the learning-rate sweep has no finished run for {', '.join(missing)}; run "
             f"`python ablate.py --protocol=lr_sweep` with the same --out, --runs, --lrs and "
             f"--base first")
    return {n: min(means[n], key=means[n].get) for n in names}, means


def sweep_markdown(means, lrs, best):
    edge = {min(lrs), max(lrs)}
    out = ["**Learning-rate sweep** (final validation loss, mean over the sweep's seeds; "
           "bold = best; a best rate at the edge of the grid means the grid should widen)", "",
           "| run | " + " | ".join(f"{lr:g}" for lr in lrs) + " | best |",
           "|" + " --- |" * (len(lrs) + 2)]
    for n, m in means.items():
        cells = [f"**{m[lr]:.4f}**" if lr == best[n] else f"{m[lr]:.4f}" for lr in lrs]
        out.append(f"| {n} | " + " | ".join(cells)
                   + f" | {best[n]:g}{' (edge)' if best[n] in edge else ''} |")
    return "\n".join(out) + "\n"


def gap_curves(out, names, seeds, rates, factor, batch_tokens):
    """The paired gap of every run to names[0] at each evaluation, over the seeds both finished
    logging: {run: [(tokens seen, mean gap, SE or None, seeds)]}."""
    def evals(n, s):
        return {r["step"]: r["val_loss"] for r in read_log(run_dir(out, n, s, rates[n], factor))
                if r["kind"] == "eval"}
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
    out = [f"**Gap against training length** (Δ = run − `{baseline}` with the same seed, "
           f"each at its best rate; mean ± SE over seeds; "
           f"the short runs end at {short_tokens / 1e6:.2f}M tokens; a long run's rows "
           f"before its end are mid-schedule, at a higher learning rate than a finished run)", "",
           "| run | length | tokens (M) | Δ val loss | SE | seeds |",
           "| --- | --- | --- | --- | --- | --- |"]
    for n, pts in curves.items():
        # the short runs' end, then the long runs' first evaluation after step 0, every multiple of
        # the short runs' length, and the last
        rows = [("short", p) for p in short.get(n, [])
                if p[0] == short_tokens]  # only a finished pair's end
        rows += [("long", p)
                 for p in dict.fromkeys(pts[1:2]
                                        + [p for p in pts if p[0] and p[0] % short_tokens == 0]
                                        + pts[-1:])]
        for length, (tok, gap, se, k) in rows:
            out.append(f"| {n} | {length} | {tok / 1e6:.2f} | {gap:+.4f} | "
                       f"{'n/a' if se is None else f'{se:.4f}'} | {k} |")
    return "\n".join(out) + "\n"


def plot_gaps(curves, short, baseline, short_tokens, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, pts in curves.items():
        for length, ls, run in (("long runs", "-", pts), ("short runs", "--", short.get(n, []))):
            tok, gap, se = (np.array([p[i] if p[i] is not None else np.nan for p in run[1:]])
                            for i in range(3))
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
    write_atomically(out / f"{stem}.json", json.dumps(payload, indent=1) + "\n")
    write_atomically(out / f"{stem}.md", text)
    print(text)


def check_outputs(out, protocol, names):
    """Before anything trains: --out is a folder and every result file of the protocol can be
    written there."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out={out} is a file; give a folder (the runs and their results go "
                          f"below it)")
    figures = {"shared": ["curves.png"] + [png for run, png in DEPTH_FIGURES if run in names],
               "long": ["gap_vs_tokens.png"]}
    for name in [f"{PROTOCOLS[protocol]}.json", f"{PROTOCOLS[protocol]}.md",
                 *figures.get(protocol, [])]:
        if (out / name).is_dir():
            raise ConfigError(f"{out / name} is a folder where ablate.py writes its {name}; "
                              f"move it away or pick another --out")
        output_file(out / name, "--out")


def report_shared(out, names, cfg, extra):
    stats, tables = summarize(collect(out, names, cfg["seeds"]))
    write_results(out, PROTOCOLS["shared"],
                  {"config": cfg, "train_overrides": extra, "runs": stats, "tables": tables},
                  markdown(tables))
    try:
        plot_curves(out, names, cfg["seeds"], out / "curves.png")
    except ImportError as e:
        return print(f"no figures: {e}")
    figures = [out / "curves.png"]
    for run, png in DEPTH_FIGURES:
        if run in names:
            # a finished run's checkpoint was checked before the sweep; one may have been pruned
            # since it ran
            try:
                m = depth_weight_matrix(run_dir(out, run, 0) / "ckpt.pt")
                plot_depth_weights(m, out / png, f"Depth weights, {run}, seed 0")
                figures.append(out / png)
            except (CheckpointError, OSError) as e:
                print(f"no {png}: {e}")
    print("figures:", ", ".join(map(str, figures)))


def parse_args(argv):
    """(ablate.py's config, train.py's arguments after `--`, the peak rates, the run names), all
    checked."""
    split = argv.index("--") if "--" in argv else len(argv)
    extra = argv[split + 1:]
    try:
        cfg = parse_config(DEFAULTS, argv[:split], __doc__, [__file__])
        check_ranges(cfg, KEY_RANGES)
        unset = unset_key(cfg, DEFAULTS)
        if unset:
            raise ConfigError(f"--{unset}=None: give a value, e.g. the default "
                              f"--{unset}={DEFAULTS[unset]}")
        # train.py's arguments: read now, so a malformed one stops the sweep before it starts
        for arg in extra:
            own = sorted(OWN_KEYS.keys() & arg_updates(arg).keys()) if arg.startswith("--") else []
            if own:
                raise ConfigError(f"--{own[0]} after -- is ablate.py's to set "
                                  f"({OWN_KEYS[own[0]]}); drop it")
        lrs = sorted({float(x) for x in cfg["lrs"].split(",") if x.strip()})
    except ConfigError as e:
        fail(e)
    except ValueError:
        fail(f"--lrs must be comma-separated numbers, got {cfg['lrs']!r}")
    protocol, cores = cfg["protocol"], os.cpu_count() or 1
    if protocol not in PROTOCOLS:
        fail(f"unknown --protocol={protocol}; choose one of {', '.join(PROTOCOLS)}")
    if not lrs or min(lrs) <= 0 or not all(map(math.isfinite, lrs)):
        fail(f"--lrs must list positive, finite peak rates, got {cfg['lrs']!r}")
    runs = cfg["long_runs"] if protocol == "long" else cfg["runs"]
    names = list(dict.fromkeys(n for part in runs.split(",") if part.strip()
                               for n in RUN_SETS.get(part.strip(), [part.strip()])))
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        fail(f"unknown runs {unknown or runs!r}; choose from {', '.join(RUNS)} "
             f"or a set: {', '.join(RUN_SETS)}")
    if protocol == "long" and (len(names) < 2 or cfg["long_factor"] < 2):
        fail(f"--protocol=long trains --long_factor >= 2 times the steps and compares every run "
             f"with the first of --long_runs: give two runs or more and a factor of 2 or more, "
             f"got {names} x{cfg['long_factor']}")
    if cfg["threads"] > cores:
        fail(f"--threads={cfg['threads']} exceeds this machine's {cores} cores; "
             f"give at most {cores} (0 = the cores shared among the jobs)")
    if cfg["figure"] and not cfg["depth_weights"]:
        fail(f"--figure={cfg['figure']} is where --depth_weights=RUN draws; give the run too")
    if not cfg["out"]:
        fail("--out is empty; give the folder for the runs and results, e.g. --out=out/ablate_cpu")
    if not Path(cfg["base"]).is_file():
        fail(f"base config {cfg['base']} not found (a relative path starts in the current folder)")
    return cfg, extra, lrs, names


def run_protocol(cfg, extra, lrs, names):
    """Check every path and run this command touches, train what is missing, write the protocol's
    results."""
    protocol, out, seeds = cfg["protocol"], Path(cfg["out"]).resolve(), range(cfg["seeds"])
    # train.py runs in ROOT, so the paths it gets are absolute: relative ones mean the folder
    # ablate.py ran in
    base = str(Path(cfg["base"]).resolve())
    args = [a if a.startswith("--") else str(Path(a).resolve()) for a in extra]
    # every run's files and overrides, resolved now: a wrong key stops the sweep up front
    for name in names:
        unset = unset_key(train_config(run_files(base, name) + args), train_defaults())
        if unset:
            raise ConfigError(f"--{unset}=None for the {name} run; train.py needs a value there")
    check_outputs(out, protocol, names)
    threads = cfg["threads"] or max(1, (os.cpu_count() or 1) // cfg["jobs"])
    sweep = [(n, s, lr, 1) for s in range(cfg["lr_seeds"]) for lr in lrs for n in names]
    if protocol == "shared":
        jobs = [(n, s, None, 1) for s in seeds for n in names]
        figures = [(run, 0, None, 1) for run, _ in DEPTH_FIGURES]
        run_all(cfg, out, threads, plan(cfg, base, args, out, jobs, figures=figures))
        return report_shared(out, names, cfg, extra)
    if protocol == "lr_sweep":
        run_all(cfg, out, threads, plan(cfg, base, args, out, sweep))
        best, means = best_rates(out, names, lrs, cfg["lr_seeds"])
        return write_results(out, PROTOCOLS[protocol],
                             {"config": cfg, "train_overrides": extra, "best": best,
                              "means": {n: {f"{lr:g}": v for lr, v in m.items()}
                                        for n, m in means.items()}},
                             sweep_markdown(means, lrs, best))
    plan(cfg, base, args, out, [], reads=sweep)  # the sweep's runs, whose best rates this protocol
                                                 # takes
    best, _ = best_rates(out, names, lrs, cfg["lr_seeds"])
    start = train_config([base, *args])  # the base's schedule, shared by every run
    if protocol == "best_lr":
        shared = start["learning_rate"]
        jobs = [(n, s, lr, 1) for s in seeds for n in names for lr in (float(shared), best[n])]
        run_all(cfg, out, threads, plan(cfg, base, args, out, jobs))
        at_shared = summarize(collect(out, names, cfg["seeds"],
                                      dict.fromkeys(names, float(shared))),
                              f", all at the shared peak rate {shared:g}")
        at_best = summarize(collect(out, names, cfg["seeds"], best), ", each at its best peak rate")
        rates = "Best peak rates: " + ", ".join(f"{n} {lr:g}" for n, lr in best.items()) + "\n\n"
        return write_results(out, PROTOCOLS[protocol],
                             {"config": cfg, "train_overrides": extra, "best": best,
                              "shared_rate": shared, "tables_shared": at_shared[1],
                              "tables_best": at_best[1]},
                             rates + markdown(at_shared[1]) + "\n" + markdown(at_best[1]))
    factor, batch_tokens = cfg["long_factor"], start["batch_tokens"]
    short_runs = [(n, s, best[n], 1) for s in seeds for n in names]  # best_lr's, drawn beside the
                                                                     # long ones
    run_all(cfg, out, threads, plan(cfg, base, args, out,
                                    [(n, s, best[n], factor) for s in seeds for n in names],
                                    reads=short_runs))
    short_tokens = start["max_iters"] * batch_tokens
    curves = gap_curves(out, names, cfg["seeds"], best, factor, batch_tokens)
    short = gap_curves(out, names, cfg["seeds"], best, 1, batch_tokens)  # best_lr's runs, where
                                                                         # they exist
    write_results(out, PROTOCOLS[protocol],
                  {"config": cfg, "train_overrides": extra, "best": best, "gaps": curves,
                   "gaps_short": short}, gap_markdown(curves, short, names[0], short_tokens))
    try:
        plot_gaps(curves, short, names[0], short_tokens, out / "gap_vs_tokens.png")
        print("figure:", out / "gap_vs_tokens.png")
    except ImportError as e:
        print(f"no figure: {e}")


def main(argv):
    cfg, extra, lrs, names = parse_args(argv)
    try:
        if cfg["depth_weights"]:
            return show_depth_weights(cfg["depth_weights"], cfg["figure"])
        return run_protocol(cfg, extra, lrs, names)
    except ConfigError as e:  # a path that cannot be written, a key train.py does not know
        fail(e)


if __name__ == "__main__":
    main(sys.argv[1:])
