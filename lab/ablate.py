r"""
The paper's main comparison (Table 1: vanilla, Depth-Attention, the hidden-state baselines) and its
ablations (Tables 5-6, Figure 4, looped) as a sweep of train.py runs x seeds.

    python lab/ablate.py --runs=ablations                   # the CPU ablation sweep (~1 h, 2 cores)
    python lab/ablate.py --runs=main --out=out/ablate_main  # Table 1 at CPU scale
    python lab/ablate.py --base=configs/ablations/base.py --out=out/ablate_minipile --jobs=1 \
        --runs=vanilla,value -- --compile=True              # a GPU; after `--`: train.py's keys
    python lab/ablate.py --depth_weights=out/ablate_cpu/value/seed0  # Figure 3, printed and drawn
    python lab/ablate.py --curves=out/shakespeare           # one run's curves from its log.jsonl

A run is the base config, its delta files from configs/ablations/, the keys after `--`, then --seed
and --out_dir. A run in --out is reused (finished) or resumed (a checkpoint) only when train.py
recorded the config asked for, so the same command completes a partial sweep; any other run there
stops the command before it trains: pick a new --out, or --overwrite=True retrains it. Writes
<out>/results.{md,json}, curves.png and depth_weights*.png. Three more protocols compare each method
at its own best peak rate and follow the gap as training lengthens (in this order):

    python lab/ablate.py --protocol=lr_sweep --runs=vanilla,value   # every run at each of --lrs
    python lab/ablate.py --protocol=best_lr --runs=vanilla,value    # paired: shared and best rates
    python lab/ablate.py --protocol=long --long_runs=vanilla,value  # --long_factor x the steps
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: the core
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import io
import json
import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import train
from lab.continued import read_log
from baselines import DEPTH_MODES
from checkpoint import checkpoint_path, read_checkpoint, read_model
from configurator import (CheckpointError, ConfigError, DataError, Key, UserError, not_a_choice,
                          parse, require, run_main, table, updates)
from data import load_meta, read_tokens
from lab.hf import is_hf_folder
from lab.shards import snapshot
from outputs import claim, mark, output_file, run_folder, write_atomically

ROOT = Path(__file__).resolve().parent.parent  # train.py runs there
RESULTS = {"shared": "results", "lr_sweep": "results_lr_sweep", "best_lr": "results_best_lr",
           "long": "results_long"}  # protocol -> its results.{md,json}
KEYS = {
    "base": Key("configs/ablations/cpu.py", "the shared base; GPU: configs/ablations/base.py",
                path=True),
    "out": Key("out/ablate_cpu", "a folder per run and seed below it, and the results", path=True),
    "runs": Key("all", "names of RUNS or RUN_SETS (all, main, ablations, keyless_study)"),
    "seeds": Key(3, "seeds 0 .. seeds-1 for every run", ">= 1"),
    "jobs": Key(2, "train.py processes at once (CPU: one per core)", ">= 1"),
    "threads": Key(0, "torch threads per process; 0 = the cores shared among the jobs", ">= 0"),
    "protocol": Key("shared", "see the docstring", choices=tuple(RESULTS)),
    "lrs": Key("1e-3,2e-3,3e-3,6e-3", "lr_sweep: the peak learning rates tried for every run"),
    "lr_seeds": Key(1, "lr_sweep: seeds per rate (best_lr reuses them)", ">= 1"),
    "long_runs": Key("vanilla,value", "long: the runs trained longer; the first is the baseline"),
    "long_factor": Key(5, "long: this many times the base's max_iters", ">= 1"),
    "depth_weights": Key("", "a run or checkpoint: print and draw its depth weights (Figure 3)"),
    "curves": Key("", "a run: draw its losses, learning rate, speed and depth weights over steps"),
    "figure": Key("", "where --depth_weights or --curves draws; default: in the run's folder"),
    "overwrite": Key(False, "retrain from scratch the runs in --out that cannot be reused"),
}
# run name -> delta files in configs/ablations/, after the base: every depth mode (mode_<name>.py),
# the strides, a fork's source rules (source_<name>.py, docs/forking.md), looped, the baselines
RUNS = {
    **{mode: [f"mode_{mode}"] for mode in DEPTH_MODES},
    **{stride: [stride] for stride in ("stride_first", "stride_quarter", "stride_full")},
    **{p.stem: [p.stem] for p in sorted((ROOT / "configs" / "ablations").glob("source_*.py"))},
    "looped_vanilla": ["looped", "mode_vanilla"], "looped_value": ["looped", "mode_value"],
    **{residual: [f"residual_{residual}"] for residual in ("denseformer", "attnres", "mhc")},
    "keyless": ["attention_keyless", "mode_vanilla"], "keyless_value": ["attention_keyless"],
}
MAIN = ["vanilla", "value", "lime", "denseformer", "attnres", "mhc"]  # lime: the closest prior work
KEYLESS = ["vanilla", "value", "keyless", "keyless_value"]  # related work beside the paper's
RUN_SETS = {"all": list(RUNS), "main": MAIN, "keyless_study": KEYLESS,
            "ablations": [n for n in RUNS if n not in MAIN[2:] + KEYLESS[2:]]}
# train.py keys ablate.py sets for every run: given after `--`, they would fight it
OWN_KEYS = {"seed": "the seeds are 0 .. --seeds-1", "out_dir": "every run has its folder below "
            "--out", "resume": "a started run is resumed anyway",
            "overwrite": "ablate.py's own --overwrite retrains"}
MAIN_TITLE = "Main comparison (Table 1 at CPU scale)"
TABLES = [  # the paper's tables (`value` is also the stride-half run), each against its first row
    (MAIN_TITLE, MAIN),
    ("Mixing rule (Table 5; lime: LIMe, static learned routing)",
     ["vanilla", "uniform", "lime", "value"]),
    ("Updated state (Table 6)", ["vanilla", "key", "kv", "value"]),
    ("Stride (Figure 4)", ["vanilla", "stride_first", "value", "stride_quarter", "stride_full"]),
    ("Looped, 3 loops", ["looped_vanilla", "looped_value"]),
    ("Keyless Attention (no keys, a V-only cache), with and without the depth step", KEYLESS),
]
OTHER_MODES = [m for m in DEPTH_MODES if not any(m in rows for _, rows in TABLES)]  # a fork's
if OTHER_MODES:
    TABLES.append(("Other depth modes", ["vanilla", *OTHER_MODES, "value"]))
# the paper's numbers, quoted: 500M validation losses (Tables 5-6, Figure 4, the looped rows), and
# Table 1's 3B rows: (Pile validation perplexity or None, zero-shot average over its 8 tasks)
PAPER = {"vanilla": 2.2348, "uniform": 2.2153, "value": 2.2115, "key": 2.2354, "kv": 2.2198,
         "stride_first": 2.2127, "stride_quarter": 2.2140, "stride_full": 2.2139,
         "looped_vanilla": 2.208, "looped_value": 2.194}
PAPER_3B = {"vanilla": (7.55, 53.76), "value": (7.25, 55.69), "denseformer": (None, 54.70),
            "attnres": (None, 55.01), "mhc": (None, 54.68)}
# runs whose seed-0 depth weights the shared protocol draws like the paper's Figure 3
DEPTH_FIGURES = {"value": "depth_weights.png", "stride_full": "depth_weights_full.png",
                 "looped_value": "depth_weights_looped.png"}
DEPTH_WINDOWS = 16  # the validation windows a depth-weight figure averages over


class TrainFailed(UserError):
    """A train.py job that stopped on a user error (exit 2): its error line and its log."""


class TrainCrashed(Exception):
    """A train.py job that ended with a traceback or a signal: a bug, so no UserError."""


# ----------------------------------------------------------------------------- the runs in --out

def run_dir(out, name, seed, lr=None, factor=1) -> Path:
    """out/<run>[/lr<rate> or /long<f>x_lr<rate>]/seed<s>: at a peak rate, for f x the steps."""
    d = Path(out) / name
    if lr is not None:
        d = d / (f"long{factor}x_lr{lr:g}" if factor > 1 else f"lr{lr:g}")
    return d / f"seed{seed}"


def read_config(where) -> dict:
    """The config.json train.py wrote: the run's config and its "resumes"."""
    path = Path(where) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        if isinstance(cfg, dict) and isinstance(cfg.get("max_iters"), int):
            return cfg
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        pass
    raise CheckpointError(f"{path} is not a train.py config (cut short or edited)")


