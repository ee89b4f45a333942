"""
A prepared dataset, as train.py, eval.py and the memory plan read it: <data_root>/<name>/ holds
train.bin and val.bin (token ids, documents separated by the end-of-text token) and meta.json
(the tokenizer, its vocabulary size, the ids' dtype, the token counts), written last by
support/prepare.py, so a folder with meta.json is whole. Every reader opens the .bin files with
`read_tokens`: uint16 up to 65,536 ids (bytes, GPT-2), uint32 above (Qwen3's 151,936).
"""
import json
from pathlib import Path

import numpy as np

from support.errors import DataError

SOURCES = ("shakespeare", "minipile", "pile", "text")  # what prepare_data.py prepares
DTYPES = ("uint16", "uint32")  # meta.json's "dtype"; a folder from before it was written: uint16


class NotPrepared(DataError):
    """A dataset folder without meta.json: prepare_data.py has not (finished) run."""


def load_meta(data_dir):
    """Read <data_dir>/meta.json and check that the .bin files match it."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not path.exists():
        raise NotPrepared(
            f"{path} not found: run `python prepare_data.py <source> --out_dir {data_dir.parent} "
            f"--name {data_dir.name}` first (sources: {', '.join(SOURCES)})"
        )
    try:
        meta = json.loads(path.read_text())
        sizes = {
            split: (n, (data_dir / f"{split}.bin").stat().st_size)
            for split, n in meta["tokens"].items()
        }
        missing = [k for k in ("tokenizer", "vocab_size") if k not in meta]
        if missing:
            raise KeyError(missing[0])
        dtype = meta.setdefault("dtype", "uint16")
        if dtype not in DTYPES or np.iinfo(dtype).max < meta["vocab_size"] - 1:
            raise ValueError(f"dtype {dtype!r} cannot hold {meta['vocab_size']} token ids")
    except (ValueError, KeyError, TypeError, OSError) as e:  # bad JSON, a missing key or .bin file
        raise DataError(
            f"{path} is not a valid prepare_data.py output ({type(e).__name__}: {e}): rerun "
            f"prepare_data.py with --force to rebuild it"
        ) from e
    width = np.dtype(meta["dtype"]).itemsize
    for split, (n, size) in sizes.items():
        if size != width * n:
            raise DataError(
                f"{data_dir / split}.bin has {size} bytes but meta.json promises {n} "
                f"{meta['dtype']} tokens: rerun prepare_data.py with --force"
            )
    return meta


def read_tokens(data_dir, split, meta) -> np.memmap:
    """<data_dir>/<split>.bin memory-mapped in meta.json's dtype (meta: load_meta's)."""
    return np.memmap(Path(data_dir) / f"{split}.bin", dtype=meta["dtype"], mode="r")
