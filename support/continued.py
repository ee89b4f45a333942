"""
The rate a train.py run --init_from trained weights starts at (--init_lr), imported only for
--init_from. A run's rate warms up to its peak and decays by a cosine to min_lr_ratio of it over
max_iters (train.lr_at); a finished run has decayed to that floor, and starting its continuation at
a new run's peak again undoes part of what the decay gained (docs/results.md measures it).
"""
import sys


def continue_schedule(cfg, init, rate_asked, master=True):
    """cfg's learning_rate for a run from init (checkpoint.Loaded), with the one line that says so:
    --init_lr=last (the default) re-warms a finished train.py run (its step reached its max_iters)
    to the rate it ended at, its floor; a released model, whose schedule is unknown, is warned
    about. A learning_rate asked for (rate_asked), --init_lr=peak and a run stopped early keep
    cfg's."""
    run = init.config or {}
    if rate_asked:
        return
    if cfg["init_lr"] == "last" and (init.step or 0) >= run.get("max_iters", float("inf")):
        cfg["learning_rate"] = run["learning_rate"] * run["min_lr_ratio"]
        if master:
            print(f"--init_from={cfg['init_from']} finished its schedule: the rate re-warms to its "
                  f"final {cfg['learning_rate']:.3g} (--init_lr=last); --init_lr=peak or "
                  f"--learning_rate sets another peak")
    elif init.step is None and master:
        print(f"warning: --init_from={cfg['init_from']} has no schedule here to continue: it "
              f"trains at a new run's peak, {cfg['learning_rate']:g}; give --learning_rate (a "
              f"fraction of its pretraining rate)", file=sys.stderr)