def final_val_loss(where):
    """The last evaluation's loss if the run finished (evaluated at max_iters), else None."""
    evals = [r for r in read_log(where) if r.get("kind") == "eval"]
    if evals and (Path(where) / "config.json").exists() \
            and evals[-1]["step"] == read_config(where)["max_iters"]:
        return evals[-1]["val_loss"]
    return None


def differences(recorded, asked) -> str:
    """`key old -> new` for each key that changes a reported number (train.py's table says which;
    a key it no longer has counts) where a run's config or resumes differ from asked; "" if none."""
    keys = train.table(True)
    before = {k: key.default for k, key in keys.items()} | recorded  # a key added since: default

    def counts(k):
        return k not in keys or keys[k].result
    # vocab_size None follows the data, which dataset and data_root name
    diff = [f"{k} {before[k]!r} -> {v!r}" for k, v in asked.items() if counts(k)
            and before[k] != v and not (k == "vocab_size" and v is None)]
    diff += [f"resumed at step {r.get('step')} with {k} {a!r} -> {b!r}" for r in
             recorded.get("resumes", []) for k, (a, b) in r["changed"].items() if counts(k)]
    return ", ".join(diff)


def survey(where, args, figure=False):
    """(state, why) of a job's folder: "done", "resume", "new", or "stale" and what differs or
    cannot be read (figure: its checkpoint too, which the report draws)."""
    ckpt, asked = where / "ckpt.pt", train.parse_args(args)
    try:
        loss = final_val_loss(where)
        if loss is None and ckpt.exists():
            saved = read_checkpoint(ckpt, verify=("config", "step"))
            if not isinstance(saved.get("config"), dict):
                raise CheckpointError(f"{ckpt} holds a model but not a train.py run to continue")
            # an older checkpoint kept its resumes beside its config
            recorded = {"resumes": saved.get("config_history", []), **saved["config"]}
            what = f"checkpoint at step {saved.get('step')}"
            if saved.get("step") == asked["max_iters"]:  # its final evaluation was logged first
                raise CheckpointError(f"{where / 'log.jsonl'} lacks the final evaluation (cut "
                                      f"short or edited)")
        elif (where / "config.json").exists():
            recorded, what = read_config(where), "finished" if loss is not None else "unfinished"
        else:
            return "new", None
        if figure and loss is not None and ckpt.exists():
            read_checkpoint(ckpt, verify=("model", "model_config"))
    except UserError as e:
        return "stale", str(e)
    if diff := differences(recorded, asked):
        return "stale", f"{what}; {diff}"
    return ("done" if loss is not None else "resume" if ckpt.exists() else "new"), None


