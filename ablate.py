r"""
The paper's main comparison (section 3.1, Table 1: vanilla, Depth-Attention and the three
hidden-state baselines) and its ablations (section 3.3: Tables 5-6, Figure 4, looped), as a sweep of
train.py runs x seeds.

    python ablate.py --runs=ablations              # the CPU ablation sweep on Shakespeare (~1 h, 2 cores)
    python ablate.py --runs=main --out=out/ablate_main  # Table 1 at CPU scale: vanilla, value, baselines
    python ablate.py --base=configs/ablations/base.py --out=out/ablate_minipile --seeds=2 --jobs=1 \
        --runs=vanilla,value -- --compile=True     # on a GPU: MiniPile, 85M; after `--`: train.py keys

Every run is the base config, then its delta files from configs/ablations/, then the overrides after
`--`, then --seed and --out_dir: every mode gets the same budget and hyperparameters. A run in --out
is reused if finished, or resumed from its checkpoint, only when train.py recorded the config asked
for, so re-running the same command completes a partial sweep; any other run there (other settings,
an unreadable log or checkpoint) stops the command before it trains, naming it: pick a new --out, or
--overwrite=True retrains it from scratch. Writes <out>/results.{md,json}, and with matplotlib
<out>/curves.png and <out>/depth_weights*.png.

    python ablate.py --depth_weights=out/ablate_cpu/value/seed0   # one run's depth weights
                                            # (Figure 3), printed and drawn; trains nothing
    python ablate.py --curves=out/shakespeare     # one train.py run's curves from its log.jsonl

A peak learning rate that suits one method can handicap another, so three more protocols compare
each method at its own best rate and follow the gap as training lengthens (one command each, in
this order):

    python ablate.py --protocol=lr_sweep --runs=vanilla,value   # every run at each of --lrs
    python ablate.py --protocol=best_lr --runs=vanilla,value    # paired seeds, shared and best rates
    python ablate.py --protocol=long --long_runs=vanilla,value  # --long_factor x the steps, best rates

This file runs the sweep: it parses the command, plans the jobs and checks every folder they touch,
runs train.py for each and calls the protocol's report. The tables, results files and figures are
support/report.py's; the depth-weight viewer behind --depth_weights is
support/depth_weights_view.py.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from baselines import DEPTH_MODES
from support import depth_weights_view, report, run_config
from support.cli import not_a_choice
from support.outputs import output_file
from support.run_dir import run_folder
from support.config import Key, argument_updates, check_keys, key_table, parse_config
from support.errors import EXIT_USER_ERROR, CheckpointError, ConfigError, UserError, run_main
# summarize: tests/helpers.py reads the paired table as ablate.summarize
from support.report import DEPTH_FIGURES, MAIN, RESULTS, summarize  # noqa: F401
from support.sweep import final_val_loss, run_dir, survey, train_config

ROOT = Path(__file__).resolve().parent
KEYS = {
    "base": Key("configs/ablations/cpu.py",
                "the shared base config; GPU: configs/ablations/base.py", path=True),
    "out": Key("out/ablate_cpu", "one folder per run and seed below it, plus the results",
               path=True),
    "runs": Key("all", "comma-separated names from RUNS or RUN_SETS (all, main, ablations, "
                "keyless_study)"),
    "seeds": Key(3, "seeds 0 .. seeds-1 for every run", ">= 1"),
    "jobs": Key(2, "train.py processes at once (CPU: one per core, one thread each)", ">= 1"),
    "threads": Key(0, "torch threads per process; 0 = the cores shared out among the jobs", ">= 0"),
    "protocol": Key("shared", "see the docstring", choices=tuple(RESULTS)),
    "lrs": Key("1e-3,2e-3,3e-3,6e-3", "lr_sweep: the peak learning rates tried for every run"),
    "lr_seeds": Key(1, "lr_sweep: seeds per rate; best_lr reuses its runs where seed and rate "
                    "match", ">= 1"),
    "long_runs": Key("vanilla,value", "long: the runs trained longer; the first is the baseline "
                     "of the gap"),
    "long_factor": Key(5, "long: this many times the base's max_iters (and tokens)", ">= 1"),
    "depth_weights": Key("", "a run folder or checkpoint: print and draw its depth weights, "
                         "training nothing (Figure 3)"),
    "curves": Key("", "a run folder: draw its loss, learning rate, tokens/s and depth weights "
                  "over steps, training nothing"),
    "figure": Key("", "where --depth_weights or --curves draws; default <run>/depth_weights.png, "
                  "<run>/curves.png"),
    "overwrite": Key(False, "retrain from scratch, deleting them, the runs in --out that cannot "
                     "be reused (trained with other settings, or with an unreadable record)"),
}
DEFAULTS, HELP, _, CHOICES = key_table(KEYS)
# run name -> delta files in configs/ablations/, applied after the base: every row of the table of
# depth modes (its file mode_<name>.py), then the strides, a fork's source rules (every
# source_<name>.py, docs/forking.md), the looped pair and the baselines
RUNS = {
    **{mode: [f"mode_{mode}"] for mode in DEPTH_MODES},
    **{stride: [stride] for stride in ("stride_first", "stride_quarter", "stride_full")},
    **{p.stem: [p.stem] for p in sorted((ROOT / "configs" / "ablations").glob("source_*.py"))},
    "looped_vanilla": ["looped", "mode_vanilla"], "looped_value": ["looped", "mode_value"],
    **{residual: [f"residual_{residual}"] for residual in ("denseformer", "attnres", "mhc")},
    "keyless": ["attention_keyless", "mode_vanilla"], "keyless_value": ["attention_keyless"],
}
KEYLESS = ["vanilla", "value", "keyless", "keyless_value"]  # related work beside the paper's runs
RUN_SETS = {"all": list(RUNS), "main": MAIN, "keyless_study": KEYLESS,
            "ablations": [n for n in RUNS if n not in MAIN[2:] + KEYLESS[2:]]}
# train.py keys that ablate.py sets for every run: given after `--`, they would be overridden or
# fight it
OWN_KEYS = {"seed": "the seeds are 0 .. --seeds-1",
            "out_dir": "every run has its folder below --out",
            "resume": "a started run is resumed anyway",
            "overwrite": "ablate.py's own --overwrite retrains"}


class TrainFailed(UserError):
    """A train.py job stopped on a user error (its exit status 2): the job's error line and its
    train.out say it all, in one line."""


class TrainCrashed(Exception):
    """A train.py job that ended with a traceback (a bug) or by a signal: no user error, so not a
    UserError either: ablate.py ends with a traceback that carries the job's tail and its log."""


