"""lab/ablate.py end to end on a tiny config: a sweep interrupted and resumed, its table and
figures; the runs already in --out reused only when they are the runs asked for; the learning-rate
protocols; one run's depth weights and curves; and bad input as one `error:` line before anything
trains."""
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from configurator import UserError, run_main
from lab import ablate as ablate_py

BASE = ("n_layer = 4\nn_head = 2\nn_kv_head = 1\nhead_dim = 8\nn_embd = 16\nmlp_hidden = 32\n"
        "block_size = 32\nmicro_batch = 4\nbatch_tokens = 128\nmax_iters = 3\neval_interval = 2\n"
        "eval_seqs = 4\nlearning_rate = 1e-2\nvocab_size = None\n")  # None, as the shipped bases


def ablate(*args):
    """lab/ablate.py's main in this process (train.py still runs in its own); what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ablate_py.main([str(a) for a in args])
    return printed.getvalue()


def refused(*args, main=ablate_py.main):
    """The one `error:` line the entry point (run_main) stops with, exit status 2 (after a
    warning, if any)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run_main(main, [str(a) for a in args])
    *warnings, msg = err.getvalue().strip().splitlines() or [""]
    assert code == 2 and msg.startswith("error: "), err.getvalue()
    assert all(w.startswith("warning: ") for w in warnings), err.getvalue()
    return msg