# ----------------------------------------------------------------------------- the sweep

def label(job):
    name, seed, lr, factor = job
    return (f"{name} seed {seed}" + (f" lr {lr:g}" if lr is not None else "")
            + (f" x{factor}" if factor > 1 else ""))


def train_args(job, base, extra, out):
    """train.py's arguments for a job (run, seed, peak rate or None, step factor), less --resume."""
    name, seed, lr, factor = job
    files = [base, *(str(ROOT / "configs" / "ablations" / f"{d}.py") for d in RUNS[name])]
    if lr is not None:
        files.append(f"--learning_rate={lr!r}")
    if factor > 1:
        files.append(f"--max_iters={train.parse_args(files + extra)['max_iters'] * factor}")
    return [*files, *extra, f"--seed={seed}", f"--out_dir={run_dir(out, *job)}",
            "--sample_tokens=0"]


def plan(cfg, base, extra, out, jobs, reads=(), figures=()):
    """{job: (state, train.py arguments)} of the jobs, every folder trained or read checked before
    anything trains: a stale one stops the command, unless --overwrite and it is a job."""
    plans = {}
    for job in dict.fromkeys([*jobs, *reads]):
        args = train_args(job, base, extra, out)
        plans[job] = (*survey(run_dir(out, *job), args, job in figures), args)
    stale = {job: why for job, (state, why, _) in plans.items()
             if state == "stale" and not (cfg["overwrite"] and job in jobs)}
    if stale:
        fix = ("pick a new --out, or rerun with --overwrite=True to delete and retrain them"
               if set(stale) <= set(jobs) else "rerun the protocols that train them (lr_sweep, "
               "then best_lr) with these settings and --overwrite=True first, or pick a new --out")
        shown = [f"{label(job)} ({why})" for job, why in stale.items()]
        raise CheckpointError(f"{len(stale)} run(s) in {out} cannot be reused: "
                              f"{'; '.join(shown[:4])}{'; ...' * (len(stale) > 4)}; {fix}")
    for job in jobs:  # train.py's folders, or found foreign or unwritable before anything trains
        if plans[job][0] != "done":
            run_folder(run_dir(out, *job), plans[job][0] == "resume").record()
    return {job: (state, args) for job, (state, _, args) in plans.items() if job in jobs}


