"""
Problem 5, judged by the trusted parent from the runs' files as data (no code of the copy runs):
each checkpoint re-evaluated here on Shakespeare prepared afresh must give its logged loss, not
have learnt the validation windows, differ from its other seed's as two trainings do, and score
best in its own mode; the means and gain are these losses, the figure drawn from a checkpoint.
"""
import contextlib
import io
import json
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch

import prepare_data
import train
from checkpoint import build_model
from course import sandbox
from course.problems import EXPERIMENT, EXPERIMENT_COMMAND
from data import load_meta, read_tokens
from lab import ablate

HINT = f"run `{EXPERIMENT_COMMAND}` from the repository's folder (it resumes what it has)"
LIMITS = {"results.json": 1 << 20, "config.json": 1 << 16, "log.jsonl": 16 << 20,
          "ckpt.pt": 64 << 20}  # bytes: 20 times what the handout's command writes
EVAL_TOLERANCE = 1e-4  # float32 sums in another batching: 1e-6 apart; another model: far more
TRAIN_WINDOWS = 256   # training windows a checkpoint is scored on: the mean to about 0.008
SEEN_MARGIN = 0.02    # what loss on them above the validation loss a run of the handout may have
MODE_WINDOWS = 16     # validation windows two seeds, and the runs' modes, are compared on
SEEDS_APART = 0.05    # KL nats a token: two trainings 0.15; a copy within the tolerance 0.02


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


class Runs:
    """The runs' folder (base/within), read once a file, as data."""

    def __init__(self, base: Path, within: str):
        self.base, self.within, self.read, self.scores = base, within, {}, None

    def bytes(self, *parts):
        path = str(Path(self.within, *parts))
        if path not in self.read:
            try:
                self.read[path] = sandbox.read_inside(self.base, path, LIMITS[parts[-1]])
            except FileNotFoundError:
                raise Fail(f"no {self.base / path}: {HINT}") from None
            except OSError as e:
                raise Fail(f"{self.base / path} is not read ({e.strerror}): the runs are the "
                           f"files the command wrote, no links, each at most "
                           f"{LIMITS[parts[-1]]} bytes; {HINT}") from None
        return self.read[path]

    def json(self, *parts):
        try:
            return json.loads(self.bytes(*parts))
        except (ValueError, UnicodeDecodeError):
            raise Fail(f"{self.base / self.within / Path(*parts)} is not JSON: {HINT}") from None

    def final(self, run, seed):
        """The run's last evaluation's loss if it evaluated at max_iters, else None."""
        lines = self.bytes(run, f"seed{seed}", "log.jsonl").decode(errors="replace").splitlines()
        evals = [r for r in map(record, lines) if r.get("kind") == "eval"]
        max_iters = self.json(run, f"seed{seed}", "config.json").get("max_iters")
        return evals[-1]["val_loss"] if evals and evals[-1].get("step") == max_iters else None

    def checkpoint(self, run, seed) -> dict:
        data, where = self.bytes(run, f"seed{seed}", "ckpt.pt"), self.where(run, seed)
        try:
            return sandbox.untrusted(data, LIMITS["ckpt.pt"])  # another shape fails where used
        except Exception as e:
            raise Fail(f"{where}/ckpt.pt is not a checkpoint ({type(e).__name__}): {HINT}") \
                from None

    def where(self, run, seed):
        return self.base / self.within / run / f"seed{seed}"


def record(line) -> dict:
    try:
        r = json.loads(line)
    except ValueError:
        return {}
    return r if isinstance(r, dict) else {}


def finished(runs, _):
    results = runs.json("results.json")
    need(results["config"]["protocol"] == "shared" and not results["train_overrides"],
         f"results.json comes from another command: {HINT}")
    for run, seed in jobs():
        where = runs.where(run, seed)
        need(runs.final(run, seed) is not None, f"{where} has not finished: {HINT}")
        changed = ablate.differences(runs.json(run, f"seed{seed}", "config.json"),
                                     asked(run, seed))
        need(not changed, f"{where} was trained with other settings ({changed}): {HINT}")


