"""
The report of an ablate.py sweep, from the records of the runs in its --out folder (support.sweep),
training nothing: the tables (markdown and JSON, the paper's numbers beside ours) and figures (loss
curves, depth-weight heatmaps, the gap against training length). After ablate.py runs the jobs, its
protocol's function (shared, lr_sweep, best_lr, long) writes <out>/<RESULTS[protocol]>.{md,json}.
"""
import json
import math
import sys

import numpy as np

from baselines import DEPTH_MODES
from support import paper, runlog
from support.atomic import write_atomically
from support.outputs import output_file, save_figure
from support.depth_weights import self_share
from support.depth_weights_view import can_draw, depth_weight_matrix, plot_depth_weights, pyplot
from support.errors import CheckpointError, ConfigError, DataError
from support.folders import claim
from support.speed import clock
from support.sweep import final_val_loss, read_log, run_dir

# protocol -> the name of its results.{md,json}
RESULTS = {"shared": "results", "lr_sweep": "results_lr_sweep", "best_lr": "results_best_lr",
           "long": "results_long"}
# lime: LIMe, the closest prior work
MAIN = ["vanilla", "value", "lime", "denseformer", "attnres", "mhc"]
MAIN_TITLE = "Main comparison (Table 1 at CPU scale)"
# the paper's tables (`value` is also the stride-half run), each compared with its first row
TABLES = [
    (MAIN_TITLE, MAIN),
    ("Mixing rule (Table 5; lime: LIMe, static learned routing)",
     ["vanilla", "uniform", "lime", "value"]),
    ("Updated state (Table 6)", ["vanilla", "key", "kv", "value"]),
    ("Stride (Figure 4)", ["vanilla", "stride_first", "value", "stride_quarter", "stride_full"]),
    ("Looped, 3 loops", ["looped_vanilla", "looped_value"]),
    ("Keyless Attention (no keys, a V-only cache), with and without the depth step",
     ["vanilla", "value", "keyless", "keyless_value"]),
]
# a fork's rows: the depth modes no table above shows
OTHER_MODES = [m for m in DEPTH_MODES if not any(m in rows for _, rows in TABLES)]
if OTHER_MODES:
    TABLES.append(("Other depth modes", ["vanilla", *OTHER_MODES, "value"]))
# runs whose seed-0 depth weights are drawn like the paper's Figure 3
DEPTH_FIGURES = [("value", "depth_weights.png"), ("stride_full", "depth_weights_full.png"),
                 ("looped_value", "depth_weights_looped.png")]
PAPER = paper.ABLATION_LOSS  # 500M models, validation loss (paper Tables 5-6, Figure 4)
# Table 1's 3B models: (Pile validation perplexity or None, zero-shot average over the 8 tasks)
PAPER_TABLE1 = {run: (paper.TABLE1_PPL.get(row), paper.TABLE1_AVG[0][row])
                for run, row in paper.TABLE1_3B_RUNS.items()}


