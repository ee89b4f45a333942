"""
The depth weights as numbers (the paper's Figure 3): the mean weight each layer puts on each of its
candidates, its sources S(l) and itself. train.py logs them at every evaluation; `python ablate.py
--depth_weights=RUN` prints a checkpoint's and draws them.
"""
from contextlib import contextmanager

import numpy as np
import torch

from model import Attention


@contextmanager
def capture(model):
    """The depth weights of every forward of model inside the block: {effective layer e: (S(e),
    alpha (B, n_kv_head, T, |S(e)| + 1) float32)}, with the decode kernel off (it has no weights);
    empty for a model that computes none (vanilla, the baselines, LIMe's static router)."""
    sink, attns = {}, [m for m in model.modules() if isinstance(m, Attention)]
    for m in attns:
        m.weights_sink = lambda e, alpha: sink.__setitem__(
            e, (model.depth_sources[e], alpha.detach().transpose(2, 3)))
    try:
        yield sink
    finally:
        for m in attns:
            m.weights_sink = None


def weight_sums(alphas, rows=None) -> dict:
    """{(layer e, candidate c): the sum over the first `rows` windows of each window's mean weight
    over the KV heads and positions}, from capture's record of a forward."""
    return {(e, c): w for e, (src, alpha) in sorted(alphas.items())
            for c, w in zip(src + [e], alpha[:rows].double().mean(dim=(1, 2)).sum(0).tolist())}


@torch.no_grad()
def mean_depth_weights(model, x) -> dict:
    """{(layer e, candidate c): mean weight} over the windows x (B, T); {} for a model that computes
    no per-token depth weights (vanilla, the baselines, LIMe's static router)."""
    with capture(model) as alphas:
        model(x)
    return {key: w / len(x) for key, w in weight_sums(alphas).items()}


def as_record(means) -> dict:
    """The log.jsonl form: {"layer": {"candidate": weight}} (JSON keys are strings)."""
    record = {}
    for (e, c), w in means.items():
        record.setdefault(str(e), {})[str(c)] = round(w, 5)
    return record


def self_share(record) -> float:
    """The mean over layers of the weight each puts on itself, from a log.jsonl depth_weights
    record: 1 is "self only", what a vanilla layer computes; 1 - it is the drift from vanilla."""
    return sum(row[e] for e, row in record.items()) / len(record)


def as_matrix(means, n_layers) -> np.ndarray:
    """(n_layers, n_layers): row e, column c the weight layer e puts on candidate c; NaN where c is
    not one."""
    matrix = np.full((n_layers, n_layers), np.nan)
    for (e, c), w in means.items():
        matrix[e, c] = w
    return matrix


def table(matrix) -> str:
    """The matrix as text: a row per layer that has sources, a column per candidate layer."""
    L = len(matrix)
    lines = ["layer | " + " ".join(f"{c:>5}" for c in range(L))]
    for e in range(L):
        if np.isnan(matrix[e]).sum() < L - 1:  # a layer with sources (not only itself)
            lines.append(f"{e:>5} | " + " ".join("    ." if np.isnan(w) else f"{w:5.2f}"
                                                 for w in matrix[e]))
    return "\n".join(lines)