def logged(runs, _):
    """results.json's losses and means are the logs' (the grader's own measurements score)."""
    results = runs.json("results.json")
    for run in EXPERIMENT["runs"]:
        values, said = [runs.final(run, s) for s in range(EXPERIMENT["seeds"])], \
            results["runs"][run]
        need(said["losses"] == values and abs(said["mean"] - np.mean(values)) < 1e-12,
             f"results.json's {run} is not its logs'")


@cache
def texts() -> tuple:
    """The embedded Shakespeare's (train, val) tokens, prepared here (a second), not the copy's."""
    with tempfile.TemporaryDirectory(prefix="grade-data") as tmp, \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # in this process: one tokenizer process (num_proc=1) forks nothing
        folder = prepare_data.prepare(prepare_data.shakespeare, "shakespeare", "shakespeare",
                                      "bytes", tmp, num_proc=1)
        return tuple(np.array(read_tokens(folder, split, load_meta(folder)))
                     for split in ("train", "val"))


def windows(val, cfg, n):
    """The starts of n validation windows evenly spaced over val, as train.py evaluates them."""
    return np.linspace(0, len(val) - cfg["block_size"] - 1, n).round().astype(np.int64)


def mean_loss(gpt, tokens, offsets, T) -> float:
    """The mean next-token loss of gpt over the windows at offsets, as train.py batches them."""
    gpt.eval()
    with torch.no_grad():
        losses = [gpt(*train.get_batch(tokens, offsets[i:i + 32], T, "cpu",
                                       gpt.config.vocab_size))[1].item() * len(offsets[i:i + 32])
                  for i in range(0, len(offsets), 32)]
    return sum(losses) / len(offsets)


def model(cfg, state, **changes):
    """The GPT of a run's settings (changes: another mode) holding state, or Fail."""
    gpt = build_model({k: v for k, v in {**cfg, **changes}.items() if k not in train.KEYS})
    try:
        gpt.load_state_dict(state)
    except Exception as e:
        raise Fail(f"the checkpoint does not hold the model of its run's settings "
                   f"({type(e).__name__}): {HINT}") from None
    return gpt


def reevaluated(runs, _):
    """Each checkpoint scored here (runs.scores), and refused unless a training of its own run."""
    (tokens, val), predicted, runs.scores = texts(), {}, {}
    for run, seed in jobs():
        cfg, where, ckpt = {**asked(run, seed), "vocab_size": 257}, runs.where(run, seed), \
            runs.checkpoint(run, seed)
        gpt, T = model(cfg, ckpt["model"]), cfg["block_size"]
        runs.scores[run, seed] = loss = mean_loss(gpt, val, windows(val, cfg, cfg["eval_seqs"]), T)
        said = runs.final(run, seed)
        need(abs(loss - said) < EVAL_TOLERANCE,  # a NaN or inf fails too
             f"{where}: its checkpoint scores {loss:.4f} on the validation windows, its log says "
             f"{said}: the log is not the checkpoint's; {HINT}")
        x, y = train.get_batch(val, windows(val, cfg, MODE_WINDOWS), T, "cpu", 257)
        with torch.no_grad():
            p = predicted[run, seed] = gpt(x)[0].double().log_softmax(-1)
            for other in range(seed):  # KL(other || this) a token: two trainings' is 0.15
                kl = float((predicted[run, other].exp() * (predicted[run, other] - p)).sum(-1)
                           .mean())
                need(kl > SEEDS_APART, f"{where}: it predicts what seed {other}'s checkpoint "
                     f"does (KL {kl:.3f} nats a token, two trainings' 0.15): each seed is a "
                     f"training of its own; {HINT}")
            for mode in {asked(r, seed)["depth_mode"] for r in EXPERIMENT["runs"]} - {
                    cfg["depth_mode"]}:  # a model without blocks (a bigram) scores alike in all
                other = model(cfg, ckpt["model"], depth_mode=mode).eval()(x, y)[1].item()
                need(other > gpt(x, y)[1].item(),
                     f"{where}: its checkpoint scores as well as a {mode} model as it does as its "
                     f"run's {cfg['depth_mode']}: it was not trained as its run; {HINT}")
        not_trained_on_validation(gpt, tokens, loss, T, where)