def std(x):
    """The sample standard deviation (ddof=1), None for fewer than two values."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else None


def collect(out, names, seeds, rates=None):
    """{run: {seed: final val loss}} over the finished runs; rates: {run: peak rate}, None = the
    base's."""
    rates = rates or dict.fromkeys(names)
    return {n: {s: v for s in range(seeds)
                if (v := final_val_loss(run_dir(out, n, s, rates[n]))) is not None}
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
                 "std": std(list(v.values()))} for n, v in losses.items() if v}
    tables, shown = [], set()
    for title, rows in TABLES:
        baseline, rows = rows[0], [n for n in rows if n in stats]
        no_baseline = title == MAIN_TITLE and not set(rows) - {"vanilla", "value"}
        if baseline not in stats or set(rows) <= shown or no_baseline:
            continue
        shown |= set(rows)
        lines = []
        for n in rows:
            d = [losses[n][s] - losses[baseline][s] for s in losses[n] if s in losses[baseline]]
            diff, sd, ppl = float(np.mean(d)), std(d), np.exp(stats[n]["losses"])  # ppl per seed
            lines.append({"run": n, "n": len(stats[n]["losses"]), "mean": stats[n]["mean"],
                          "std": stats[n]["std"], "diff": diff, "diff_std": sd,
                          "diff_in_se": diff / (sd / math.sqrt(len(d))) if sd else None,
                          "ppl": float(ppl.mean()), "ppl_std": std(ppl), "paper": PAPER.get(n),
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
        main = t["main"]
        note = "; perplexity = exp(val loss) per seed" if main else ""
        paper = ("val perplexity | paper 3B: Pile ppl | paper 3B: zero-shot avg" if main
                 else "paper (500M) | paper Δ")
        out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, "
                f"mean ± std over seeds; SE = std / √seeds{note})", "",
                f"| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | {paper} |",
                "|" + " --- |" * (8 if main else 7)]
        for r in t["rows"]:
            ppl_3b, avg_3b = r["paper_3b"] or (None, None)
            cells = ([f"{r['ppl']:.3f} ± {f(r['ppl_std'], '.3f')}", f(ppl_3b, ".2f"),
                      f(avg_3b, ".2f")] if main
                     else [f(r["paper"], ".4f"), f(r["paper_diff"], "+.4f")])
            out.append(f"| {r['run']} | {r['n']} | {r['mean']:.4f} ± {f(r['std'], '.4f')} | "
                       f"{r['diff']:+.4f} ± {f(r['diff_std'], '.4f')} | "
                       f"{f(r['diff_in_se'], '+.1f')} | {' | '.join(cells)} |")
        out.append("")
    return "\n".join(out)


def evals(run):
    """[(step, val loss)] of a run folder's evaluations, as logged."""
    return [(r["step"], r["val_loss"]) for r in read_log(run) if r["kind"] == "eval"]


def plot_curves(out, names, seeds, path):
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for n in names:
        curves = [c for s in range(seeds) if (c := evals(run_dir(out, n, s)))]
        if not curves:
            continue
        k = min(len(c) for c in curves)  # steps every seed has reached
        mean = np.mean([[v for _, v in c[:k]] for c in curves], 0)
        ax.plot([st for st, _ in curves[0][1:k]], mean[1:], label=n,  # skip the step-0 eval
                ls="--" if n.startswith("looped") else "-")
    ax.set(xlabel="step", ylabel="validation loss (mean over seeds)",
           title=f"Validation loss, {out.name}")
    save_line_plot(fig, ax, path)


def save_line_plot(fig, ax, path):
    """A line plot's legend and grid, then the file, marked as ablate.py's (support.outputs.mark)."""
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, "ablate.py", dpi=120)


def best_rates(out, names, lrs, lr_seeds):
    """({run: the peak rate with the lowest mean final val loss in the lr_sweep}, {run: {rate: mean
    loss}})."""
    means = {n: {lr: float(np.mean(list(v.values()))) for lr in lrs
                 if (v := collect(out, [n], lr_seeds, {n: lr})[n])} for n in names}
    missing = [f"{n} at {lr:g}" for n in names for lr in lrs if lr not in means[n]]
    if missing:
        raise ConfigError(f"the learning-rate sweep has no finished run for {', '.join(missing)}; "
                          f"run `python ablate.py --protocol=lr_sweep` with the same --out, "
                          f"--runs, --lrs and --base first")
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
    def log(n, s):
        return dict(evals(run_dir(out, n, s, rates[n], factor)))
    curves = {}
    for n in names[1:]:
        pairs = [(log(n, s), log(names[0], s)) for s in range(seeds)]
        pairs = [(a, b) for a, b in pairs if a and b]
        steps = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs))) if pairs else []
        curves[n] = [(st * batch_tokens, float(np.mean(d)),
                      None if len(d) < 2 else std(d) / math.sqrt(len(d)), len(d))
                     for st in steps if (d := [a[st] - b[st] for a, b in pairs])]
    return curves


