"""
How fast a train.py run goes, from the times it already measures (no extra device sync): model
FLOPs utilisation (MFU) and the time left (ETA).

MFU = the model's training FLOPs per token x tokens per second / the devices' peak FLOP/s. The
FLOPs per token are the PaLM/nanoGPT count, 6N for the weights' matmuls (forward and backward)
plus 12 L n_head head_dim T for attention's scores and mix, plus 3x the depth step's forward
FLOPs (support.cost.depth_cost, the paper's Table 2). The peak is --peak_flops, or the bf16 dense peak of
a GPU known by name; on a CPU or an unknown GPU there is no MFU rather than an invented one.
"""
import time

import torch

from support.cost import depth_cost

# bf16 dense tensor-core peaks (FLOP/s, no sparsity) from the vendors' datasheets, by a substring
# of torch.cuda.get_device_name(); the longest match wins ("H100 PCIe" before "H100").
GPU_PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H100 PCIe": 756e12, "H200": 989e12,
                  "B200": 2250e12, "L4": 121e12, "L40S": 362e12, "RTX 4090": 165e12}


def train_flops_per_token(model) -> float:
    """Training FLOPs per token of model (a GPT or baseline) at its block_size."""
    c = model.config
    attention = 12 * c.n_eff_layer * c.n_head * c.head_dim * c.block_size
    # a looped model runs its weights n_loops times
    return 6 * model.num_params() * c.n_loops + attention + 3 * depth_cost(c)["flops_per_token"]


def peak_flops(asked, device) -> float:
    """One device's peak FLOP/s: --peak_flops (> 0), else a known GPU's, else 0 (no MFU)."""
    if asked:
        return float(asked)
    if not str(device).startswith("cuda"):
        return 0.0
    name = torch.cuda.get_device_name(torch.device(device))
    known = [k for k in GPU_PEAK_FLOPS if k in name]
    return GPU_PEAK_FLOPS[max(known, key=len)] if known else 0.0


class Progress:
    """MFU and ETA of each step from its measured tokens per second and the wall clock since this
    invocation's first step ended (so evaluations and checkpoints count in the ETA, and a resumed
    run's time before does not)."""

    def __init__(self, flops_per_token, peak, world, max_iters):
        self.flops_per_token, self.peak, self.max_iters = flops_per_token, peak * world, max_iters
        self.first = None  # (step, time) at the end of this invocation's first step

    def __call__(self, step, tok_per_s, step_s) -> dict:
        """{"eta_s": seconds left, "mfu": fraction of peak (only with a peak)} after step."""
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
        done, since = step - self.first[0], now - self.first[1]
        per_step = since / done if done else step_s  # the first step alone: its own time
        out = {"eta_s": per_step * (self.max_iters - step)}
        if self.peak:
            out["mfu"] = self.flops_per_token * tok_per_s / self.peak
        return out


def describe(progress: dict) -> str:
    """The printed part: ' | mfu 41.3% | eta 1h02m' (mfu only where known)."""
    mfu = f" | mfu {100 * progress['mfu']:.1f}%" if "mfu" in progress else ""
    return f"{mfu} | eta {clock(progress['eta_s'])}"


def clock(seconds) -> str:
    """A duration as the log lines print it: '1h02m' from an hour on, else '3m05s'."""
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
