"""Exports and the folders the scripts read, attacked as a careless user would: an export never
mixes with what a folder held, never leaves half a folder, carries its tokenizer (not a path to it),
and a damaged folder or checkpoint is one error line. A train.py run that used a tokenizer.json
keeps it in its checkpoint."""
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
import export as export_py
import sample
from support import hf
from support.folders import MANIFEST, seal
from support.checkpoint import CheckpointError, load_model
from support.run_dir import save_checkpoint
from support.prepare import prepare
from support.tokenizer import get_tokenizer
from support.errors import EXIT_USER_ERROR, USER_ERRORS, DataError
from helpers import ROOT, TINY_SHAPE, make_tokenizer_json

TINY_EXPORT = ["--n_layer=2", *TINY_SHAPE, "--eval_seqs=4", "--sample_tokens=0", "--micro_batch=4",
               "--batch_tokens=128", "--max_iters=3", "--eval_interval=0", "--depth_mode=value"]


def export(*args):
    """export.py as a user runs it; the exit message, or None on success."""
    try:
        export_py.main([*map(str, args)])
    except USER_ERRORS as e:  # the one line run_main prints
        return f"error: {e}"
    return None


def one_error_line(message):
    assert message and message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.fixture
def run_dir(tmp_path):
    """A train.py checkpoint of a tiny value model with the bytes tokenizer."""
    model = tiny_model(vocab_size=257)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": "bytes", "step": 3}, run / "ckpt.pt")
    return run


def weights(folder):
    return hf.from_pretrained(folder).state_dict()


def test_export_into_an_older_sharded_export_replaces_it_whole(run_dir, tmp_path):
    """An older export's shard index used to survive and be read first: the folder loaded the
    previous model."""
    out = tmp_path / "out"
    old = tiny_model(seed=7, vocab_size=257)
    hf.save_pretrained(old, out, None)
    state = load_file(out / "model.safetensors")
    names = sorted(state)
    save_file({k: state[k] for k in names[:5]}, out / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in names[5:]}, out / "model-00002-of-00002.safetensors")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(names)}}))
    held = sorted(p.name for p in out.iterdir())
    assert "already holds" in one_error_line(export(run_dir, out))
    assert sorted(p.name for p in out.iterdir()) == held  # refused: untouched
    # the shards are not in the manifest: the user's, named, never deleted with the folder
    assert "model.safetensors.index.json" in one_error_line(export(run_dir, out, "--overwrite"))
    assert sorted(p.name for p in out.iterdir()) == held

    seal(out, "export.py")  # as an export that wrote shards would list them
    assert export(run_dir, out, "--overwrite") is None
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "baselines.py", "config.json",
                                                     "configuration_depth_attention.py", "model.py",
                                                     "model.safetensors",
                                                     "modeling_depth_attention.py",
                                                     "tokenizer.json", "tokenizer_config.json",
                                                     "variants.py"]
    new = load_model(run_dir).model.state_dict()
    assert all(torch.equal(new[k], v) for k, v in weights(out).items())
    # no temporary folder left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_an_interrupted_export_leaves_the_old_folder(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert export(run_dir, out) is None
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import safetensors.torch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(run_dir, out, "--overwrite", "--dtype=bfloat16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


def test_a_mismatched_tokenizer_is_refused(tmp_path):
    model = tiny_model(vocab_size=50)
    with pytest.raises(CheckpointError, match="257 tokens, more than the model's vocab_size 50"):
        hf.save_pretrained(model, tmp_path / "x", get_tokenizer("bytes"))
    assert not (tmp_path / "x").exists()


@pytest.fixture
def tokenizer_run(tmp_path, monkeypatch):
    """A train.py run on data tokenized with a tokenizer.json named by a path relative to the
    working directory, as `prepare_data.py text --tokenizer=tok/tokenizer.json` records it."""
    monkeypatch.chdir(tmp_path)
    Path("tok").mkdir()
    make_tokenizer_json("tok/tokenizer.json")
    Path("corpus.txt").write_text("the cat sat on the mat. a dog ran under the log.\n" * 60)
    prepare("text", name="tk", tokenizer="tok/tokenizer.json", inputs=["corpus.txt"],
                         out_dir="data", num_proc=1)
    monkeypatch.setattr(sys, "argv", ["train.py", *TINY_EXPORT, "--dataset=tk", "--data_root=data",
                                      "--out_dir=run"])
    with pytest.raises(SystemExit) as done:  # its __main__ exits with run_main's status
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    assert done.value.code == 0
    return tmp_path


def greedy(init_from, capsys):
    sample.main([f"--init_from={init_from}", "--prompt=the cat", "--max_new_tokens=6",
                 "--temperature=0", "--device=cpu"])
    return capsys.readouterr().out.split("--- sample")[-1]


def test_runs_and_exports_carry_their_tokenizer_when_moved(tokenizer_run, tmp_path, monkeypatch,
                                                           capsys):
    """The checkpoint held only the tokenizer's path (relative to where train.py ran), and the
    export copied nothing or copied from that path: both broke once moved or read from another
    working directory."""
    expected = greedy("run", capsys)
    assert export("run", "run_hf") is None
    assert (Path("run_hf") / "tokenizer.json").read_text() == Path("tok/tokenizer.json").read_text()
    shutil.rmtree("tok")  # the tokenizer the data was made with is gone
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move("run", moved / "run")
    shutil.move("run_hf", moved / "run_hf")
    monkeypatch.chdir(ROOT)  # another working directory
    assert greedy(moved / "run", capsys) == expected
    assert greedy(moved / "run_hf", capsys) == expected
    # the moved checkpoint exports the same tokenizer
    assert export(moved / "run", moved / "again") is None
    assert (moved / "again" / "tokenizer.json").read_text() == (moved / "run_hf" / "tokenizer.json").read_text()


def test_save_pretrained_writes_what_the_export_writes(run_dir, tmp_path):
    assert export(run_dir, tmp_path / "cli") is None
    loaded = load_model(run_dir)
    hf.save_pretrained(loaded.model, tmp_path / "py", loaded.tokenizer)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "py" / name).read_bytes(), name
    with pytest.raises(CheckpointError, match="already holds"):
        hf.save_pretrained(loaded.model, tmp_path / "py", loaded.tokenizer)