def train_one(job, state, args, out, threads):
    """Train, resume or report finished one job; a stale one goes wholly first (--overwrite)."""
    where, resume = run_dir(out, *job), ["--resume=True"] * (state == "resume")
    if state == "done":
        return f"{label(job)}: done already"
    if state == "stale":  # train.py's files go; any other file stays
        run_folder(where, False).clear()
    with open(where / "train.out", "a" if resume else "w") as log:  # a resume's follows the run's
        code = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *resume], stdout=log,
                              stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)}).returncode
    lines = (where / "train.out").read_text(errors="replace").strip().splitlines() or ["-"]
    if code == 2:  # train.py's user error: its one line says it all
        raise TrainFailed(f"{label(job)} failed (exit 2: {lines[-1]}); see {where}/train.out")
    if code:  # a bug or a signal: the traceback whole, or the last line
        start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")),
                    default=len(lines) - 1)
        how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        raise TrainCrashed(f"{label(job)} crashed ({how}), see {where}/train.out; it ends:\n"
                           + "\n".join(lines[start:]))
    loss = final_val_loss(where)
    return f"{label(job)}: " + (f"val_loss {loss:.4f}" if loss is not None
                                else "stopped before the end")


def run_all(cfg, out, threads, plans):
    """The planned jobs, --jobs at a time, in order; a failure or Ctrl-C starts no further one."""
    pool = ThreadPoolExecutor(cfg["jobs"])
    try:
        for msg in pool.map(lambda job: train_one(job, *plans[job], out, threads), plans):
            print(msg, flush=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        raise KeyboardInterrupt("every started run keeps its last checkpoint: rerun the same "
                                "command to continue") from None
    except BaseException:
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()


def parse_args(argv):
    """(config, train.py's arguments after `--`, peak rates, run names), checked; reads no file
    but the config files after `--`."""
    split = argv.index("--") if "--" in argv else len(argv)
    cfg, extra = parse(argv[:split], KEYS, __doc__), argv[split + 1:]
    # read as train.py reads them: a malformed one or an unknown key stops the sweep up front
    if own := [k for k, _ in updates(extra, train.table(True), train.read_config_file) if k in OWN_KEYS]:
        raise ConfigError(f"--{own[0]} after -- is ablate.py's to set ({OWN_KEYS[own[0]]})")
    try:
        lrs = sorted({float(x) for x in cfg["lrs"].split(",") if x.strip()})
        if not lrs or min(lrs) <= 0 or not all(map(math.isfinite, lrs)):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--lrs must list positive peak rates, got {cfg['lrs']!r}") from None
    long = cfg["protocol"] == "long"
    runs = cfg["long_runs"] if long else cfg["runs"]
    names = list(dict.fromkeys(n for part in runs.split(",") if part.strip()
                               for n in RUN_SETS.get(part.strip(), [part.strip()])))
    if unknown := [n for n in names if n not in RUNS] or ([] if names else [runs]):
        raise not_a_choice("--long_runs" if long else "--runs", unknown[0], [*RUNS, *RUN_SETS])
    if long and (len(names) < 2 or cfg["long_factor"] < 2):
        raise ConfigError(f"--protocol=long trains --long_factor >= 2 times the steps and compares "
                          f"every run with the first of --long_runs: give two runs or more and a "
                          f"factor of 2 or more, got {names} x{cfg['long_factor']}")
    if cfg["figure"] and not (cfg["depth_weights"] or cfg["curves"]):
        raise ConfigError(f"--figure={cfg['figure']} is where --depth_weights=RUN or --curves=RUN "
                          f"draws; give the run too")
    return cfg, extra, lrs, names


def run_protocol(cfg, extra, lrs, names):
    """Check every path and run the command touches, train what is missing, write the results."""
    protocol, out, seeds = cfg["protocol"], Path(cfg["out"]).resolve(), range(cfg["seeds"])
    # train.py runs in ROOT: the base and config files by absolute path, every key as --key=value
    base = str(Path(cfg["base"]).resolve())
    args = [f"--{k}={v if isinstance(v, str) else repr(v)}"
            for k, v in updates(extra, train.table(True), train.read_config_file)]
    for name in names:  # checked as train.py checks them: a wrong value stops the sweep up front
        try:
            train.parse_args(train_args((name, 0, None, 1), base, args, out))
        except ConfigError as e:
            raise ConfigError(f"the {name} run: {e}") from None
    check_outputs(out, protocol, names)
    threads = cfg["threads"] or max(1, (os.cpu_count() or 1) // cfg["jobs"])

    def train_jobs(jobs, reads=(), figures=()):
        run_all(cfg, out, threads, plan(cfg, base, args, out, jobs, reads, figures))
    command = {"config": cfg, "train_overrides": extra}  # recorded in every results.json
    if protocol == "shared":
        train_jobs([(n, s, None, 1) for s in seeds for n in names],
                   figures=[(run, 0, None, 1) for run in DEPTH_FIGURES])
        return report_shared(out, names, command)
    sweep = [(n, s, lr, 1) for s in range(cfg["lr_seeds"]) for lr in lrs for n in names]
    if protocol == "lr_sweep":
        train_jobs(sweep)
    plan(cfg, base, args, out, [], reads=sweep)  # the sweep's runs, whose best rates this takes
    best, means = best_rates(out, names, lrs, cfg["lr_seeds"])
    if protocol == "lr_sweep":
        return write_results(out, protocol, command, sweep_markdown(means, lrs, best), best=best,
                             means={n: {f"{lr:g}": v for lr, v in m.items()}
                                    for n, m in means.items()})
    start = train.parse_args([base, *args])  # the base's schedule, shared by every run
    if protocol == "best_lr":
        shared = float(start["learning_rate"])
        train_jobs([(n, s, lr, 1) for s in seeds for n in names for lr in (shared, best[n])])
        _, at_shared = summarize(collect(out, names, seeds, dict.fromkeys(names, shared)),
                                 f", all at the shared peak rate {shared:g}")
        _, at_best = summarize(collect(out, names, seeds, best), ", each at its best peak rate")
        rates = "Best peak rates: " + ", ".join(f"{n} {lr:g}" for n, lr in best.items())
        return write_results(out, protocol, command, f"{rates}\n\n{markdown(at_shared)}\n"
                             f"{markdown(at_best)}", best=best, shared_rate=shared,
                             tables_shared=at_shared, tables_best=at_best)
    factor = cfg["long_factor"]  # best_lr's short runs are drawn beside the long ones
    train_jobs([(n, s, best[n], factor) for s in seeds for n in names],
               reads=[(n, s, best[n], 1) for s in seeds for n in names])
    tokens, short_tokens = start["batch_tokens"], start["max_iters"] * start["batch_tokens"]
    curves, short = (gap_curves(out, names, seeds, best, k, tokens) for k in (factor, 1))
    write_results(out, protocol, command, gap_markdown(curves, short, names[0], short_tokens),
                  best=best, gaps=curves, gaps_short=short)
    if plt := pyplot():
        plot_gaps(plt, curves, short, names[0], short_tokens, out / "gap_vs_tokens.png")


# ----------------------------------------------------------------------------- the report

def check_outputs(out, protocol, names):
    """--out is ablate.py's folder (one from before manifests holds nothing else), and the
    protocol's result files can be written there."""
    own = [*RUNS, *(f"{stem}{ext}" for stem in RESULTS.values() for ext in (".json", ".md")),
           "curves.png", "gap_vs_tokens.png", *DEPTH_FIGURES.values()]
    claim(out, "ablate.py", "--out", own,
          legacy=lambda d: [] if {p.name for p in d.iterdir()} - set(own) else own).record()
    figures = {"shared": ["curves.png", *(DEPTH_FIGURES[n] for n in names if n in DEPTH_FIGURES)],
               "long": ["gap_vs_tokens.png"]}.get(protocol, [])
    for name in [f"{RESULTS[protocol]}.json", f"{RESULTS[protocol]}.md", *figures]:
        output_file(out / name, "--out")


def write_results(out, protocol, command, text, **results):
    stem = out / RESULTS[protocol]
    write_atomically(stem.with_suffix(".json"), json.dumps({**command, **results}, indent=1) + "\n")
    write_atomically(stem.with_suffix(".md"), text)
    print(text)


def std(x):
    """The sample standard deviation, None for fewer than two values."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else None


def collect(out, names, seeds, rates=None):
    """{run: {seed: final val loss}} of the finished runs at rates ({run: rate}; None: base's)."""
    rates = rates or dict.fromkeys(names)
    return {n: {s: v for s in seeds if (v := final_val_loss(run_dir(out, n, s, rates[n])))
                is not None} for n in names}


def summarize(losses, title_suffix=""):
    """(stats, tables): mean and std over seeds, the difference to each table's baseline paired
    by seed (same seed, same initial weights and batches: Δ/SE = mean(d) / (std(d) / sqrt(n)))."""
    stats = {n: {"losses": list(v.values()), "mean": float(np.mean(list(v.values()))),
                 "std": std(list(v.values()))} for n, v in losses.items() if v}
    tables, shown = [], set()
    for title, rows in TABLES:
        baseline, rows, main = rows[0], [n for n in rows if n in stats], title == MAIN_TITLE
        # no table that only repeats runs shown above it, nor a main table without a baseline
        if baseline not in stats or set(rows) <= shown or main and set(rows) <= {*MAIN[:2]}:
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
                          "paper_3b": PAPER_3B.get(n)})
        tables.append({"title": title + title_suffix, "baseline": baseline, "main": main,
                       "rows": lines})
    return stats, tables


def f(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def markdown(tables):
    out = []
    for t in tables:
        main = t["main"]
        paper = ("val perplexity | paper 3B: Pile ppl | paper 3B: zero-shot avg" if main
                 else "paper (500M) | paper Δ")
        out += [f"**{t['title']}** (Δ = run − `{t['baseline']}` with the same seed, mean ± std "
                f"over seeds; SE = std / √seeds{'; perplexity = exp(val loss) per seed' * main})",
                "", f"| run | seeds | val loss (mean ± std) | Δ vs baseline | Δ / SE | {paper} |",
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


def best_rates(out, names, lrs, lr_seeds):
    """({run: the peak rate of the lowest mean final loss in the lr_sweep}, {run: {rate: mean}})."""
    means = {n: {lr: float(np.mean(list(v.values()))) for lr in lrs
                 if (v := collect(out, [n], range(lr_seeds), {n: lr})[n])} for n in names}
    if missing := [f"{n} at {lr:g}" for n in names for lr in lrs if lr not in means[n]]:
        raise ConfigError(f"the learning-rate sweep has no finished run for {', '.join(missing)}; "
                          f"run `python lab/ablate.py --protocol=lr_sweep` with the same --out, "
                          f"--runs, --lrs and --base first")
    return {n: min(means[n], key=means[n].get) for n in names}, means


def sweep_markdown(means, lrs, best):
    out = ["**Learning-rate sweep** (final validation loss, mean over the sweep's seeds; "
           "bold = best; a best rate at the edge of the grid means the grid should widen)", "",
           "| run | " + " | ".join(f"{lr:g}" for lr in lrs) + " | best |",
           "|" + " --- |" * (len(lrs) + 2)]
    for n, m in means.items():
        cells = [f"**{m[lr]:.4f}**" if lr == best[n] else f"{m[lr]:.4f}" for lr in lrs]
        out.append(f"| {n} | {' | '.join(cells)} | {best[n]:g}"
                   f"{' (edge)' * (best[n] in (lrs[0], lrs[-1]))} |")
    return "\n".join(out) + "\n"


def evals(run):
    """[(step, val loss)] of a run folder's evaluations."""
    return [(r["step"], r["val_loss"]) for r in read_log(run) if r.get("kind") == "eval"]


def gap_curves(out, names, seeds, rates, factor, batch_tokens):
    """{run: [(tokens seen, mean gap to names[0], SE or None, seeds)]}, paired by seed."""
    curves = {}
    for n in names[1:]:
        pairs = [(dict(evals(run_dir(out, n, s, rates[n], factor))),
                  dict(evals(run_dir(out, names[0], s, rates[names[0]], factor)))) for s in seeds]
        pairs = [(a, b) for a, b in pairs if a and b]
        steps = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs))) if pairs else []
        curves[n] = [(st * batch_tokens, float(np.mean(d)),
                      None if len(d) < 2 else std(d) / math.sqrt(len(d)), len(d))
                     for st in steps if (d := [a[st] - b[st] for a, b in pairs])]
    return curves


