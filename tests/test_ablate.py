"""ablate.py end to end on a tiny config: two runs x one seed, a couple of steps, the table and both
figures; and what it does with the runs already in --out, and with bad input: one `error:` line
before anything trains."""
import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

import ablate as ablate_py
from support import depth_weights_view, sweep as sweep_records
from support.depth_weights_view import depth_weight_matrix
from support.folders import MANIFEST
from support.errors import ShowHelp, UserError, run_main
from support.report import MAIN, collect, gap_markdown, markdown, summarize


def ablate(*args):
    """ablate.py's main in this process (train.py still runs in its own); what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ablate_py.main([str(a) for a in args])
    return printed.getvalue()


def refused(*args, main=ablate_py.main):
    """The one `error:` line ablate.py's entry point (run_main) stops with, exit status 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(main, [str(a) for a in args])
    msg = err.getvalue().strip()
    assert code == 2 and msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def files(folder):
    return {p.relative_to(folder): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def records(run):
    """A run folder's log.jsonl, a record a line."""
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def started(out):
    """Where the sweep fixture keeps its runs as they were when interrupted: the tests of a started
    run."""
    return out.with_name(out.name + "_started")


@pytest.fixture(scope="module")
def sweep(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "out"
    base = out.parent / "base.py"  # the CPU base, shrunk further
    # vocab_size = None as in the shipped bases: a resumed run must accept it (the data's
    # vocabulary)
    base.write_text(f'dataset = "tiny"\ndata_root = "{data_root}"\nvocab_size = None\nn_layer = 4\n'
                    f'n_head = 2\nn_kv_head = 1\nhead_dim = 8\nn_embd = 16\nmlp_hidden = 32\n'
                    f'block_size = 32\nmicro_batch = 4\n'
                    f'batch_tokens = 128\nmax_iters = 3\neval_interval = 2\neval_seqs = 4\n')
    args = [f"--base={base}", f"--out={out}", "--runs=vanilla,value", "--seeds=1", "--jobs=2"]
    ablate(*args, "--", "--stop_at_step=2")  # an interrupted sweep: every run stops after step 2
    interrupted = {run: [r["step"] for r in records(out / run / "seed0")]
                   for run in ("vanilla", "value")}
    shutil.copytree(out, started(out))
    return out, args, ablate(*args), interrupted


def test_a_partial_sweep_is_resumed(sweep):
    out, _, _, interrupted = sweep
    for run, steps in interrupted.items():
        assert max(steps) == 2, f"{run} should have stopped at step 2"
        log = records(out / run / "seed0")
        assert [r["step"] for r in log if r["kind"] == "train"] == [1, 2,
                                                                    3], "resumed, not restarted"
        assert "starting fresh" not in (out / run / "seed0" / "train.out").read_text()


def test_sweep_writes_the_table_and_figures(sweep):
    out, _, stdout, _ = sweep
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"vanilla", "value"}
    mixing = next(t for t in results["tables"] if t["title"].startswith("Mixing rule"))
    assert [r["run"] for r in mixing["rows"]] == ["vanilla", "value"]
    for run in ("vanilla", "value"):
        evals = records(out / run / "seed0")
        final = [r["val_loss"] for r in evals if r["kind"] == "eval" and r["step"] == 3]
        # the table reads the runs' own final evaluations
        assert results["runs"][run]["losses"] == final
    value = next(r for r in mixing["rows"] if r["run"] == "value")
    runs = results["runs"]
    assert value["diff"] == pytest.approx(runs["value"]["mean"] - runs["vanilla"]["mean"])
    assert value["paper"] == 2.2115 and value["std"] is None  # one seed: no spread to report
    assert "| value | 1 |" in (out / "results.md").read_text() and "| value | 1 |" in stdout
    for png in ("curves.png", "depth_weights.png"):
        img = matplotlib.image.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and np.ptp(img) > 0, f"{png} is empty"


def test_rerun_skips_finished_runs(sweep):
    out, args, _, _ = sweep
    before = (out / "value" / "seed0" / "log.jsonl").read_text()
    results = (out / "results.json").read_text()
    assert "value seed 0: done already" in ablate(*args)
    assert (out / "value" / "seed0" / "log.jsonl").read_text() == before
    # the same command reports the same numbers
    assert (out / "results.json").read_text() == results


def test_depth_weight_matrix_rows_are_distributions(sweep):
    m = depth_weight_matrix(sweep[0] / "value" / "seed0" / "ckpt.pt", n_windows=2)
    assert np.isnan(m[0]).all()  # layer 0 only stores
    assert np.allclose(np.nansum(m[1:], 1), 1.0)
    # 4 layers, stride 2: layer 3 reads 0, 2
    assert not np.isnan(m[3, [0, 2, 3]]).any() and np.isnan(m[3, 1])


def test_depth_weights_of_one_run_printed_and_drawn(sweep, tmp_path):
    """ablate.py --depth_weights=RUN: the table of depth_weight_matrix, the heatmap beside the run
    (or at --figure), training nothing; runs without depth weights and bad paths are one line."""
    run = sweep[0] / "value" / "seed0"
    before = files(sweep[0])
    printed = ablate(f"--depth_weights={run}", f"--figure={tmp_path / 'w.png'}")
    m = depth_weight_matrix(run / "ckpt.pt")
    rows = [line.split("|") for line in printed.splitlines()[2:] if "|" in line]
    assert [int(e) for e, _ in rows] == [1, 2, 3]  # layer 0 only stores
    for e, cells in rows:
        want = ["." if np.isnan(w) else f"{w:.2f}" for w in m[int(e)]]
        assert cells.split() == want
    img = matplotlib.image.imread(tmp_path / "w.png")
    assert img.ndim == 3 and np.ptp(img) > 0 and files(sweep[0]) == before
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert f"figure: {copy / 'depth_weights.png'}" in ablate(f"--depth_weights={copy}")
    assert (copy / "depth_weights.png").is_file()
    vanilla = sweep[0] / "vanilla" / "seed0"
    assert "no per-token depth weights" in refused(f"--depth_weights={vanilla}")
    assert "no checkpoint at" in refused(f"--depth_weights={tmp_path / 'nothing'}")
    assert "give the run too" in refused(f"--figure={tmp_path / 'w.png'}")
    assert "is a folder" in refused(f"--depth_weights={run}", f"--figure={tmp_path}")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert "was not written by ablate.py" in refused(f"--depth_weights={run}", f"--figure={notes}")
    assert notes.read_text() == "mine"
    photo = tmp_path / "photo.png"  # a user's own PNG: a figure, but not ablate.py's
    matplotlib.image.imsave(photo, np.zeros((4, 4, 3)))
    before_photo = photo.read_bytes()
    assert "was not written by ablate.py" in refused(f"--depth_weights={run}", f"--figure={photo}")
    assert photo.read_bytes() == before_photo
    ablate(f"--depth_weights={run}", f"--figure={tmp_path / 'w.png'}")  # its own figure: replaced
    for twice in range(2):  # a PDF it drew is its own too, the second time as the first
        ablate(f"--depth_weights={run}", f"--figure={tmp_path / 'w.pdf'}")
    (copy / "ckpt.pt").write_bytes((copy / "ckpt.pt").read_bytes()[:1000])
    assert "truncated or corrupt" in refused(f"--depth_weights={copy}")


def test_the_viewer_module_and_ablate_py_show_the_same(sweep, tmp_path):
    """The depth-weight viewer is support.depth_weights_view.show; ablate.py --depth_weights=RUN
    hands it the run: the same table printed and the same figure drawn."""
    run = sweep[0] / "value" / "seed0"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        depth_weights_view.show(run, tmp_path / "module.png")
    via_ablate = ablate(f"--depth_weights={run}", f"--figure={tmp_path / 'ablate.png'}")
    assert "layer |" in via_ablate and via_ablate.endswith(f"figure: {tmp_path / 'ablate.png'}\n")
    assert printed.getvalue().replace("module.png", "ablate.png") == via_ablate
    assert (tmp_path / "module.png").read_bytes() == (tmp_path / "ablate.png").read_bytes()


def test_staleness_reads_the_key_table_and_starts_no_process(sweep, tmp_path, monkeypatch):
    """Whether a finished run is the one asked for comes from support.run_config's table: a key
    marked result=False (log_interval) may differ, one marked True may not. Nothing asks
    `python train.py --help` (whose scraped text a two-space default once broke): no process
    starts while the sweep plans and reports its finished runs."""
    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")
    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    out = tmp_path / "out"
    shutil.copytree(sweep[0], out)
    args = [a for a in sweep[1] if not a.startswith("--out=")] + [f"--out={out}"]
    runs = {run: files(out / run) for run in ("vanilla", "value")}
    log_interval = sweep_records.TRAIN_KEYS["log_interval"]
    assert not log_interval.result
    assert ablate(*args, "--", "--log_interval=7").count("done already") == 2
    assert {run: files(out / run) for run in runs} == runs
    monkeypatch.setitem(sweep_records.TRAIN_KEYS, "log_interval",
                        dataclasses.replace(log_interval, result=True))
    assert "log_interval 25 -> 7" in refused(*args, "--", "--log_interval=7")
    eval_seqs = sweep_records.TRAIN_KEYS["eval_seqs"]
    assert eval_seqs.result and "eval_seqs 4 -> 8" in refused(*args, "--", "--eval_seqs=8")
    monkeypatch.setitem(sweep_records.TRAIN_KEYS, "eval_seqs",
                        dataclasses.replace(eval_seqs, result=False))
    assert ablate(*args, "--", "--eval_seqs=8").count("done already") == 2
    assert {run: files(out / run) for run in runs} == runs


def test_parse_args_checks_the_command_alone(tmp_path, monkeypatch):
    """ablate.parse_args, what a docs test runs on every command the docs show: the syntax and the
    values, no file read (the --base need not exist) and nothing written; a bad value is a
    UserError (never SystemExit), --help is ShowHelp with the usage."""
    monkeypatch.chdir(tmp_path)
    cfg, extra, lrs, names = ablate_py.parse_args(["--base=nowhere.py", "--runs=main",
                                                   "--lrs=2e-3,1e-3", "--", "--compile=True"])
    assert (cfg["base"], names, lrs) == ("nowhere.py", MAIN, [1e-3, 2e-3])
    assert extra == ["--compile=True"]
    assert not any(tmp_path.iterdir())
    for bad in (["--lrs=fast"], ["--lrs=0"], ["--runs=nope"], ["--protocol=slow"], ["--seeds=0"],
                ["--figure=a.png"], ["--", "--seed=1"]):
        with pytest.raises(UserError):
            ablate_py.parse_args(bad)
    with pytest.raises(ShowHelp) as usage:  # run_main prints it and exits 0
        ablate_py.parse_args(["--help"])
    for key, default in ablate_py.DEFAULTS.items():  # every key, its default and its help
        assert f"--{key}={default!r}" in str(usage.value), key
        assert ablate_py.HELP[key] and ablate_py.HELP[key] in str(usage.value), key


@pytest.mark.parametrize("flag, expected", [
    ("--lr_seeds=0", "--lr_seeds must be a finite number >= 1, got 0"),
    ("--threads=-1", "--threads must be a finite number >= 0, got -1"),
    ("--protocol=slow", "--protocol=slow is not a choice; choices: shared, lr_sweep, best_lr, "
                        "long"),
])
def test_the_key_table_refuses_a_value_outside_its_range_or_choices(flag, expected):
    with pytest.raises(UserError, match=f"^{expected}$"):
        ablate_py.parse_args([flag])


def test_a_failed_train_py_run_is_one_line_naming_its_log(sweep, tmp_path):
    """A train.py job that exits with an error stops the sweep with ablate's own TrainFailed (a
    UserError): its last line and its train.out, no traceback of ablate.py's."""
    out = tmp_path / "out"
    msg = refused(sweep[1][0], f"--out={out}", "--runs=vanilla", "--seeds=1", "--jobs=1", "--",
                  f"--data_root={tmp_path / 'no_data'}")
    log = out / "vanilla" / "seed0" / "train.out"
    assert "vanilla seed 0 failed (exit 2: error: " in msg and f"see {log}" in msg, msg
    assert log.read_text().strip().splitlines()[-1] in msg


@pytest.mark.parametrize("child, code", [
    ("raise KeyError('depth_mode')", 1),  # a bug in train.py: it used to be a one-line exit 2
    ("os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),  # the out-of-memory killer's
], ids=["traceback", "signal"])
def test_a_train_py_traceback_or_signal_is_no_user_error(child, code, tmp_path, monkeypatch):
    """Only train.py's exit 2 is a user error (one line); a child's traceback or a signal ends
    ablate.py with a traceback (exit 1, not 2) carrying the child's tail and its log. A fake
    train.py, so nothing trains."""
    (tmp_path / "train.py").write_text(f"import os, signal\nprint('step 0')\n{child}\n")
    monkeypatch.setattr(ablate_py, "ROOT", tmp_path)
    job, where = ("vanilla", 0, None, 1), tmp_path / "out" / "vanilla" / "seed0"
    where.mkdir(parents=True)
    with pytest.raises(ablate_py.TrainCrashed) as crash:
        run_main(lambda argv: ablate_py.train_one(job, "new", [], tmp_path / "out", 1), [])
    assert not isinstance(crash.value, UserError)
    msg = str(crash.value)
    assert f"vanilla seed 0 crashed ({'exit 1' if code == 1 else 'killed by signal 9'})" in msg
    assert f"see {where / 'train.out'}" in msg, msg
    if code == 1:  # the traceback whole, not the output before it
        assert "Traceback (most recent call last):" in msg and "KeyError: 'depth_mode'" in msg
        assert "step 0" not in msg
    (tmp_path / "train.py").write_text("print('error: --foo is wrong')\nraise SystemExit(2)\n")
    assert "vanilla seed 0 failed (exit 2: error: --foo is wrong)" in refused(
        main=lambda argv: ablate_py.train_one(job, "new", [], tmp_path / "out", 1))


def test_train_py_arguments_are_read_as_train_py_reads_them():
    """After --: --key value as train.py takes it (it used to be refused), an unknown key or a
    one-dash option refused before anything runs, naming the nearest key; a run name too."""
    assert ablate_py.parse_args(["--", "--max_iters", "3"])[1] == ["--max_iters", "3"]
    for argv, message in ((["--", "--max_iter=3"], "did you mean --max_iters?"),
                          (["--", "-max_iters=3"], "did you mean --max_iters=3?"),
                          (["--", "--seed", "4"], "--seed after -- is ablate.py's to set"),
                          (["--runs=Value"], "--runs=Value is not a choice; did you mean value?")):
        with pytest.raises(UserError) as e:
            ablate_py.parse_args(argv)
        assert message in str(e.value), e.value


@pytest.fixture(scope="module")
def protocols(data_root, tmp_path_factory):
    """The per-method learning-rate protocols on the tiny config: sweep, best rate, longer runs."""
    out = tmp_path_factory.mktemp("protocols") / "out"
    base = out.parent / "base.py"
    base.write_text(f'dataset = "tiny"\ndata_root = "{data_root}"\nn_layer = 4\nn_head = 2\n'
                    f'n_kv_head = 1\nhead_dim = 8\nn_embd = 16\nmlp_hidden = 32\nblock_size = 32\n'
                    f'batch_tokens = 128\n'
                    f'max_iters = 4\neval_interval = 2\neval_seqs = 4\nlearning_rate = 1e-2\n')
    common = [f"--base={base}", f"--out={out}", "--runs=vanilla,value", "--lrs=1e-3,1e-2",
              "--jobs=2"]
    ablate(*common, "--protocol=lr_sweep")
    best_lr = ablate(*common, "--protocol=best_lr", "--seeds=2")
    ablate(*common, "--protocol=long", "--long_runs=vanilla,value", "--long_factor=2", "--seeds=2")
    return out, best_lr


def final(out, run, lr, seed, sub="lr"):
    log = records(out / run / f"{sub}{lr:g}" / f"seed{seed}")
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
    for key, rates in (("tables_shared", {"vanilla": 1e-2, "value": 1e-2}), ("tables_best",
                                                                             res["best"])):
        row = next(r for r in res[key][0]["rows"] if r["run"] == "value")
        d = [final(out, "value", rates["value"], s)[-1]["val_loss"] - final(out, "vanilla",
                                                                            rates["vanilla"],
                                                                            s)[-1] ["val_loss"]
             for s in (0, 1)]
        assert row["n"] == 2 and row["diff"] == pytest.approx(np.mean(d)), key
    assert "each at its best peak rate" in (out / "results_best_lr.md").read_text()


def test_long_runs_give_the_gap_against_tokens(protocols):
    out, _ = protocols
    res = json.loads((out / "results_long.json").read_text())
    best = res["best"]
    curve = res["gaps"]["value"]
    runs = {r: [final(out, r, best[r], s, sub="long2x_lr") for s in (0, 1)] for r in ("vanilla",
                                                                                      "value")}
    # steps 0, 2, ..., 8 in tokens
    assert [p[0] for p in curve] == [r["step"] * 128 for r in runs["value"][0]]
    assert runs["value"][0][-1]["step"] == 8  # twice the base's 4 steps
    d = [runs["value"][s][-1]["val_loss"] - runs["vanilla"][s][-1]["val_loss"] for s in (0, 1)]
    assert curve[-1][1] == pytest.approx(np.mean(d)) and curve[-1][3] == 2
    # beside them, the finished short runs at the same best rates (best_lr's), ending at the
    # base's 4 steps
    short = res["gaps_short"]["value"][-1]
    d = [final(out, "value", best["value"], s)[-1]["val_loss"] - final(out, "vanilla",
                                                                       best["vanilla"],
                                                                       s)[-1] ["val_loss"]
         for s in (0, 1)]
    assert short[0] == 4 * 128 and short[1] == pytest.approx(np.mean(d)) and short[3] == 2
    assert f"| value | short | 0.00 | {short[1]:+.4f} |" in (out / "results_long.md").read_text()
    img = matplotlib.image.imread(out / "gap_vs_tokens.png")
    assert img.ndim == 3 and np.ptp(img) > 0


def test_gap_table_shows_the_short_runs_only_at_their_end():
    """An unfinished short pair's last evaluation is mid-schedule: it must not be labelled as the
    short runs' end."""
    long = {"value": [(0, 0.0, None, 2), (256, -0.02, 0.01, 2), (512, -0.01, 0.005, 2)]}
    unfinished = {"value": [(0, 0.0, None, 2), (256, -0.05, 0.02, 2)]}
    finished = {"value": unfinished["value"] + [(512, -0.04, 0.01, 2)]}
    assert "| short |" not in gap_markdown(long, unfinished, "vanilla", 512)
    md = gap_markdown(long, finished, "vanilla", 512)
    assert md.count("| short |") == 1 and "| value | short | 0.00 | -0.0400 | 0.0100 | 2 |" in md


def test_best_lr_without_a_sweep_fails_clearly(tmp_path):
    assert "run `python ablate.py --protocol=lr_sweep`" in refused(f"--out={tmp_path}",
                                                                   "--runs=vanilla",
                                                                   "--protocol=best_lr")


def test_main_comparison_table(tmp_path):
    """Table 1 at CPU scale: the six runs paired by seed, with perplexity = exp(val loss) and the
    paper's 3B figures."""
    RUN_SETS = ablate_py.RUN_SETS
    assert RUN_SETS["main"] == ["vanilla", "value", "lime", "denseformer", "attnres", "mhc"]
    assert (set(RUN_SETS["main"]) | set(RUN_SETS["ablations"]) | set(RUN_SETS["keyless_study"])
            == set(RUN_SETS["all"]))
    assert not {"keyless", "keyless_value"} & set(RUN_SETS["ablations"])  # not the paper's
    losses = {"vanilla": [2.0, 2.2], "value": [1.9, 2.0], "lime": [1.92, 2.05],
              "denseformer": [1.95, 2.1],
              "attnres": [2.0, 2.1],
              "mhc": [2.05, 2.15]}
    for run, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            d = tmp_path / run / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps({"max_iters": 10}))
            record = {"kind": "eval", "step": 10, "val_loss": loss}
            (d / "log.jsonl").write_text(json.dumps(record) + "\n")
    _, tables = summarize(collect(tmp_path, MAIN, 2))
    main = tables[0]
    assert main["main"] and [r["run"] for r in main["rows"]] == MAIN
    value = main["rows"][1]
    assert value["diff"] == pytest.approx(-0.15)
    assert value["ppl"] == pytest.approx((np.exp(1.9) + np.exp(2.0)) / 2)
    md = markdown(tables)
    assert ("| value | 2 | 1.9500 ± 0.0707 | -0.1500 ± 0.0707 | -3.0 | 7.037 ± 0.497 | 7.25 | 55.69 |"
            in md)
    assert "| mhc | 2 |" in md and "| n/a | 54.68 |" in md


# ------------------------------------------------------------------------ the runs already in --out

def edit_config(run, **changes):
    """Rewrite a run's config.json as train.py would have written it for another command."""
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, **changes}, indent=1) + "\n")