@pytest.mark.parametrize("damage, fragment", [
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
     "not a readable safetensors file"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:50]),
     "not a readable safetensors file"),
    (lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:-20]), "config.json is not valid JSON"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "holds a JSON list"),
    (lambda f: (f / "config.json").write_text(
        (f / "config.json").read_text().replace('"n_embd": 24', '"n_embd": "24"')), "config.json"),
    (lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-1.safetensors"}}'),
     "beside an index that lists other files"),
    (lambda f: (f / "model.safetensors.index.json").write_text("{"), "index.json is not valid JSON"),
], ids=["truncated-tail", "truncated-header", "config-truncated", "config-list", "config-type", "stale-index",
        "index-broken"])
def test_a_damaged_folder_is_one_error_line(run_dir, tmp_path, damage, fragment, monkeypatch,
                                            capsys):
    folder = tmp_path / "hf"
    assert export(run_dir, folder) is None
    damage(folder)
    with pytest.raises(CheckpointError, match=fragment):
        load_model(folder)
    with pytest.raises(USER_ERRORS) as e:
        sample.main([f"--init_from={folder}", "--max_new_tokens=2"])
    assert fragment in one_error_line(f"error: {e.value}")
    monkeypatch.setattr(sys, "argv", ["train.py", f"--init_from={folder}",
                                      f"--out_dir={tmp_path / 'x'}"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    # the last line: a first run in a fresh clone prepares the Shakespeare data before it
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == EXIT_USER_ERROR and fragment in one_error_line(last)


def test_a_foreign_tokenizer_json_is_one_error_line(tmp_path):
    folder = tmp_path / "hf"
    assert export_with_tokenizer(folder) is None
    (folder / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="not a readable tokenizer.json"):
        load_model(folder)


def export_with_tokenizer(folder):
    tok = folder.parent / "tok.json"
    make_tokenizer_json(tok)
    hf.save_pretrained(tiny_model(vocab_size=300), folder, get_tokenizer(str(tok)))
    return None if (folder / "tokenizer.json").is_file() else "no tokenizer.json"


def test_init_from_hint_names_a_tokenizer_prepare_data_takes(run_dir, tmp_path, monkeypatch, capsys):
    """The hint said --tokenizer=out/RUN, which prepare_data.py refuses for a train.py out_dir."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 400)
    tok = tmp_path / "tok.json"
    make_tokenizer_json(tok)
    prepare("text", name="other", tokenizer=str(tok), inputs=[str(corpus)],
                         out_dir=str(tmp_path / "data"), num_proc=1)
    capsys.readouterr()  # prepare's progress
    monkeypatch.setattr(sys, "argv", ["train.py", f"--init_from={run_dir}", "--dataset=other",
                                      f"--data_root={tmp_path / 'data'}",
                                      f"--out_dir={tmp_path / 'x'}", "--block_size=32"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    message = one_error_line(capsys.readouterr().err.strip().splitlines()[-1])
    assert e.value.code == EXIT_USER_ERROR
    assert "prepare_data.py --tokenizer=bytes" in message
    prepare("text", name="ok", tokenizer="bytes", inputs=[str(corpus)],
                         # the hint's tokenizer is accepted
                         out_dir=str(tmp_path / "data"), num_proc=1)
    assert os.path.isfile(tmp_path / "data" / "ok" / "meta.json")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_export_has_the_usual_file_modes(run_dir, tmp_path, umask):
    """model.safetensors came out -rw------- (safetensors' own mode) beside 644 code files: every
    file takes the mode a plain `cp` would give under the user's umask."""
    old = os.umask(umask)
    try:
        assert export(run_dir, tmp_path / "hf") is None
    finally:
        os.umask(old)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"model.safetensors", "config.json", "model.py", "tokenizer.json"} <= set(files)
    modes = {name: (tmp_path / "hf" / name).stat().st_mode & 0o777 for name in files}
    assert modes == dict.fromkeys(files, 0o666 & ~umask)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~umask