def gap_markdown(curves, short, baseline, short_tokens):
    out = [f"**Gap against training length** (Δ = run − `{baseline}` with the same seed, each at "
           f"its best rate; mean ± SE over seeds; the short runs end at {short_tokens / 1e6:.2f}M "
           f"tokens; a long run's rows before its end are mid-schedule, at a higher learning rate "
           f"than a finished run)", "", "| run | length | tokens (M) | Δ val loss | SE | seeds |",
           "| --- | --- | --- | --- | --- | --- |"]
    for n, pts in curves.items():
        # a finished short pair's end (never an unfinished one's last evaluation), then the long
        # runs' first evaluation after step 0, every multiple of the short length, and the last
        rows = [("short", p) for p in short.get(n, []) if p[0] == short_tokens]
        rows += [("long", p) for p in dict.fromkeys(
            pts[1:2] + [p for p in pts if p[0] and p[0] % short_tokens == 0] + pts[-1:])]
        out += [f"| {n} | {length} | {tok / 1e6:.2f} | {gap:+.4f} | {f(se, '.4f')} | {k} |"
                for length, (tok, gap, se, k) in rows]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- figures

def pyplot(needed=False):
    """matplotlib's pyplot; without it a MissingPackage if needed, else None (tables suffice)."""
    try:
        require("matplotlib", "drawing figures").use("Agg")
        return require("matplotlib.pyplot", "drawing figures")
    except ImportError as e:
        if needed:
            raise
        print(f"no figures: {e}")


