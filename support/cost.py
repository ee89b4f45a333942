"""
The depth step's per-token cost over vanilla, the paper's formulas (section 3.2, Table 2), from a
model's config and its row of model.DEPTH_MODES; bench_cache.py prints it beside what it measures.

    from support.cost import depth_cost
    depth_cost(config)   # {'candidates': ..., 'flops_per_token': ..., 'io_bytes_per_token': ..., ...}
"""
import torch

from model import DEPTH_MODES, Attention, DepthMode, ModelConfig, uniform_weights
from support.variants import BASELINE_MODES


def depth_cost(config: ModelConfig, bytes_per_element: int = 2) -> dict:
    """Per-token extra cost of the depth step over vanilla, the paper's formulas (Table 2).
    C = candidates (sources plus self) summed over the layers, d_kv = n_kv_head * head_dim.
    value: FLOPs 4 d_kv C (2 for the scores, 2 for the mix); activation I/O bytes (2C + L) d_kv
    (read K and V of each candidate, write one vector per layer). Uniform Mix has no scores and
    reads only V; a row mixing K mixes and writes it too. The KV cache is vanilla's in every
    mode; extra_params counts a learned row's params. LIMe's: baselines.lime_cost (DEPTH_COSTS)."""
    if config.depth_mode in BASELINE_MODES:  # a config naming it has imported baselines already
        from baselines import DEPTH_COSTS
        if config.depth_mode in DEPTH_COSTS:
            return DEPTH_COSTS[config.depth_mode](config, bytes_per_element)
    mode = DEPTH_MODES[config.depth_mode]
    L, d_kv = config.n_eff_layer, config.n_kv_head * config.head_dim
    C = sum(len(config.sources(e)) + 1 for e in range(1, L)) if mode.mixes else 0
    n_mix = mode.mixes_k + mode.mixes_v                    # vectors mixed per layer: K, V or both
    scored = mode.mixes and mode.weights is not uniform_weights  # <qbar, K_c> per candidate
    reads = C * ((scored or mode.mixes_k) + mode.mixes_v)  # each candidate's K and/or V, once
    writes = n_mix * L if C else 0  # the paper counts L written vectors (Table 2: L = 48)
    return {"candidates": C, "flops_per_token": 2 * d_kv * C * (scored + n_mix),
            "io_bytes_per_token": bytes_per_element * (reads + writes) * d_kv,
            "extra_persistent_bytes": 0, "extra_params": learned_params(config, mode)}


def learned_params(config: ModelConfig, mode: DepthMode) -> int:
    """A learned row's parameters over the blocks (on the meta device); a shared row's once."""
    if mode.params is None:
        return 0
    with torch.device("meta"):
        held = [Attention(config, layer).depth_params for layer in range(config.n_layer)]
    held = [params for params in held if isinstance(params, torch.nn.Module)]
    return sum(p.numel() for params in held[:1 if mode.shared else None]  # DepthMode.shared
               for p in params.parameters())