def gap_markdown(curves, short, baseline, short_tokens):
    out = [f"**Gap against training length** (Δ = run − `{baseline}` with the same seed, "
           f"each at its best rate; mean ± SE over seeds; "
           f"the short runs end at {short_tokens / 1e6:.2f}M tokens; a long run's rows "
           f"before its end are mid-schedule, at a higher learning rate than a finished run)", "",
           "| run | length | tokens (M) | Δ val loss | SE | seeds |",
           "| --- | --- | --- | --- | --- | --- |"]
    for n, pts in curves.items():
        # a finished short pair's end, then the long runs' first evaluation after step 0, every
        # multiple of the short runs' length, and the last
        rows = [("short", p) for p in short.get(n, []) if p[0] == short_tokens]
        rows += [("long", p) for p in dict.fromkeys(
            pts[1:2] + [p for p in pts if p[0] and p[0] % short_tokens == 0] + pts[-1:])]
        out += [f"| {n} | {length} | {tok / 1e6:.2f} | {gap:+.4f} | "
                f"{'n/a' if se is None else f'{se:.4f}'} | {k} |"
                for length, (tok, gap, se, k) in rows]
    return "\n".join(out) + "\n"


def plot_gaps(curves, short, baseline, short_tokens, path):
    fig, ax = pyplot().subplots(figsize=(8, 5))
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
    save_line_plot(fig, ax, path)


def write_results(out, protocol, command, text, **results):
    stem = out / RESULTS[protocol]
    write_atomically(stem.with_suffix(".json"), json.dumps({**command, **results}, indent=1) + "\n")
    write_atomically(stem.with_suffix(".md"), text)
    print(text)


def check_outputs(out, protocol, names, runs):
    """Before anything trains: --out is ablate.py's folder (support.folders.claim: its names are
    the runs' folders and the results; one from before manifests holds nothing else), and every
    result file of the protocol can be written there (the shared protocol draws the depth weights
    of the runs in names only)."""
    own = [*runs, *(f"{stem}{ext}" for stem in RESULTS.values() for ext in (".json", ".md")),
           "curves.png", "gap_vs_tokens.png", *(png for _, png in DEPTH_FIGURES)]
    claim(out, "ablate.py", "--out", own,
          legacy=lambda d: [] if {p.name for p in d.iterdir()} - set(own) else own).record()
    figures = {"shared": ["curves.png"] + [png for run, png in DEPTH_FIGURES if run in names],
               "long": ["gap_vs_tokens.png"]}.get(protocol, [])
    for name in [f"{RESULTS[protocol]}.json", f"{RESULTS[protocol]}.md", *figures]:
        if (out / name).is_dir():
            raise ConfigError(f"{out / name} is a folder where ablate.py writes its {name}; "
                              f"move it away or pick another --out")
        output_file(out / name, "--out")


def shared(out, names, command):
    """The shared protocol's results (every run at the base's rate, paired by seed), the loss curves
    and Figure 3 for the runs of DEPTH_FIGURES swept. command: {"config": ablate.py's,
    "train_overrides": the arguments after --}, recorded in results.json."""
    seeds = command["config"]["seeds"]
    stats, tables = summarize(collect(out, names, seeds))
    write_results(out, "shared", command, markdown(tables), runs=stats, tables=tables)
    if not can_draw("no figures"):
        return
    plot_curves(out, names, seeds, out / "curves.png")
    figures = [out / "curves.png"]
    for run, png in [(run, png) for run, png in DEPTH_FIGURES if run in names]:
        # a finished run's checkpoint was checked before the sweep; it or its data may have gone
        try:
            m = depth_weight_matrix(run_dir(out, run, 0) / "ckpt.pt")
        except (CheckpointError, DataError) as e:
            print(f"no {png}: {e}")
            continue
        plot_depth_weights(m, out / png, f"Depth weights, {run}, seed 0")
        figures.append(out / png)
    print("figures:", ", ".join(map(str, figures)))


def lr_sweep(out, names, lrs, command):
    """Every run at each peak rate of lrs: the table of mean final losses, each run's best rate."""
    best, means = best_rates(out, names, lrs, command["config"]["lr_seeds"])
    write_results(out, "lr_sweep", command, sweep_markdown(means, lrs, best), best=best,
                  means={n: {f"{lr:g}": v for lr, v in m.items()} for n, m in means.items()})