def save(plt, fig, path, dpi=120):
    """Written whole, marked as ablate.py's so that a rerun may replace it (written_here)."""
    for ax in [ax for ax in fig.axes if ax.lines]:  # line plots, not the heatmap
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    buffer, suffix = io.BytesIO(), Path(path).suffix[1:].lower() or "png"
    fig.savefig(buffer, format=suffix, dpi=dpi, metadata={
        "Software" if suffix == "png" else "Creator": mark("ablate.py")})
    plt.close(fig)
    write_atomically(path, buffer.getvalue())
    print("figure:", path)


def report_shared(out, names, command):
    """The shared protocol's tables, the loss curves and Figure 3 of the DEPTH_FIGURES runs."""
    seeds = range(command["config"]["seeds"])
    stats, tables = summarize(collect(out, names, seeds))
    write_results(out, "shared", command, markdown(tables), runs=stats, tables=tables)
    if not (plt := pyplot()):
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for n in names:
        if curves := [c for s in seeds if (c := evals(run_dir(out, n, s)))]:
            k = min(map(len, curves))  # the evaluations every seed reached, less step 0
            ax.plot([st for st, _ in curves[0][1:k]], np.mean([[v for _, v in c[1:k]]
                                                               for c in curves], 0),
                    label=n, ls="--" if n.startswith("looped") else "-")
    ax.set(xlabel="step", ylabel="validation loss (mean over seeds)",
           title=f"Validation loss, {out.name}")
    save(plt, fig, out / "curves.png")
    for run in [n for n in names if n in DEPTH_FIGURES]:
        try:  # checked before the sweep; it or its data may have gone since
            plot_depth_weights(plt, depth_weight_matrix(run_dir(out, run, 0)),
                               out / DEPTH_FIGURES[run], f"Depth weights, {run}, seed 0")
        except (CheckpointError, DataError) as e:
            print(f"no {DEPTH_FIGURES[run]}: {e}")


