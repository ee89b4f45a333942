"""
A prepared dataset, as train.py, eval.py and the memory plan read it: <data_root>/<name>/ holds
train.bin and val.bin (uint16 token ids, documents separated by the end-of-text token) and
meta.json (the tokenizer, its vocabulary size, the token counts), written last by
support/prepare.py, so a folder with meta.json is whole.
"""
import json
from pathlib import Path

from support.errors import DataError

SOURCES = ("shakespeare", "minipile", "pile", "text")  # what prepare_data.py prepares


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
    except (ValueError, KeyError, TypeError, OSError) as e:  # bad JSON, a missing key or .bin file
        raise DataError(
            f"{path} is not a valid prepare_data.py output ({type(e).__name__}: {e}): rerun "
            f"prepare_data.py with --force to rebuild it"
        ) from e
    for split, (n, size) in sizes.items():
        if size != 2 * n:
            raise DataError(
                f"{data_dir / split}.bin has {size} bytes but meta.json promises {n} uint16 tokens: "
                f"rerun prepare_data.py with --force"
            )
    return meta
