"""
The token files train.py reads: <data_root>/<name>/ holds train.bin and val.bin (token ids, every
document followed by one end-of-text token; uint16, or uint32 for a tokenizer of more than 65,536
ids) and meta.json (the tokenizer, its vocabulary, the dtype, the counts), written last by
prepare_data.py, so a folder with meta.json is whole.
"""
import json
from pathlib import Path

import numpy as np

from configurator import DataError

DTYPES = ("uint16", "uint32")  # meta.json's "dtype"; a folder from before it was written: uint16
def load_meta(data_dir) -> dict:
    """<data_dir>/meta.json, checked against the .bin files it describes."""
    data_dir, path = Path(data_dir), Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
        sizes = {split: (n, (data_dir / f"{split}.bin").stat().st_size)
                 for split, n in meta["tokens"].items()}
        dtype = meta.setdefault("dtype", "uint16")
        if not isinstance(meta["vocab_size"], int) or not isinstance(meta["tokenizer"], str) \
                or dtype not in DTYPES or np.iinfo(dtype).max < meta["vocab_size"] - 1:
            raise ValueError("a tokenizer, a vocab_size and a dtype that holds its ids")
    except FileNotFoundError as e:
        raise DataError(f"{e.filename} not found: run `python prepare_data.py SOURCE --out_dir "
                        f"{data_dir.parent} --name {data_dir.name}` first") from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise DataError(f"{path} is not a valid prepare_data.py output ({type(e).__name__}: {e}); "
                        f"rebuild it with prepare_data.py --force") from None
    width = np.dtype(meta["dtype"]).itemsize
    for split, (n, size) in sizes.items():
        if size != width * n:
            raise DataError(f"{data_dir / split}.bin has {size} bytes, but meta.json promises {n} "
                            f"{meta['dtype']} tokens: rebuild it with prepare_data.py --force")
    return meta


def read_tokens(data_dir, split, meta) -> np.memmap:
    """<data_dir>/<split>.bin, memory-mapped in meta.json's dtype."""
    return np.memmap(Path(data_dir) / f"{split}.bin", dtype=meta["dtype"], mode="r")