def best_lr(out, names, best, shared_rate, command):
    """The runs paired by seed twice: all at the base's shared peak rate, and each at its best."""
    seeds = command["config"]["seeds"]
    _, at_shared = summarize(collect(out, names, seeds, dict.fromkeys(names, shared_rate)),
                             f", all at the shared peak rate {shared_rate:g}")
    _, at_best = summarize(collect(out, names, seeds, best), ", each at its best peak rate")
    rates = "Best peak rates: " + ", ".join(f"{n} {lr:g}" for n, lr in best.items()) + "\n\n"
    write_results(out, "best_lr", command, rates + markdown(at_shared) + "\n" + markdown(at_best),
                  best=best, shared_rate=shared_rate, tables_shared=at_shared, tables_best=at_best)


def long(out, names, best, factor, short_steps, batch_tokens, command):
    """The paired gap of every run to names[0] as training lengthens: the runs of factor x
    short_steps steps, beside the short runs at the same best rates (best_lr's, where they
    exist)."""
    seeds, short_tokens = command["config"]["seeds"], short_steps * batch_tokens
    curves = gap_curves(out, names, seeds, best, factor, batch_tokens)
    short = gap_curves(out, names, seeds, best, 1, batch_tokens)
    write_results(out, "long", command, gap_markdown(curves, short, names[0], short_tokens),
                  best=best, gaps=curves, gaps_short=short)
    if not can_draw("no figure"):
        return
    plot_gaps(curves, short, names[0], short_tokens, out / "gap_vs_tokens.png")
    print("figure:", out / "gap_vs_tokens.png")


def plot_run(run, figure):
    """One run's curves from its log.jsonl into figure (a PNG): the train and validation losses,
    the learning rate, tokens per second, and each layer's depth weight on itself ("self only"
    is 1, vanilla) at every evaluation. Returns the number of steps drawn. The log is read as
    --resume reads it (a torn last line dropped with a warning); a column it lacks (an older or a
    fork's train.py) is left out, named in one warning."""
    records = runlog.read_log(run)
    train, evaluated = ([r for r in records if r.get("kind") == kind] for kind in ("train", "eval"))
    if not train:
        raise CheckpointError(f"{run}/log.jsonl has no training step to draw; give a train.py "
                              f"--out_dir that has trained")
    rows = {"train_loss": train, "val_loss": evaluated, "lr": train, "tok_per_s": train}
    columns = {key: [(r["step"], r[key]) for r in of if key in r] for key, of in rows.items()}
    missing = [key for key, of in rows.items() if of and not columns[key]]
    if missing:
        print(f"warning: {run}/log.jsonl has no {', '.join(missing)}; left out of the figure",
              file=sys.stderr)

    def xy(key):  # ([steps], [values]) of a column
        return tuple(map(list, zip(*columns[key]))) or ([], [])
    fig, axes = pyplot().subplots(2, 2, figsize=(11, 7))
    loss, lr, speed, depth = axes.flat
    loss.plot(*xy("train_loss"), lw=0.8, label="train")
    loss.plot(*xy("val_loss"), "o-", label="val")
    loss.set(ylabel="loss", title="loss")
    loss.legend()
    lr.plot(*xy("lr"))
    lr.set(ylabel="learning rate", title="learning rate")
    speed.plot(*xy("tok_per_s"), lw=0.8)
    speed.set(ylabel="tokens / s", title="throughput")
    weighed = [r for r in evaluated if r.get("depth_weights")]
    if weighed:
        at = [r["step"] for r in weighed]
        for layer in weighed[0]["depth_weights"]:
            depth.plot(at, [r["depth_weights"][layer][layer] for r in weighed], "o-",
                       label=f"layer {layer}")
        depth.plot(at, [self_share(r["depth_weights"]) for r in weighed], "k--", label="mean")
        depth.legend(fontsize=7)
    depth.set(ylabel="weight on itself", title="depth weights (1 = self only)" if weighed
              else "no depth weights (no depth step)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    timed = [r["elapsed_s"] for r in records if "elapsed_s" in r]  # none from an older train.py
    fig.suptitle(f"{run}: {train[-1]['step']} steps in {clock(timed[-1])}" if timed else str(run))
    fig.tight_layout()
    save_figure(fig, figure, "ablate.py", dpi=110)
    return len(train)
