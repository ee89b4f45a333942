"""
What a run does about the world around it: the stop on Ctrl-C or SIGTERM that every rank agrees on
(StopSignals), and the process's peak memory for the last line of a run.
"""
import signal
import sys

import torch
import torch.distributed as dist

try:
    import resource  # peak memory on the CPU; absent on Windows
except ImportError:
    resource = None


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (what a scheduler sends before preemption) ask the run to stop:
    the step in flight finishes, a checkpoint is written, and the process exits with 128 + the
    signal's number. A second Ctrl-C stops at once (KeyboardInterrupt: the last checkpoint
    stays)."""

    def __init__(self):
        self.received = 0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signum

    def agreed(self, proc) -> int:
        """The signal any rank received, 0 for none: under torchrun every rank stops after the same
        step (one that stopped alone would leave the others waiting in a collective), often only
        some got the signal."""
        if not proc.distributed:
            return self.received
        flag = torch.tensor(self.received, device=proc.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def peak_memory(device) -> str:
    """This process's peak memory: what torch allocated on the GPU, else the resident size."""
    if device.startswith("cuda"):
        return f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated on the GPU"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if resource else 0
    kib = kib / 1024 if sys.platform == "darwin" else kib  # macOS counts bytes, Linux KiB
    return f"peak {kib / 2**20:.2f} GiB resident" if kib else "peak memory unknown"