def run_files(base, name):
    return [base] + [str(ROOT / "configs" / "ablations" / f"{d}.py") for d in RUNS[name]]


def label(job):
    name, seed, lr, factor = job
    return (f"{name} seed {seed}" + (f" lr {lr:g}" if lr is not None else "")
            + (f" x{factor}" if factor > 1 else ""))


def train_args(job, base, extra, out):
    """train.py's arguments for a job (run, seed, peak rate or None, step factor) but --resume."""
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
        raise CheckpointError(f"{len(stale)} run(s) in {out} cannot be reused: {shown}{more}; "
                              f"{fix}")
    # the folders of the runs to train: train.py's (marked now, with train.out among its files),
    # or found foreign or unwritable before anything trains
    for job in jobs:
        if plans[job][0] != "done":
            run_folder(run_dir(out, *job), plans[job][0] == "resume").record()
    return {job: (state, args) for job, (state, _, args) in plans.items() if job in jobs}


def train_one(job, state, args, out, threads):
    """Train, resume or report finished one job; a stale run goes wholly first (--overwrite)."""
    where = run_dir(out, *job)
    if state == "done":
        return f"{label(job)}: done already"
    if state == "stale":  # train.py's files go; any other file stays (folders.Folder.clear)
        run_folder(where, False).clear()
    resume = ["--resume=True"] if state == "resume" else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # a resume's output follows the run's before
    with open(where / "train.out", "a" if resume else "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *resume], stdout=log,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise job_failure(job, proc.returncode, where / "train.out")
    loss = final_val_loss(where)
    return f"{label(job)}: " + (f"val_loss {loss:.4f}" if loss is not None
                                else "stopped before the end")


def job_failure(job, code, log) -> Exception:
    """What a train.py job that exited with code (negative: a signal's) says: its error line for a
    user error (exit 2), else its traceback or last line, each naming its log."""
    lines = log.read_text(errors="replace").strip().splitlines() or ["no output"]
    if code == EXIT_USER_ERROR:
        return TrainFailed(f"{label(job)} failed (exit 2: {lines[-1]}); see {log}")
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")),
                default=len(lines) - 1)
    how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
    return TrainCrashed(f"{label(job)} crashed ({how}), see {log}; it ends:\n"
                        + "\n".join(lines[start:]))