def files(folder):
    return {p.relative_to(folder): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def records(run):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def drawn(png):
    img = matplotlib.image.imread(png)
    return img.ndim == 3 and img.shape[0] > 100 and np.ptp(img) > 0


@pytest.fixture(scope="module")
def base(data_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "base.py"
    path.write_text(f'dataset = "tiny"\ndata_root = "{data_root}"\n' + BASE)
    return path


@pytest.fixture(scope="module")
def sweep(base, tmp_path_factory):
    """(out, the command, what the sweep printed, the steps value logged when interrupted);
    out.with_name("started") keeps the interrupted run."""
    out = tmp_path_factory.mktemp("sweep") / "out"
    args = [f"--base={base}", f"--out={out}", "--runs=vanilla,value", "--seeds=1", "--jobs=2"]
    ablate(*args, "--runs=value", "--", "--stop_at_step=2")  # interrupted after step 2
    interrupted = [r["step"] for r in records(out / "value" / "seed0")]
    shutil.copytree(out, out.with_name("started"))
    return out, args, ablate(*args), interrupted


def copy(sweep, tmp_path, started=False):
    """The sweep's folder (or its interrupted runs) copied, and the command on the copy."""
    out, args = tmp_path / "out", sweep[1][:1] + sweep[1][2:]
    shutil.copytree(sweep[0].with_name("started") if started else sweep[0], out)
    return out, [*args, f"--out={out}"]


def test_a_partial_sweep_is_resumed_and_reported(sweep):
    out, _, printed, interrupted = sweep
    results = json.loads((out / "results.json").read_text())
    assert max(interrupted) == 2 and "value seed 0: val_loss" in printed
    said = (out / "value" / "seed0" / "train.out").read_text()  # both invocations': resumed
    assert "stopping at step 2" in said and said.count("eval step 0 ") == 1
    for run in ("vanilla", "value"):
        log = records(out / run / "seed0")
        assert [r["step"] for r in log if r["kind"] == "train"] == [1, 2, 3]
        assert results["runs"][run]["losses"] == [log[-1]["val_loss"]]
    mixing = next(t for t in results["tables"] if t["title"].startswith("Mixing rule"))
    vanilla, value = mixing["rows"]
    assert value["diff"] == pytest.approx(value["mean"] - vanilla["mean"])
    assert value["paper"] == 2.2115 and value["std"] is None  # one seed: no spread
    assert "| value | 1 |" in (out / "results.md").read_text() and "| value | 1 |" in printed
    assert drawn(out / "curves.png") and drawn(out / "depth_weights.png")


def test_a_rerun_reuses_finished_runs_without_a_process(sweep, tmp_path, monkeypatch):
    """A finished run is reused when it is the run asked for in every key that changes a number
    (log_interval changes none); nothing starts, and the same numbers are reported."""
    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")
    monkeypatch.setattr(subprocess, "run", no_process)
    out, args = copy(sweep, tmp_path)
    before = files(out / "value")
    assert ablate(*args, "--", "--log_interval=7").count("done already") == 2
    assert files(out / "value") == before
    assert (json.loads((out / "results.json").read_text())["tables"]
            == json.loads((sweep[0] / "results.json").read_text())["tables"])


@pytest.mark.parametrize("case, expected", [
    ("override", "max_iters 3 -> 4"),
    ("mixed_resume", "resumed at step 2 with learning_rate 0.003 -> 0.01"),
    ("started", "value seed 0 (checkpoint at step 2; learning_rate 0.01 -> 0.003)"),
    ("torn_log", "log.jsonl lacks the final evaluation"),
    ("empty_config", "config.json is not a train.py config"),
    ("empty_ckpt", "ckpt.pt is not a readable checkpoint"),
])
def test_a_run_that_cannot_be_reused_stops_the_sweep_before_training(sweep, tmp_path, case,
                                                                     expected):
    """Other settings, or a record cut short: one line naming the run and the fix, nothing
    touched (it used to say "done already" and report the old run's numbers as the new ones)."""
    out, args = copy(sweep, tmp_path, started=case in ("started", "empty_ckpt"))
    run = out / ("vanilla" if case in ("torn_log", "empty_config") else "value") / "seed0"
    extra = {"override": ["--", "--max_iters=4"],
             "started": ["--", "--learning_rate=3e-3"]}.get(case, [])
    if case == "mixed_resume":  # half trained at another rate, then resumed at the asked one
        config = json.loads((run / "config.json").read_text())
        config["resumes"] = [{"step": 2, "changed": {"learning_rate": [0.003, 0.01]}}]
        (run / "config.json").write_text(json.dumps(config))
    broken = run / {"torn_log": "log.jsonl", "empty_config": "config.json"}.get(case, "ckpt.pt")
    if case in ("torn_log", "empty_config", "empty_ckpt"):
        broken.write_bytes(broken.read_bytes()[:-20] if case == "torn_log" else b"")
    before = files(out)
    msg = refused(*args, *extra)
    assert expected in msg and "--overwrite=True" in msg and "new --out" in msg, msg
    assert files(out) == before


def test_overwrite_retrains_a_stale_run_from_any_folder(sweep, tmp_path, monkeypatch):
    """--overwrite=True deletes train.py's files of the stale run and retrains it (the user's file
    stays); a run outside --runs is left alone. Relative --base and --out mean the current
    folder (train.py runs in the repository)."""
    out, _ = copy(sweep, tmp_path)
    shutil.copy(sweep[1][0].partition("=")[2], tmp_path / "base.py")
    monkeypatch.chdir(tmp_path)
    run = out / "vanilla" / "seed0"
    (run / "notes.txt").write_text("the user's")
    value = files(out / "value")
    ablate("--base=base.py", "--out=out", "--runs=vanilla", "--seeds=1", "--overwrite=True", "--",
           "--max_iters=4")
    assert (run / "notes.txt").read_text() == "the user's"
    assert [r["step"] for r in records(run) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert json.loads((out / "results.json").read_text())["runs"]["vanilla"]["losses"] == \
        [records(run)[-1]["val_loss"]]
    assert files(out / "value") == value


@pytest.mark.parametrize("case, expected", [
    ("out_is_a_file", "is a file"),
    ("foreign_out", "was not written by ablate.py"),
    ("results_md", "results.md is a folder"),
    ("run_folder", "part of its path is a file"),
])
def test_output_paths_are_checked_before_training(sweep, tmp_path, case, expected):
    out, args = copy(sweep, tmp_path)
    if case == "out_is_a_file":
        out = tmp_path / "a_file"
        out.write_text("mine")
    elif case == "foreign_out":
        out = tmp_path / "photos"
        out.mkdir()
        (out / "cat.jpg").write_text("mine")
    elif case == "run_folder":  # value must train again, but a file sits where its folder goes
        shutil.rmtree(out / "value")
        (out / "value").write_text("mine")
    else:
        (out / "results.md").unlink()
        (out / "results.md").mkdir()
    before = files(tmp_path)
    assert expected in refused(*args, f"--out={out}")
    assert files(tmp_path) == before


def test_bad_input_is_one_line_before_training(sweep, tmp_path):
    out, args = copy(sweep, tmp_path)
    before = files(out)
    for flags, expected in [
            (["--", "--max_iter=20"], "did you mean --max_iters?"),
            (["--", "--seed", "5"], "--seed after -- is ablate.py's to set"),
            (["--", "--max_iters=None"], "--max_iters=None"),
            (["--", "--beta1=2"], "the vanilla run: --beta1 must be a finite number in [0, 1)"),
            (["--runs=Value"], "--runs=Value is not a choice; did you mean value?"),
            (["--lrs=fast"], "--lrs"), (["--seeds=0"], "--seeds"), (["--out="], "--out"),
            (["--protocol=long", "--long_runs=value"], "--long_runs"),
            (["--figure=a.png"], "give the run too"),
            (["--protocol=best_lr"], "run `python lab/ablate.py --protocol=lr_sweep`")]:
        assert expected in refused(*args, *flags), flags
    assert files(out) == before


def test_a_failed_train_py_is_one_line_a_crash_a_traceback(tmp_path, monkeypatch):
    """train.py's exit 2 is a user error, one line naming its log; its traceback or a signal is
    a bug: TrainCrashed, no UserError, with the traceback whole. A fake train.py: nothing trains."""
    monkeypatch.setattr(ablate_py, "ROOT", tmp_path)
    job, where = ("vanilla", 0, None, 1), tmp_path / "out" / "vanilla" / "seed0"
    where.mkdir(parents=True)

    def train_one(argv):
        ablate_py.train_one(job, "new", [], tmp_path / "out", 1)
    (tmp_path / "train.py").write_text("print('error: --foo is wrong')\nraise SystemExit(2)\n")
    assert "vanilla seed 0 failed (exit 2: error: --foo is wrong); see " \
        f"{where / 'train.out'}" in refused(main=train_one)
    for child, how in (("raise KeyError('depth_mode')", "exit 1"),
                       ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9")):
        (tmp_path / "train.py").write_text(f"import os, signal\nprint('step 0')\n{child}\n")
        with pytest.raises(ablate_py.TrainCrashed) as crash:
            train_one([])
        assert not isinstance(crash.value, UserError)
        msg = str(crash.value)
        assert f"vanilla seed 0 crashed ({how}), see {where / 'train.out'}" in msg, msg
        if how == "exit 1":  # the traceback whole, not the output before it
            assert "Traceback" in msg and "KeyError: 'depth_mode'" in msg and "step 0" not in msg


def test_ctrl_c_starts_no_further_run(base, tmp_path, monkeypatch):
    """Ctrl-C mid-sweep: one line, exit 130, and the queued runs never start."""
    started, finish = [], threading.Event()

    def train_one(job, *_):
        started.append(job)
        if len(started) == 1:  # Ctrl-C reaches the main thread while this run goes on
            os.kill(os.getpid(), signal.SIGINT)
            finish.wait(60)
        return "trained"
    monkeypatch.setattr(ablate_py, "train_one", train_one)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = run_main(ablate_py.main, [f"--base={base}", f"--out={tmp_path / 'out'}",
                                             "--runs=vanilla,value", "--seeds=2", "--jobs=1"])
    finally:
        signal.signal(signal.SIGINT, previous)
        finish.set()
    msg = err.getvalue().strip()
    assert code == 130 and "rerun the same command to continue" in msg and "\n" not in msg, msg
    assert len(started) == 1


def test_depth_weights_of_one_run_printed_and_drawn(sweep, tmp_path):
    """--depth_weights=RUN: a row per layer with sources, each a distribution over its candidates
    (4 layers, stride 2: layer 3 reads 0 and 2), the heatmap at --figure; training nothing."""
    run, vanilla = (sweep[0] / name / "seed0" for name in ("value", "vanilla"))
    before = files(sweep[0])
    printed = ablate(f"--depth_weights={run}", f"--figure={tmp_path / 'w.png'}")
    rows = {int(r.split()[0]): r.split()[1:] for r in printed.splitlines()[2:-1]}
    assert list(rows) == [1, 2, 3] and rows[3][1] == "."
    assert all(sum(float(w) for w in r if w != ".") == pytest.approx(1, abs=0.02)
               for r in rows.values())
    assert drawn(tmp_path / "w.png") and files(sweep[0]) == before
    ablate(f"--depth_weights={run}", f"--figure={tmp_path / 'w.png'}")  # its own: replaced
    notes = tmp_path / "notes.png"
    notes.write_text("mine")
    assert "was not written by ablate.py" in refused(f"--depth_weights={run}",
                                                     f"--figure={notes}")
    assert "no per-token depth weights" in refused(f"--depth_weights={vanilla}")
    assert "no checkpoint at" in refused(f"--depth_weights={tmp_path / 'nothing'}")
    (tmp_path / "hf").mkdir()  # an export: the run it came from holds the data
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_text("")
    assert "is a Hugging Face folder" in refused(f"--depth_weights={tmp_path / 'hf'}")


def test_curves_of_one_run(sweep, tmp_path):
    run = sweep[0] / "value" / "seed0"
    assert f"figure: {tmp_path / 'c.png'}\n3 steps of {run} drawn" in ablate(
        f"--curves={run}", f"--figure={tmp_path / 'c.png'}")
    assert drawn(tmp_path / "c.png")
    assert "no training step to draw" in refused(f"--curves={tmp_path}")


@pytest.fixture(scope="module")
def protocols(base, sweep, tmp_path_factory):
    """The learning-rate protocols: the sweep (at the base's 1e-2, the shared sweep's runs, copied
    as a user copies finished runs: reused), best_lr on its runs, the runs twice as long."""
    out = tmp_path_factory.mktemp("protocols") / "out"
    for run in ("vanilla", "value"):
        shutil.copytree(sweep[0] / run / "seed0", out / run / "lr0.01" / "seed0")
    common = [f"--base={base}", f"--out={out}", "--runs=vanilla,value", "--lrs=1e-3,1e-2",
              "--jobs=2", "--seeds=1"]
    assert ablate(*common, "--protocol=lr_sweep").count("done already") == 2
    best_lr = ablate(*common, "--protocol=best_lr")
    ablate(*common, "--protocol=long", "--long_runs=vanilla,value", "--long_factor=2")
    return out, best_lr, common


def final(out, run, sub, seed=0):
    return [r for r in records(out / run / sub / f"seed{seed}") if r["kind"] == "eval"]


def test_the_protocols_take_each_runs_best_rate_and_follow_the_gap(protocols):
    out, best_lr, _ = protocols
    sweep = json.loads((out / "results_lr_sweep.json").read_text())
    for run in ("vanilla", "value"):
        losses = {lr: final(out, run, f"lr{lr:g}")[-1]["val_loss"] for lr in (1e-3, 1e-2)}
        assert sweep["means"][run] == {f"{lr:g}": v for lr, v in losses.items()}
        assert sweep["best"][run] == min(losses, key=losses.get)
    best = sweep["best"]
    # best_lr reuses the sweep's runs at the shared rate (1e-2) and at each best rate
    assert best_lr.count("done already") == len({(r, lr) for r in best for lr in (1e-2, best[r])})
    res = json.loads((out / "results_best_lr.json").read_text())
    row = res["tables_best"][0]["rows"][1]
    d = (final(out, "value", f"lr{best['value']:g}")[-1]["val_loss"]
         - final(out, "vanilla", f"lr{best['vanilla']:g}")[-1]["val_loss"])
    assert res["shared_rate"] == 1e-2 and row["run"] == "value" and row["diff"] == pytest.approx(d)
    long = json.loads((out / "results_long.json").read_text())
    runs = {r: final(out, r, f"long2x_lr{best[r]:g}") for r in best}
    curve = long["gaps"]["value"]
    assert [p[0] for p in curve] == [r["step"] * 128 for r in runs["value"]]  # tokens
    assert runs["value"][-1]["step"] == 6  # twice the base's 3 steps
    assert curve[-1][1] == pytest.approx(runs["value"][-1]["val_loss"]
                                         - runs["vanilla"][-1]["val_loss"])
    short = long["gaps_short"]["value"][-1]  # beside them, the short runs at the best rates
    assert short[0] == 3 * 128 and short[1] == pytest.approx(d)
    assert f"| value | short | 0.00 | {short[1]:+.4f} |" in (out / "results_long.md").read_text()
    assert drawn(out / "gap_vs_tokens.png")
    before = files(out)  # best_lr reads the sweep's runs: stale ones point at the sweep
    msg = refused(*protocols[2], "--protocol=best_lr", "--", "--max_iters=5")
    assert "max_iters 3 -> 5" in msg and "rerun the protocols that train them" in msg, msg
    assert files(out) == before


def test_the_main_table_pairs_seeds_and_quotes_the_paper(tmp_path):
    """Table 1 at CPU scale, from logs alone: Δ paired by seed, perplexity = exp(val loss), the
    paper's 3B figures; and the run sets cover every run."""
    sets = ablate_py.RUN_SETS
    assert set(sets["main"]) | set(sets["ablations"]) | set(sets["keyless_study"]) == \
        set(sets["all"])
    losses = {"vanilla": [2.0, 2.2], "value": [1.9, 2.0], "lime": [1.92, 2.05],
              "denseformer": [1.95, 2.1], "attnres": [2.0, 2.1], "mhc": [2.05, 2.15]}
    for run, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            d = tmp_path / run / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps({"max_iters": 10}))
            (d / "log.jsonl").write_text(json.dumps({"kind": "eval", "step": 10,
                                                     "val_loss": loss}) + "\n")
    _, tables = ablate_py.summarize(ablate_py.collect(tmp_path, ablate_py.MAIN, range(2)))
    assert tables[0]["main"] and [r["run"] for r in tables[0]["rows"]] == ablate_py.MAIN
    md = ablate_py.markdown(tables)
    assert "| value | 2 | 1.9500 ± 0.0707 | -0.1500 ± 0.0707 | -3.0 | 7.037 ± 0.497 | 7.25 | " \
           "55.69 |" in md
    assert "| mhc | 2 |" in md and "| n/a | 54.68 |" in md


def test_a_source_rule_is_ablated_by_its_delta_file_alone(tmp_path, monkeypatch):
    """docs/forking.md: configs/ablations/source_<name>.py is a run of that name, with no edit of
    lab/ablate.py (a copy of it beside the new file sees it)."""
    import importlib.util
    (tmp_path / "configs" / "ablations").mkdir(parents=True)
    (tmp_path / "lab").mkdir()
    shutil.copy(ablate_py.__file__, tmp_path / "lab" / "ablate.py")
    (tmp_path / "configs" / "ablations" / "source_back.py").write_text("depth_stride = 2\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the copy puts its folder first
    spec = importlib.util.spec_from_file_location("ablate_copy", tmp_path / "lab" / "ablate.py")
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    assert fork.RUNS["source_back"] == ["source_back"] and "source_back" not in ablate_py.RUNS
    assert fork.parse_args(["--runs=value,source_back"])[3] == ["value", "source_back"]