@pytest.mark.parametrize("case", ["override", "learning_rate", "dropped_override", "base_edited",
                                  "mixed_resume"])
def test_a_rerun_with_other_settings_is_refused_before_training(sweep, tmp_path, case):
    """A finished run is reused only when train.py recorded the config asked for (it used to say
    "done already" and report the old run's numbers as the new ones)."""
    src, args, _, _ = sweep
    out = tmp_path / "out"
    shutil.copytree(src, out)
    args = [a for a in args if not a.startswith("--out=")] + [f"--out={out}"]
    extra, expected = {"override": (["--", "--max_iters=4"], "max_iters 3 -> 4"),
                       "learning_rate": (["--", "--learning_rate=0.01"],
                                         "learning_rate 0.003 -> 0.01"),
                       "dropped_override": ([], "weight_decay 0.0 -> 0.1"),
                       "base_edited": ([], "eval_seqs 4 -> 8"),
                       "mixed_resume": ([], "resumed at step 2 with learning_rate 0.01 -> 0.003")}[case]
    if case == "dropped_override":  # the runs had `-- --weight_decay=0.0`, this command drops it
        edit_config(out / "vanilla" / "seed0", weight_decay=0.0)
    if case == "base_edited":
        base = tmp_path / "base.py"
        base.write_text(Path(args[0].partition("=")[2]).read_text() + "eval_seqs = 8\n")
        args[0] = f"--base={base}"
    if case == "mixed_resume":  # half trained at another rate, then resumed at the asked one
        resumed = {"step": 2, "changed": {"learning_rate": [0.01, 0.003]}}
        edit_config(out / "value" / "seed0", resumes=[resumed])
    before = files(out)
    msg = refused(*args, *extra)
    assert expected in msg and "--overwrite=True" in msg and "new --out" in msg, msg
    assert files(out) == before


