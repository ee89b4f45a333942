"""
One run's depth weights (the paper's Figure 3), printed as a table and drawn as a heatmap, training
nothing:

    python ablate.py --depth_weights=out/ablate_cpu/value/seed0   # the command a user types
    show("out/ablate_cpu/value/seed0")                            # the same, from Python

The numbers are support/depth_weights.py's (train.py logs them and imports none of this viewer,
which reads a checkpoint and its validation data and draws). The command is ablate.py's
`--depth_weights` (the root holds the design card's files only: tests/test_layout.py); ablate's
report draws its sweep's Figure 3 with the same depth_weight_matrix and plot_depth_weights.
"""
from pathlib import Path

import numpy as np
import torch

from support.checkpoint import checkpoint_path, read_model, read_snapshot
from support.cli import require
from support.data import load_meta, read_tokens
from support.outputs import output_file, save_figure
from support.depth_weights import as_matrix, mean_depth_weights, table
from support.errors import CheckpointError, DataError
from support.tokenizer import is_hf_folder

ROOT = Path(__file__).resolve().parent.parent  # train.py runs there: a run's data_dir starts there
DEPTH_WINDOWS = 16  # the figures' validation windows (train.py's log: its eval_seqs windows)


def pyplot():
    """matplotlib's pyplot, drawing to files; without it, an ImportError with the pip line."""
    require("matplotlib", "drawing figures").use("Agg")
    return require("matplotlib.pyplot", "drawing figures", pip="matplotlib")


def can_draw(missing) -> bool:
    """Whether matplotlib is here; without it, print `<missing>: <its pip line>` (the tables stand
    alone). Asked before drawing, so that no ImportError is caught around the drawing code."""
    try:
        pyplot()
    except ImportError as e:
        print(f"{missing}: {e}")
        return False
    return True


def depth_weight_matrix(ckpt_path, n_windows=DEPTH_WINDOWS):
    """Average depth weight each effective layer puts on each candidate (its sources, then itself),
    over fixed validation windows, batch rows, KV heads and positions: (L, L), NaN where not a
    candidate."""
    _, ckpt, model = read_snapshot(lambda: Path(ckpt_path), read_model)  # a live run's too
    model.eval()
    T = model.config.block_size
    data_dir = ROOT / ckpt["data_dir"]
    if not (data_dir / "val.bin").is_file():
        raise DataError(f"{data_dir / 'val.bin'} is missing: the depth weights are read on the "
                        f"run's validation data; prepare it again (python prepare_data.py) where "
                        f"the run found it")
    val = read_tokens(data_dir, "val", load_meta(data_dir))
    starts = np.linspace(0, len(val) - T - 1, n_windows).astype(np.int64)
    x = torch.from_numpy(np.stack([val[s:s + T].astype(np.int64) for s in starts]))
    return as_matrix(mean_depth_weights(model, x), model.config.n_eff_layer)


def plot_depth_weights(m, path, title):
    """Figure 3's heatmap of depth_weight_matrix's m: layer by candidate, each cell's weight."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, origin="upper")
    for (i, j), v in np.ndenumerate(m):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="w" if v < 0.6 else "k")
    ax.set(xlabel="candidate layer (diagonal = the layer itself)", ylabel="layer", title=title)
    fig.colorbar(im, ax=ax, label="mean depth weight")
    fig.tight_layout()
    save_figure(fig, path, "ablate.py", dpi=120)


def show(source, figure=""):
    """Print a run's (a run folder or a checkpoint) depth weights as a table and draw them at figure
    (default <run>/depth_weights.png; an existing file is replaced only if ablate.py drew it). A
    UserError names the fix."""
    if is_hf_folder(source):
        raise CheckpointError(f"{source} is a Hugging Face folder; --depth_weights reads a train.py "
                              f"run (its checkpoint and its validation data): give the run it was "
                              f"exported from")
    path = checkpoint_path(source)
    figure = output_file(figure or path.parent / "depth_weights.png", "--figure",
                         written_by="ablate.py")
    m = depth_weight_matrix(path)
    if np.isnan(m).all():
        raise CheckpointError(f"{source}'s model computes no per-token depth weights (vanilla, the "
                              f"baselines and LIMe have none); give a run of a Depth-Attention "
                              f"mode")
    print(f"mean depth weights of {path} over {DEPTH_WINDOWS} validation windows "
          f"(row: layer, column: candidate)")
    print(table(m))
    if not can_draw("no figure"):
        return
    run = path.parent.resolve()
    plot_depth_weights(m, figure, f"Depth weights, {run.parent.name}/{run.name}")
    print("figure:", figure)