def not_trained_on_validation(gpt, tokens, loss, T, where):
    """A run of the handout's command scores 0.01-0.06 lower on training text than on the validation
    windows (six checkpoints, three draws each); the windows drawn here, afresh, the copy cannot."""
    seen = mean_loss(gpt, tokens, np.random.default_rng().integers(0, len(tokens) - T - 1,
                                                                    TRAIN_WINDOWS), T)
    need(seen - loss <= SEEN_MARGIN,
         f"{where}: its checkpoint scores {loss:.4f} on the validation windows but {seen:.4f} on "
         f"training text drawn at random: it learnt the validation windows, not the training "
         f"split; {HINT}")


def correct(runs, _):
    """Each mean of the re-evaluated losses within the tolerance of the reference's, and value's
    paired gain over vanilla at least half the reference's (course/problems.py says why)."""
    losses = {run: [runs.scores[run, s] for s in range(EXPERIMENT["seeds"])]
              for run in EXPERIMENT["runs"]}
    off = [f"{run}: mean final validation loss {np.mean(losses[run]):.4f}, the reference's "
           f"{want:.4f}" for run, want in EXPERIMENT["reference"].items()
           if abs(np.mean(losses[run]) - want) > EXPERIMENT["tolerance"]]
    need(not off, f"{'; '.join(off)} (+-{EXPERIMENT['tolerance']}), as the grader scores the "
                  f"checkpoints: were problems 1-4 correct when it trained? Retrain: delete "
                  f"{EXPERIMENT['out']} and rerun the command")
    gain = np.mean([a - b for a, b in zip(losses["value"], losses["vanilla"])])
    need(gain < -EXPERIMENT["gain"] / 2,
         f"value is {gain:+.4f} against vanilla in the paired mean, the reference's "
         f"{-EXPERIMENT['gain']:+.4f}: value trained like vanilla; were problems 1-4 correct?")


def figure(runs, path):
    """Figure 3, drawn here from value seed 0's checkpoint (the student's PNG is not read): each
    layer's mean weight on each candidate over 16 validation windows, drawn at path if given."""
    cfg = {**asked("value", 0), "vocab_size": 257}
    gpt, val = model(cfg, runs.checkpoint("value", 0)["model"]), texts()[1]
    T, L = cfg["block_size"], gpt.config.n_eff_layer
    m = np.full((L, L), np.nan)
    with torch.no_grad(), train.capture_depth_weights(gpt.eval()) as alphas:
        gpt(torch.from_numpy(np.stack([val[s:s + T] for s in windows(val, cfg, 16)]).astype(int)))
    for e, (sources, alpha) in alphas.items():  # alpha: (B, n_kv_head, candidates, T)
        m[e, sources + [e]] = alpha.double().mean(dim=(0, 1, 3)).numpy()
    if path and (plt := ablate.pyplot()):
        ablate.plot_depth_weights(plt, m, path,
                                  "Depth weights, value, seed 0 (drawn by the grader)")


CHECKS = {"every_run_finished_with_the_handouts_settings": finished,
          "results_json_says_what_the_logs_say": logged,
          "each_checkpoint_gives_its_logged_loss": reevaluated,
          "the_losses_are_those_of_a_correct_model": correct,
          "the_figure_of_the_depth_weights": figure}


def grade(base: Path, within: str, path=None) -> dict:
    """{test: None or why it failed} for the runs in base/within, checked in order: the points are a
    correct training's or none, so every test says the first failure (path: the figure's)."""
    runs = Runs(base, within)
    for check in CHECKS.values():
        try:
            check(runs, path)
        except Fail as e:
            return dict.fromkeys(CHECKS, str(e))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OSError) as e:
            return dict.fromkeys(CHECKS, f"the runs' records are not what the handout's command "
                                         f"writes ({type(e).__name__}: {e}): {HINT}")
    return dict.fromkeys(CHECKS)