def test_a_started_run_with_other_settings_is_not_resumed(sweep, tmp_path):
    """train.py resumes a checkpoint under changed settings with a warning; the sweep must not."""
    out = tmp_path / "out"
    shutil.copytree(started(sweep[0]), out)
    before = files(out)
    msg = refused(*sweep[1][:1], f"--out={out}", "--runs=vanilla,value", "--seeds=1", "--",
                  "--learning_rate=0.01")
    assert "vanilla seed 0 (checkpoint at step 2; learning_rate 0.003 -> 0.01)" in msg, msg
    assert files(out) == before


@pytest.mark.parametrize("case", ["torn_log", "empty_config", "started_ckpt", "finished_ckpt"])
def test_an_unreadable_run_is_named_before_training(sweep, tmp_path, case):
    """A run's log, config or checkpoint cut short: one line naming the file and the fix, never a
    traceback, a failed train.py after the other runs, or a figure that breaks the report."""
    interrupted = case == "started_ckpt"
    out = tmp_path / "out"
    shutil.copytree(started(sweep[0]) if interrupted else sweep[0], out)
    broken = out / ("value" if "ckpt" in case else "vanilla") / "seed0" / {
        "torn_log": "log.jsonl", "empty_config": "config.json"}.get(case, "ckpt.pt")
    broken.write_bytes(broken.read_bytes()[:-20] if case == "torn_log" else b"")
    before = files(out)
    msg = refused(*sweep[1][:1], f"--out={out}", "--runs=vanilla,value", "--seeds=1")
    assert str(broken) in msg and "--overwrite=True" in msg, msg
    assert files(out) == before


