"""
A checkpoint's checksums: a sha256 of each of its top-level entries, written with it
(support/run_dir.py, support/sharded.py) and verified when it is read (support/checkpoint.py), so a
flipped byte is an error naming the entry, never weights served.
"""
import hashlib

import torch


def _digest(value, h):
    """Feed value into hash h: tensors as dtype, shape and bytes (one pass, a tensor at a time),
    containers in their order, everything else as its repr. torch.load gives back equal values, so
    an equal digest."""
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {tuple(value.shape)};".encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(b"{")
        for k, v in value.items():
            _digest(k, h)
            _digest(v, h)
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"(" if isinstance(value, tuple) else b"[")
        for v in value:
            _digest(v, h)
        h.update(b")")
    else:
        h.update(f"{type(value).__name__} {value!r};".encode())
    return h


def checksums(obj: dict) -> dict:
    """{entry: sha256 of its contents} for every top-level entry of a checkpoint: a flipped byte in
    any tensor or value changes its entry's digest, and a reader can verify just the entries it
    uses."""
    return {
        key: _digest(value, hashlib.sha256()).hexdigest()
        for key, value in obj.items()
        if key != "checksums"
    }