def plot_gaps(plt, curves, short, baseline, short_tokens, path):
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, pts in curves.items():
        for length, ls, run in (("long runs", "-", pts), ("short runs", "--", short.get(n, []))):
            tok, gap, se = (np.array([np.nan if p[i] is None else p[i] for p in run[1:]])
                            for i in range(3))
            if len(tok):
                line, = ax.plot(tok / 1e6, gap, ls=ls, label=f"{n} − {baseline}, {length}")
                ax.fill_between(tok / 1e6, gap - se, gap + se, alpha=0.2, color=line.get_color())
    ax.axhline(0, color="k", lw=0.8)
    ax.axvline(short_tokens / 1e6, color="grey", ls=":", label="end of the short runs")
    ax.set(xlabel="tokens seen (M)", ylabel="paired Δ validation loss (± SE over seeds)",
           title="The gap as training lengthens, each method at its best rate")
    save(plt, fig, path)


@torch.no_grad()
def depth_weight_matrix(source, n_windows=DEPTH_WINDOWS) -> np.ndarray:
    """(L, L): each effective layer's mean weight on each candidate over n_windows validation
    windows, KV heads and positions; NaN where not a candidate."""
    _, ckpt, model = snapshot(lambda: checkpoint_path(source), read_model)  # a live run's too
    T, L = model.config.block_size, model.config.n_eff_layer
    data_dir = ROOT / ckpt["data_dir"]  # relative to the repository, where train.py ran
    if not (data_dir / "val.bin").is_file():
        raise DataError(f"{data_dir / 'val.bin'} is missing: the depth weights are read on the "
                        f"run's validation data; prepare it again (python prepare_data.py)")
    val = read_tokens(data_dir, "val", load_meta(data_dir))
    starts = np.linspace(0, len(val) - T - 1, n_windows).astype(np.int64)
    m = np.full((L, L), np.nan)
    with train.capture_depth_weights(model.eval()) as alphas:
        model(torch.from_numpy(np.stack([val[s:s + T] for s in starts]).astype(np.int64)))
    for e, (sources, alpha) in alphas.items():  # alpha: (B, n_kv_head, candidates, T)
        m[e, sources + [e]] = alpha.double().mean(dim=(0, 1, 3)).numpy()
    return m