def test_overwrite_replaces_a_stale_run_wholly_from_any_folder(sweep, tmp_path, monkeypatch):
    """--overwrite=True deletes the stale run's files and trains it from scratch (a file train.py
    did not write stays); the same command again reuses it and reports the same numbers. Relative
    --base and --out mean the folder ablate.py runs in (train.py runs in the repository)."""
    src, args, _, _ = sweep
    shutil.copytree(src, tmp_path / "out")
    shutil.copy(args[0].partition("=")[2], tmp_path / "base.py")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "vanilla" / "seed0" / "notes.txt").write_text("the user's")
    value = files(tmp_path / "out" / "value")
    cmd = ["--base=base.py", "--out=out", "--runs=vanilla", "--seeds=1", "--jobs=1",
           "--overwrite=True", "--",
           "--max_iters=4"]
    ablate(*cmd)
    run = tmp_path / "out" / "vanilla" / "seed0"
    assert sorted(p.name for p in run.iterdir()) == [MANIFEST, "ckpt.pt", "config.json",
                                                     "log.jsonl", "notes.txt", "train.lock",
                                                     "train.out"]
    assert (run / "notes.txt").read_text() == "the user's"
    log = records(run)
    assert [r["step"] for r in log if r["kind"] == "train"] == [1, 2, 3, 4]
    results = (tmp_path / "out" / "results.json").read_text()
    assert json.loads(results)["runs"]["vanilla"]["losses"] == [log[-1]["val_loss"]]
    assert "vanilla seed 0: done already" in ablate(*cmd)
    assert (tmp_path / "out" / "results.json").read_text() == results
    assert files(tmp_path / "out" / "value") == value  # a run outside --runs is left alone


