"""
Problem 5, judged by the trusted parent from the runs the handout's command wrote, as data (it
trains nothing and runs no code of the copy): every run finished with the handout's settings,
results.json says what the logs say, each final checkpoint re-evaluated here (this grader's
model.py, the embedded Shakespeare prepared afresh) gives its logged loss and no lower a loss than
on training text drawn afresh, the losses are a correct model's, and the figure is there. A run
folder written without training, or with losses edited into its log, fails.
"""
import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

import prepare_data
import train
from checkpoint import build_model, read_checkpoint
from configurator import UserError
from course.problems import EXPERIMENT, EXPERIMENT_COMMAND, PROBLEMS
from data import load_meta, read_tokens
from lab import ablate
from lab.ablate import differences, final_val_loss, read_config, run_dir

HINT = f"run `{EXPERIMENT_COMMAND}` from the repository's folder (it resumes what it has)"
EVAL_TOLERANCE = 1e-4  # float32 sums in another batching: 1e-6 apart; a model other than the
                       # logged one: far more
TRAIN_WINDOWS = 256   # training windows a checkpoint is scored on: the mean to about 0.008
SEEN_MARGIN = 0.02    # what loss on them above the validation loss a run of the handout may have


class Fail(Exception):
    pass


def need(ok, why):
    if not ok:
        raise Fail(why)


def jobs():
    return [(run, seed) for run in EXPERIMENT["runs"] for seed in range(EXPERIMENT["seeds"])]


def asked(run, seed) -> dict:
    """The config train.py resolves for a job of the handout's command, as lab/ablate.py runs it."""
    base = str(ablate.ROOT / EXPERIMENT["base"])
    return train.parse_args(ablate.train_args((run, seed, None, 1), base, [], EXPERIMENT["out"]))


def results_of(out: Path) -> dict:
    path = out / "results.json"
    need(path.is_file(), f"no {path}: {HINT}")
    try:
        results = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise Fail(f"{path} is not JSON: {HINT}") from None
    need(isinstance(results, dict), f"{path} is not lab/ablate.py's results: {HINT}")
    return results


def finished(out, results):
    for run, seed in jobs():
        where = run_dir(out, run, seed)
        need(final_val_loss(where) is not None, f"{where} has not finished: {HINT}")
        changed = differences(read_config(where), asked(run, seed))
        need(not changed, f"{where} was trained with other settings ({changed}): {HINT}")
    need(results["config"]["protocol"] == "shared" and not results["train_overrides"],
         f"results.json comes from another command: {HINT}")


def losses_of(out):
    return {run: [final_val_loss(run_dir(out, run, s)) for s in range(EXPERIMENT["seeds"])]
            for run in EXPERIMENT["runs"]}


def logged(out, results):
    losses = losses_of(out)
    for run, values in losses.items():
        need(results["runs"][run]["losses"][:len(values)] == values,
             f"results.json's {run} is not its logs'")
    rows = {row["run"]: row for table in results["tables"] if table["baseline"] == "vanilla"
            for row in table["rows"]}
    for run in EXPERIMENT["runs"][1:]:  # the paired difference, seed by seed, against vanilla
        paired = sum(a - b for a, b in zip(losses[run], losses["vanilla"])) / len(losses[run])
        need(abs(rows[run]["diff"] - paired) < 1e-12,
             f"the paired difference of {run} is not its logs'")


def texts(cfg) -> tuple:
    """The run's dataset, (train, val) tokens, prepared afresh here (the embedded Shakespeare takes
    a second), never read from the copy."""
    need(cfg["dataset"] == "shakespeare", f"the runs trained on {cfg['dataset']}: {HINT}")
    with tempfile.TemporaryDirectory(prefix="grade-data") as tmp, \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # in this process: one tokenizer process (num_proc=1) forks nothing
        folder = prepare_data.prepare(prepare_data.shakespeare, "shakespeare", "shakespeare",
                                      "bytes", tmp, num_proc=1)
        meta = load_meta(folder)
        return tuple(np.array(read_tokens(folder, split, meta)) for split in ("train", "val"))


def val_loss(gpt, val, cfg) -> float:
    """The mean loss over the validation windows train.py evaluates (evenly spaced over val.bin)."""
    offsets = np.linspace(0, len(val) - cfg["block_size"] - 1, cfg["eval_seqs"])
    return mean_loss(gpt, val, offsets.round().astype(np.int64), cfg["block_size"])


def mean_loss(gpt, tokens, offsets, T) -> float:
    """The mean next-token loss of gpt over the windows at offsets, as train.py batches them."""
    gpt.eval()
    with torch.no_grad():
        losses = [gpt(*train.get_batch(tokens, offsets[i:i + 32], T, "cpu",
                                       gpt.config.vocab_size))[1].item() * len(offsets[i:i + 32])
                  for i in range(0, len(offsets), 32)]
    return sum(losses) / len(offsets)


def not_trained_on_validation(gpt, tokens, val_said, cfg, where):
    """A run of the handout's command scores 0.01-0.06 lower on text it trained on than on the
    validation windows (six trained checkpoints of its base config, three draws each); one trained
    on the validation windows scores lower on them. The training windows are drawn here, afresh:
    the copy cannot know them."""
    T = cfg["block_size"]
    offsets = np.random.default_rng().integers(0, len(tokens) - T - 1, TRAIN_WINDOWS)
    seen = mean_loss(gpt, tokens, offsets, T)
    need(seen - val_said <= SEEN_MARGIN,
         f"{where}: its checkpoint scores {val_said:.4f} on the validation windows but {seen:.4f} "
         f"on training text drawn at random: it learnt the validation windows, not the training "
         f"split; {HINT}")