def plot_depth_weights(plt, m, path, title):
    """Figure 3's heatmap: layer by candidate, each cell's weight."""
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, origin="upper")
    for (i, j), v in np.ndenumerate(m):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="w" if v < 0.6 else "k")
    ax.set(xlabel="candidate layer (diagonal = the layer itself)", ylabel="layer", title=title)
    fig.colorbar(im, ax=ax, label="mean depth weight")
    save(plt, fig, path)


def show_depth_weights(source, figure):
    """--depth_weights=RUN: the table printed, the heatmap drawn (default beside the checkpoint)."""
    if is_hf_folder(source):  # an export keeps no validation data to read the weights on
        raise CheckpointError(f"{source} is a Hugging Face folder; --depth_weights reads a "
                              f"train.py run, its checkpoint and data: give the run it came from")
    path, m = checkpoint_path(source), depth_weight_matrix(source)
    if np.isnan(m).all():
        raise CheckpointError(f"{source}'s model computes no per-token depth weights (vanilla, the "
                              f"baselines and LIMe have none); give a run of a Depth-Attention "
                              f"mode")
    figure = output_file(figure or path.parent / "depth_weights.png", "--figure", "ablate.py")
    print(f"mean depth weights of {path} over {DEPTH_WINDOWS} validation windows (row: layer, "
          f"column: candidate)")
    print(table([[e, *("." if np.isnan(w) else f"{w:.2f}" for w in row)]
                      for e, row in enumerate(m) if np.isnan(row).sum() < len(m) - 1],
                     ["layer", *range(len(m))]))
    if plt := pyplot():
        run = path.parent.resolve()
        plot_depth_weights(plt, m, figure, f"Depth weights, {run.parent.name}/{run.name}")


def plot_run(run, figure):
    """--curves=RUN: losses, learning rate, tokens/s and depth weights on self, from log.jsonl."""
    records = read_log(run)
    trained, evaluated = ([r for r in records if r.get("kind") == k] for k in ("train", "eval"))
    if not trained:
        raise CheckpointError(f"{run}/log.jsonl has no training step to draw; give a train.py "
                              f"--out_dir that has trained")
    plt = pyplot(needed=True)
    figure = output_file(figure or Path(run) / "curves.png", "--figure", "ablate.py")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    weighed = [r for r in evaluated if r.get("depth_weights")]
    first = weighed[0]["depth_weights"] if weighed else {}
    panels = {"loss": {"train": [(r["step"], r["train_loss"]) for r in trained],
                       "val": [(r["step"], r["val_loss"]) for r in evaluated]},
              "learning rate": {"": [(r["step"], r["lr"]) for r in trained if "lr" in r]},
              "tokens / s": {"": [(r["step"], r["tok_per_s"]) for r in trained
                                  if "tok_per_s" in r]},
              "depth weights, on itself (1 = vanilla)": {
                  **{f"layer {e}": [(r["step"], r["depth_weights"][e][e]) for r in weighed]
                     for e in first},
                  "mean": [(r["step"], np.mean([row[e] for e, row in r["depth_weights"].items()]))
                           for r in weighed]}}
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for name, points in lines.items():
            if points:
                ax.plot(*zip(*points), "k--" if name == "mean" else "o-" if len(points) < 50
                        else "-", label=name or None, lw=0.8)
        ax.set(xlabel="step", title=title)
    timed = [r["elapsed_s"] for r in records if "elapsed_s" in r]
    fig.suptitle(f"{run}: {trained[-1]['step']} steps in {train.clock(timed[-1])}" if timed
                 else str(run))
    save(plt, fig, figure, dpi=110)
    print(f"{len(trained)} steps of {run} drawn")


def main(argv):
    cfg, extra, lrs, names = parse_args(argv)
    if cfg["depth_weights"]:
        return show_depth_weights(cfg["depth_weights"], cfg["figure"])
    if cfg["curves"]:
        return plot_run(cfg["curves"], cfg["figure"])
    return run_protocol(cfg, extra, lrs, names)


if __name__ == "__main__":
    sys.exit(run_main(main))