@pytest.mark.parametrize("case", ["out_is_a_file", "results_md", "curves_png", "run_folder"])
def test_output_paths_are_checked_before_training(sweep, tmp_path, case):
    out = tmp_path / "out"
    shutil.copytree(sweep[0], out)
    if case == "out_is_a_file":
        out = tmp_path / "a_file"
        out.write_text("mine")
    elif case == "run_folder":  # value must train again, but a file sits where its folder goes
        shutil.rmtree(out / "value")
        (out / "value").write_text("mine")
    else:
        name = {"results_md": "results.md", "curves_png": "curves.png"}[case]
        (out / name).unlink()
        (out / name).mkdir()
    before = files(tmp_path)
    msg = refused(*sweep[1][:1], f"--out={out}", "--runs=vanilla,value", "--seeds=1")
    assert {"out_is_a_file": "is a file", "results_md": "results.md is a folder",
            "curves_png": "curves.png is a folder",
            "run_folder": "part of its folder path is a file"}[case] in msg, msg
    assert files(tmp_path) == before


@pytest.mark.parametrize("flags, expected", [
    # used to fail in every train.py run, one by one
    (["--", "--max_iter=20"], "unknown config key 'max_iter'"),
    # used to be silently replaced by --seeds
    (["--", "--seed=5"], "--seed after -- is ablate.py's to set"),
    (["--", "--out_dir=elsewhere"], "--out_dir after -- is ablate.py's to set"),
    (["--", "--max_iters=None"], "--max_iters=None"),
    # used to fail in every train.py run; train.py's key table checks them up front
    (["--", "--beta1=2"], "the vanilla run: --beta1 must be a finite number in [0, 1), got 2"),
    (["--threads=100000"], "cores"),
    (["--seeds=None"], "--seeds=None"),  # was a TypeError
    (["--protocol=long", "--long_runs=value"], "--long_runs"),
    (["--protocol=long", "--long_factor=1"], "a factor of 2 or more"),
], ids=["unknown_key", "seed", "out_dir", "max_iters_none", "train_range", "threads", "seeds_none",
        "one_long_run", "long_factor"])