def reevaluated(out, results):
    """Each run's final checkpoint, scored on the validation windows train.py evaluates (evenly
    spaced over val.bin), gives the loss its log ends with, and was not trained on them."""
    data, checkpoints = None, {job: checkpoint(out, *job) for job in jobs()}  # before any
    for (run, seed), (ckpt, cfg) in checkpoints.items():  # evaluation: a forgery fails at once
        where = run_dir(out, run, seed)
        tokens, val = data = texts(cfg) if data is None else data
        try:
            gpt = build_model(ckpt["model_config"])
            gpt.load_state_dict(ckpt["model"])
        except Exception as e:
            raise Fail(f"{where / 'ckpt.pt'} does not hold the model its config says "
                       f"({type(e).__name__}): {HINT}") from None
        loss, said = val_loss(gpt, val, cfg), final_val_loss(where)
        need(math.isfinite(loss) and abs(loss - said) < EVAL_TOLERANCE,
             f"{where}: its checkpoint scores {loss:.4f} on the validation windows, its log says "
             f"{said:.4f}: the log is not the checkpoint's; {HINT}")
        not_trained_on_validation(gpt, tokens, said, cfg, where)


def checkpoint(out, run, seed):
    """A run's final checkpoint and config, once it holds the run's model (mode, depth, stride,
    sizes) and weights no other seed of the run has: a checkpoint relabelled, or one training
    copied to both seeds, fails."""
    where, cfg = run_dir(out, run, seed), asked(run, seed)
    need((where / "ckpt.pt").is_file(), f"no {where / 'ckpt.pt'}: the run's final checkpoint is "
                                        f"graded; {HINT}")
    ckpt = read_checkpoint(where / "ckpt.pt")
    need(isinstance(ckpt.get("config"), dict) and ckpt.get("step") == cfg["max_iters"]
         and not differences(ckpt["config"], cfg),
         f"{where / 'ckpt.pt'} is not the checkpoint of the finished run: {HINT}")
    wrong = [f"{k} {v!r} (the run's: {cfg[k]!r})" for k, v in ckpt["model_config"].items()
             if cfg.get(k) is not None and v != cfg[k]]
    need(not wrong, f"{where / 'ckpt.pt'} holds another model than its run's: "
                    f"{', '.join(wrong[:3])}; {HINT}")
    for other in range(seed):  # two seeds are two trainings
        state = read_checkpoint(run_dir(out, run, other) / "ckpt.pt")["model"]
        need(any(k not in state or not torch.equal(state[k], v) for k, v in ckpt["model"].items()),
             f"{where / 'ckpt.pt'} holds the same weights as {run} seed {other}: each seed is a "
             f"run of its own; {HINT}")
    return ckpt, cfg


def correct(out, results):
    """Each mean within the tolerance of the reference's, and value below vanilla by at least half
    the reference's gap, seed by seed (EXPERIMENT in course/problems.py says why so)."""
    off = [f"{run}: mean final validation loss {results['runs'][run]['mean']:.4f}, the "
           f"reference's {want:.4f}" for run, want in EXPERIMENT["reference"].items()
           if abs(results["runs"][run]["mean"] - want) > EXPERIMENT["tolerance"]]
    need(not off, f"{'; '.join(off)} (+-{EXPERIMENT['tolerance']}): were problems 1-4 correct when "
                  f"it trained? Retrain: delete {EXPERIMENT['out']} and rerun the command")
    losses = losses_of(out)
    gain = sum(a - b for a, b in zip(losses["value"], losses["vanilla"])) / EXPERIMENT["seeds"]
    need(gain < -EXPERIMENT["gain"] / 2,
         f"value is {gain:+.4f} against vanilla in the paired mean, the reference's "
         f"{-EXPERIMENT['gain']:+.4f}: value trained like vanilla; were problems 1-4 correct?")


def figure(out, results):
    png = out / "depth_weights.png"
    need(png.is_file(), f"no {png}: it needs matplotlib (pip install matplotlib); then rerun the "
                        f"command, which reuses the runs and draws the figures")
    need(png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000,
         f"{png} is not a figure")


CHECKS = {"every_run_finished_with_the_handouts_settings": finished,
          "results_json_says_what_the_logs_say": logged,
          "each_checkpoint_gives_its_logged_loss": reevaluated,
          "the_losses_are_those_of_a_correct_model": correct,
          "the_figure_of_the_depth_weights": figure}


def grade(out: Path) -> dict:
    """{test: None or why it failed} for the runs in out. The logs, results.json and the figure
    count only once the checkpoints give the logged losses: records written without the training
    earn nothing."""
    problem = next(p for p in PROBLEMS if p.number == 5)
    first = "each_checkpoint_gives_its_logged_loss"
    verdicts = {first: verdict(first, out)}
    for name, _ in problem.tests:
        if name != first:  # its own reason first (no results.json), else the checkpoints'
            verdicts[name] = verdict(name, out) or (verdicts[first] and (
                f"not graded: the checkpoints do not give the logged losses ({first})"))
    return verdicts


def verdict(name, out):
    try:
        CHECKS[name](out, results_of(out))
        return None
    except Fail as e:
        return str(e)
    except (KeyError, TypeError, ValueError, IndexError, OSError) as e:
        return (f"the runs' records are not what the handout's command writes "
                f"({type(e).__name__}: {e}): {HINT}")
    except UserError as e:  # the core's: an unreadable log or checkpoint, in one line
        return str(e)
