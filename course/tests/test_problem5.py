"""Problem 5: the experiment. The handout's command trained vanilla, uniform and value on
Shakespeare with paired seeds; these tests read what it wrote (they train nothing): every run
finished with the handout's settings, results.json says what the logs say, the losses are those of a
correct model, and the figure of the depth weights is there."""
import json
import os
from pathlib import Path

import pytest

from course.problems import EXPERIMENT, EXPERIMENT_COMMAND
from support.sweep import differences, final_val_loss, read_config, run_dir, train_config

pytestmark = pytest.mark.problem5
ROOT = Path(os.environ.get("COURSE_ROOT") or Path(__file__).resolve().parents[2])  # the copy graded
HINT = f"run `{EXPERIMENT_COMMAND}` from the repository's folder (it resumes what it has)"


@pytest.fixture(scope="module")
def out():
    """Where the runs are: the handout's folder, or grade.py --experiment=DIR."""
    return Path(os.environ.get("COURSE_EXPERIMENT") or ROOT / EXPERIMENT["out"])


@pytest.fixture(scope="module")
def results(out):
    path = out / "results.json"
    if not path.is_file():
        pytest.fail(f"no {path}: {HINT}")
    return json.loads(path.read_text())


def jobs():
    return [(run, seed) for run in EXPERIMENT["runs"] for seed in range(EXPERIMENT["seeds"])]


def test_every_run_finished_with_the_handouts_settings(out, results):
    for run, seed in jobs():
        where = run_dir(out, run, seed)
        assert final_val_loss(where) is not None, f"{where} has not finished: {HINT}"
        asked = train_config([str(ROOT / EXPERIMENT["base"]),
                              str(ROOT / "configs" / "ablations" / f"mode_{run}.py"),
                              f"--seed={seed}"])
        recorded = read_config(where)
        changed = differences(recorded, recorded.get("resumes", []), asked)
        assert not changed, f"{where} was trained with other settings ({changed}): {HINT}"
    assert results["config"]["protocol"] == "shared" and not results["train_overrides"], \
        f"results.json comes from another command: {HINT}"


def test_results_json_says_what_the_logs_say(out, results):
    losses = {run: [final_val_loss(run_dir(out, run, s)) for s in range(EXPERIMENT["seeds"])]
              for run in EXPERIMENT["runs"]}
    for run, values in losses.items():
        assert results["runs"][run]["losses"][:len(values)] == values, \
            f"results.json's {run} is not its logs'"
    rows = {row["run"]: row for table in results["tables"] if table["baseline"] == "vanilla"
            for row in table["rows"]}
    for run in EXPERIMENT["runs"][1:]:  # the paired difference, seed by seed, against vanilla
        paired = sum(a - b for a, b in zip(losses[run], losses["vanilla"])) / len(losses[run])
        assert abs(rows[run]["diff"] - paired) < 1e-12, \
            f"the paired difference of {run} is not its logs'"


def test_the_losses_are_those_of_a_correct_model(out, results):
    off = [f"{run}: mean final validation loss {results['runs'][run]['mean']:.4f}, the reference's "
           f"{want:.4f}" for run, want in EXPERIMENT["reference"].items()
           if abs(results["runs"][run]["mean"] - want) > EXPERIMENT["tolerance"]]
    assert not off, (f"{'; '.join(off)} (+-{EXPERIMENT['tolerance']}): were problems 1-4 correct "
                     f"when it trained? Retrain with --overwrite=True added to the command")


def test_the_figure_of_the_depth_weights(out, results):
    png = out / "depth_weights.png"
    assert png.is_file(), (f"no {png}: it needs matplotlib (pip install matplotlib); then rerun "
                           f"the command, which reuses the runs and draws the figures")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, \
        f"{png} is not a figure"