def run_all(cfg, out, threads, plans):
    """Train the planned jobs, cfg["jobs"] at a time, in the order given (seed-major lists: early
    results cover every run). A failed run, Ctrl-C or any other exception starts no further run;
    the ones started end (Ctrl-C stops them too)."""
    pool = ThreadPoolExecutor(cfg["jobs"])
    try:
        for msg in pool.map(lambda job: train_one(job, *plans[job], out, threads), plans):
            print(msg, flush=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        raise KeyboardInterrupt("every started run keeps its last checkpoint: rerun the same "
                                "command to continue") from None  # run_main: one line, 130
    except BaseException:  # a failed run (TrainFailed) or a bug: no queued run starts
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()


def parse_args(argv):
    """(ablate.py's config, train.py's arguments after `--`, the peak rates, the run names): the
    command's syntax and values checked, reading no file but the config files after `--` and
    training nothing (main checks the paths and the machine). A ConfigError names the fix; --help
    prints the usage, SystemExit(0)."""
    split = argv.index("--") if "--" in argv else len(argv)
    extra = argv[split + 1:]
    cfg = parse_config(DEFAULTS, argv[:split], __doc__, CHOICES, HELP)
    check_keys(cfg, KEYS)
    # train.py's arguments, read as train.py reads them (--key value too), so a malformed one or
    # an unknown key stops the sweep before it starts; their values are checked per run
    list(argument_updates(extra, run_config.DEFAULTS))
    own = sorted(OWN_KEYS.keys() & {a[2:].partition("=")[0] for a in extra if a.startswith("--")})
    if own:
        raise ConfigError(f"--{own[0]} after -- is ablate.py's to set ({OWN_KEYS[own[0]]}); "
                          f"drop it")
    try:  # the peak rates, sorted and distinct
        lrs = sorted({float(x) for x in cfg["lrs"].split(",") if x.strip()})
    except ValueError:  # float() of a word: only the user's text is parsed here
        raise ConfigError(f"--lrs must be comma-separated numbers, got {cfg['lrs']!r}") from None
    if not lrs or min(lrs) <= 0 or not all(map(math.isfinite, lrs)):
        raise ConfigError(f"--lrs must list positive, finite peak rates, got {cfg['lrs']!r}")
    runs = cfg["long_runs"] if cfg["protocol"] == "long" else cfg["runs"]
    names = list(dict.fromkeys(n for part in runs.split(",") if part.strip()
                               for n in RUN_SETS.get(part.strip(), [part.strip()])))
    unknown = [n for n in names if n not in RUNS] or ([] if names else [runs])
    if unknown:
        flag = "--long_runs" if cfg["protocol"] == "long" else "--runs"
        raise not_a_choice(flag, unknown[0], [*RUNS, *RUN_SETS])
    if cfg["protocol"] == "long" and (len(names) < 2 or cfg["long_factor"] < 2):
        raise ConfigError(f"--protocol=long trains --long_factor >= 2 times the steps and compares "
                          f"every run with the first of --long_runs: give two runs or more and a "
                          f"factor of 2 or more, got {names} x{cfg['long_factor']}")
    if cfg["figure"] and not (cfg["depth_weights"] or cfg["curves"]):
        raise ConfigError(f"--figure={cfg['figure']} is where --depth_weights=RUN or --curves=RUN "
                          f"draws; give the run too")
    return cfg, extra, lrs, names


def run_protocol(cfg, extra, lrs, names):
    """Check every path and run this command touches (and this machine's cores), train what is
    missing, write the protocol's results (support/report.py)."""
    cores = os.cpu_count() or 1
    if cfg["threads"] > cores:
        raise ConfigError(f"--threads={cfg['threads']} exceeds this machine's {cores} cores; "
                          f"give at most {cores} (0 = the cores shared among the jobs)")
    if not Path(cfg["base"]).is_file():
        raise ConfigError(f"base config {cfg['base']} not found (a relative path starts in the "
                          f"current folder)")
    protocol, out, seeds = cfg["protocol"], Path(cfg["out"]).resolve(), range(cfg["seeds"])
    # train.py runs in ROOT, so its paths are absolute: relative ones mean ablate.py's folder
    base = str(Path(cfg["base"]).resolve())
    args = [a if a.startswith("--") else str(Path(a).resolve()) for a in extra]
    # every run's files and overrides, resolved and checked as train.py checks them (a model key's
    # choices are its config's): a wrong key or value stops the sweep up front
    for name in names:
        try:
            run_config.check_keys(train_config(run_files(base, name) + args))
        except ConfigError as e:
            raise ConfigError(f"the {name} run: {e}") from None
    report.check_outputs(out, protocol, names, RUNS)
    threads = cfg["threads"] or max(1, cores // cfg["jobs"])

    def train(jobs, reads=(), figures=()):
        run_all(cfg, out, threads, plan(cfg, base, args, out, jobs, reads, figures))
    command = {"config": cfg, "train_overrides": extra}  # recorded in every results.json
    sweep = [(n, s, lr, 1) for s in range(cfg["lr_seeds"]) for lr in lrs for n in names]
    if protocol == "shared":
        jobs = [(n, s, None, 1) for s in seeds for n in names]
        train(jobs, figures=[(run, 0, None, 1) for run, _ in DEPTH_FIGURES])
        return report.shared(out, names, command)
    if protocol == "lr_sweep":
        train(sweep)
        return report.lr_sweep(out, names, lrs, command)
    plan(cfg, base, args, out, [], reads=sweep)  # the sweep's runs, whose best rates this takes
    best, _ = report.best_rates(out, names, lrs, cfg["lr_seeds"])
    start = train_config([base, *args])  # the base's schedule, shared by every run
    if protocol == "best_lr":
        shared = float(start["learning_rate"])
        train([(n, s, lr, 1) for s in seeds for n in names for lr in (shared, best[n])])
        return report.best_lr(out, names, best, shared, command)
    factor = cfg["long_factor"]  # best_lr's short runs are drawn beside the long ones
    train([(n, s, best[n], factor) for s in seeds for n in names],
          reads=[(n, s, best[n], 1) for s in seeds for n in names])
    return report.long(out, names, best, factor, start["max_iters"], start["batch_tokens"],
                       command)


def main(argv):
    cfg, extra, lrs, names = parse_args(argv)
    if cfg["depth_weights"]:
        return depth_weights_view.show(cfg["depth_weights"], cfg["figure"])
    if not cfg["curves"]:
        return run_protocol(cfg, extra, lrs, names)
    # --curves=RUN: into --figure, default RUN/curves.png (replaced only if ablate.py drew it)
    figure = output_file(cfg["figure"] or Path(cfg["curves"]) / "curves.png", "--figure",
                         written_by="ablate.py")
    print(f"{report.plot_run(cfg['curves'], figure)} steps of {cfg['curves']} drawn: {figure}")


if __name__ == "__main__":
    sys.exit(run_main(main))