def test_bad_flags_are_one_line_before_training(sweep, tmp_path, flags, expected):
    out = tmp_path / "out"
    shutil.copytree(sweep[0], out)
    before = files(out)
    msg = refused(*sweep[1][:1], f"--out={out}", "--runs=vanilla,value", "--seeds=1", *flags)
    assert expected in msg, msg
    assert files(out) == before


def test_an_empty_out_is_refused(sweep, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it used to mean the current folder
    assert "--out is empty" in refused(*sweep[1][:1], "--out=", "--runs=vanilla", "--seeds=1")
    assert not any(tmp_path.iterdir())


def test_ctrl_c_starts_no_further_run(sweep, tmp_path, monkeypatch):
    """Ctrl-C mid-sweep: one line, and the queued runs never start (they used to run on after the
    interrupt)."""
    started, finish = [], threading.Event()

    def train_one(job, *_):
        started.append(job)
        if len(started) == 1:
            # Ctrl-C reaches the main thread while this run goes on, till the sweep has stopped
            os.kill(os.getpid(), signal.SIGINT)
            finish.wait(300)  # a hang's bound (a sweep that waited for its runs)
        return "trained"
    monkeypatch.setattr(ablate_py, "train_one", train_one)
    threads = set(threading.enumerate())
    # Python's Ctrl-C, whatever ran before
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = run_main(ablate_py.main, [*sweep[1][:1], f"--out={tmp_path / 'out'}",
                                             "--runs=vanilla,value", "--seeds=2", "--jobs=1"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a traceback")
    finally:
        signal.signal(signal.SIGINT, previous)
    msg = err.getvalue().strip()
    finish.set()
    # the sweep's threads: a queued run, if one were left, starts before they end
    for worker in set(threading.enumerate()) - threads:
        if worker.name.startswith("ThreadPoolExecutor"):
            worker.join(300)
    # Ctrl-C's status, 130, and its one line (it is no user error, 2)
    assert code == 130 and msg.startswith("interrupted; ") and "\n" not in msg, (code, msg)
    assert "rerun the same command to continue" in msg and len(started) == 1, (msg, started)


def test_best_lr_takes_no_rate_from_runs_trained_otherwise(protocols, tmp_path):
    """best_lr and long read the learning-rate sweep's runs: stale ones stop them, pointing at the
    sweep."""
    out = tmp_path / "out"
    shutil.copytree(protocols[0], out)
    before = files(out)
    msg = refused(f"--base={protocols[0].parent / 'base.py'}", f"--out={out}",
                  "--runs=vanilla,value", "--lrs=1e-3,1e-2", "--protocol=best_lr", "--seeds=2",
                  "--", "--max_iters=5")
    assert "max_iters 4 -> 5" in msg and "rerun the protocols that train them" in msg, msg
    assert files(out) == before


def test_a_source_rule_is_ablated_by_its_delta_file_alone(tmp_path):
    """docs/forking.md: configs/ablations/source_<name>.py is a run of that name, with no edit of
    ablate.py (a copy of it beside the new file sees it)."""
    import importlib.util
    (tmp_path / "configs" / "ablations").mkdir(parents=True)
    shutil.copy(ablate_py.ROOT / "ablate.py", tmp_path / "ablate.py")
    (tmp_path / "configs" / "ablations" / "source_back.py").write_text(
        'depth_stride = 2\nout_dir = "out/ablations/source_back"\n')
    spec = importlib.util.spec_from_file_location("ablate_copy", tmp_path / "ablate.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.RUNS["source_back"] == ["source_back"] and "source_back" not in ablate_py.RUNS
    assert copy.parse_args(["--runs=value,source_back"])[3] == ["value", "source_back"]
    files = copy.run_files("configs/ablations/cpu.py", "source_back")
    assert sweep_records.train_config(files[1:])["depth_stride"] == 2
