"""Bad input and faults, as a user meets them. Every case ends in one of three ways: the work
continues correctly; one `error:` line naming the problem, exit 2; or a warning saying what
changed. Never a traceback, a silent wrong result or lost work: the failing cases hash every file
before and after. The sections: bad input to every command; damaged checkpoints, logs and data;
a full disk at each write and a kill during one; the folders a script may write; readers of a live
run; Ctrl-C and SIGTERM.

Scripts run in this process as `python script.py ARGS` runs them (helpers.cli), except where the
promise is about a process: an exit status from the interpreter, a kill, a signal, a closed pipe.
"""
import ast
import fcntl
import json
import os
import pty
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tiktoken.registry
import torch

import checkpoint
import prepare_data
from checkpoint import load_model, read_checkpoint
from configurator import CheckpointError, ConfigError, run_main
from conftest import tiny_model
from helpers import ENV, PACKAGES, ROOT, TINY_SHORT, TORCHRUN, assert_one_error_line, cli
from helpers import max_diff, read_log, run, snapshot, train, word_tokenizer
from lab.export import save_pretrained
from outputs import MANIFEST, RUN_FILES, append_line, claim, lock_run_folder, manifest

SHORT = [*TINY_SHORT, "--max_iters=4", "--eval_interval=2"]  # checkpoints at steps 2 and 4
LAB = {s: (ROOT / "lab" / s).exists() for s in ("eval.py", "ablate.py")}  # being ported


@pytest.fixture(scope="module")
def world(data_root, tmp_path_factory):
    """A copy of the tiny dataset, one finished run of it and its export, a corpus: to break
    copies of."""
    root = tmp_path_factory.mktemp("robust")
    shutil.copytree(data_root / "tiny", root / "data" / "tiny")
    code, _, err = cli("train.py", *SHORT, f"--data_root={root / 'data'}",
                       f"--out_dir={root / 'run'}")
    assert code == 0, err[-3000:]
    assert cli("lab/export.py", root / "run", root / "export")[0] == 0
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("a small corpus of words. " * 400)
    return {"root": root, "data_root": root / "data", "run": root / "run",
            "export": root / "export", "corpus": root / "corpus"}


def copy_run(w):
    shutil.copytree(w["run"], w["tmp"] / "run")
    return w["tmp"] / "run" / "ckpt.pt"


def copy_data(w):
    shutil.copytree(w["data_root"], w["tmp"] / "data")
    return w["tmp"] / "data" / "tiny"


def flip(path, entry):
    """XOR 4 KiB inside the first tensor of the checkpoint's model or optimizer."""
    ckpt = torch.load(path, weights_only=True)
    first = next(iter(ckpt["model"].values())) if entry == "model" else \
        ckpt["optimizer"]["state"][0]["exp_avg"]
    raw = bytearray(path.read_bytes())
    at = raw.find(first.numpy().tobytes()[:64])
    assert at > 0 and first.numel() * 4 >= 4096
    raw[at:at + 4096] = bytes(b ^ 0xFF for b in raw[at:at + 4096])
    path.write_bytes(raw)


def truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def offline(w, mp):
    """No gpt2 BPE files cached and no network: tiktoken's download meets a closed port."""
    mp.setattr(tiktoken.registry, "ENCODINGS", {})  # forget a gpt2 loaded earlier
    mp.setenv("TIKTOKEN_CACHE_DIR", str(w["tmp"] / "tiktoken"))
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        mp.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        mp.delenv(var, raising=False)
    (w["tmp"] / "a.txt").write_text("some text\n" * 50)


def edit_meta(w, change):
    meta = copy_data(w) / "meta.json"
    meta.write_text(change(json.loads(meta.read_text())))


def write(name, raw):
    return lambda w, mp: (w["tmp"] / name).parent.mkdir(exist_ok=True) or \
        (w["tmp"] / name).write_bytes(raw)


def both(*makes):
    return lambda w, mp: [make(w, mp) for make in makes]


def other_tokenizer(w, mp):
    copy_run(w)
    words = word_tokenizer(w["tmp"] / "tokenizer.json", 200)  # fewer ids than bytes' 257
    assert cli("prepare_data.py", "text", "--input", w["corpus"], "--name=words",
               f"--tokenizer={words}", f"--out_dir={w['tmp'] / 'data'}", "--num_proc=1")[0] == 0


def lock_linked(w, mp, link):
    """The run's train.lock a link (link: os.symlink or os.link) to a user's file beside it."""
    (w["tmp"] / "mine.txt").write_text("the user's")
    (copy_run(w).parent / "train.lock").unlink()
    link(w["tmp"] / "mine.txt", w["tmp"] / "run" / "train.lock")


def nanogpt_out_dir(w, mp):
    """A nanoGPT out_dir: its own ckpt.pt beside a config.json and a log.jsonl of the user's."""
    (w["tmp"] / "ng").mkdir()
    torch.save({"model": {}, "optimizer": {}, "model_args": {}, "iter_num": 5, "config": {}},
               w["tmp"] / "ng" / "ckpt.pt")
    (w["tmp"] / "ng" / "config.json").write_text('{"mine": 1}')
    (w["tmp"] / "ng" / "log.jsonl").write_text("{}\n")


def export_naming(tokenizer):
    def make(w, mp):
        shutil.copytree(w["export"], w["tmp"] / "hf")
        cfg = json.loads((w["tmp"] / "hf" / "config.json").read_text())
        (w["tmp"] / "hf" / "config.json").write_text(json.dumps({**cfg, "tokenizer": tokenizer}))
    return make


def no_tokenizer(w, mp):
    def loaded(*args):
        raise AssertionError("the tokenizer was loaded before the flags were checked")
    mp.setattr(prepare_data, "get_tokenizer", loaded)
    write("README.md", b"mine")(w, mp)


def case(script, fragment, *args, make=None, skip=False, bug=""):
    return pytest.param(script, args, fragment, make, id=f"{script} {' '.join(args[-2:])}"[:80],
                        marks=[pytest.mark.skipif(skip, reason="not on this machine"),
                               *[pytest.mark.xfail(strict=True, reason=bug)] * bool(bug)])


TRAIN = [*SHORT, "--data_root={data_root}", "--out_dir={tmp}/new"]  # only the case is wrong
RESUME = ["--out_dir={tmp}/run", "--resume"]
CASES = [
    # train.py: never lose a run, never write a wrong one
    case("train.py", "--overwrite", *SHORT, "--data_root={data_root}", "--out_dir={run}"),
    case("train.py", "--overwrite", "--out_dir={run}", "--resume", "--overwrite"),
    case("train.py", "no checkpoint at", *TRAIN, "--resume"),
    case("train.py", "model", *RESUME, make=lambda w, mp: flip(copy_run(w), "model")),
    case("train.py", "optimizer", *RESUME, make=lambda w, mp: flip(copy_run(w), "optimizer")),
    case("train.py", "ckpt.pt", *RESUME, make=lambda w, mp: truncate(copy_run(w))),
    case("train.py", "--init_from", "--out_dir={tmp}", "--resume", make=lambda w, mp: torch.save(
        {k: v for k, v in torch.load(w["run"] / "ckpt.pt", weights_only=True).items()
         if k in ("model", "model_config")}, w["tmp"] / "ckpt.pt")),  # a model, not a run
    case("train.py", "log.jsonl line 2", *RESUME, make=lambda w, mp: (w["tmp"] / "run" /
         "log.jsonl").write_text('{"step": 0}\nedited\n{"step": 1}\n') if copy_run(w) else 0),
    case("train.py", "--init_from", *RESUME, "--init_from={export}",
         make=lambda w, mp: copy_run(w)),  # a run continues the weights it began from
    case("train.py", "--dataset", *RESUME, "--dataset=words", "--data_root={tmp}/data",
         make=other_tokenizer),  # the same ids would mean other text
    case("train.py", "its own data", *RESUME, "--data_root={tmp}/data",
         make=lambda w, mp: (copy_run(w), edit_meta(w, lambda m: json.dumps(
             {**m, "max_token_id": 400})))),  # more ids: --vocab_size would change the model
    case("train.py", "--out_dir", *TRAIN, "--out_dir={tmp}/file", make=write("file", b"")),
    case("train.py", "train.lock", *RESUME, make=lambda w, mp: lock_linked(w, mp, os.symlink)),
    case("train.py", "train.lock", *TRAIN, "--out_dir={tmp}/run", "--overwrite",
         make=lambda w, mp: lock_linked(w, mp, os.link)),  # never written through a link
    case("train.py", "not written by train.py", *TRAIN, "--out_dir={tmp}/ng", "--overwrite",
         make=nanogpt_out_dir),  # a folder is a run by what its checkpoint holds
    case("train.py", "255 bytes", *TRAIN, "--out_dir={tmp}/" + "a" * 300),
    case("train.py", "latin.py, line 2", *TRAIN, "{tmp}/latin.py",
         make=write("latin.py", b"n_layer = 2\n# caf\xe9\n")),
    case("train.py", "ckpt.dcp", *TRAIN, "--out_dir={tmp}/r/ckpt.dcp.tmp/sub"),
    case("train.py", "bad.py", *TRAIN, "{tmp}/bad.py", make=write("bad.py", b"n_layer = = 3\n")),
    case("train.py", "--beta1", *TRAIN, "--beta1=1.5"),  # every range: tests/test_config.py
    case("train.py", "--device", *TRAIN, "--device=foo"),
    case("train.py", "--device", *TRAIN, "--device=cuda", skip=torch.cuda.is_available()),
    case("train.py", "--dataset=tiny", *TRAIN, "--dataset=tiy"),  # did you mean
    case("train.py", "prepare_data.py", *TRAIN, "--dataset=absent"),
    case("train.py", "--name etc --out_dir", *TRAIN, "--dataset=../../etc"),  # one it accepts
    case("train.py", "--vocab_size", *TRAIN, "--vocab_size=100"),
    case("train.py", "--block_size", *TRAIN, "--block_size=20000", "--batch_tokens=20000",
         "--micro_batch=1"),  # longer than the data
    case("train.py", "--batch_tokens", *TRAIN, "--batch_tokens=100"),
    case("train.py", "--micro_batch", *TRAIN, "--micro_batch=3"),
    case("train.py", "n_head", *TRAIN, "--n_head=3", "--n_kv_head=2"),
    case("train.py", "meta.json", *TRAIN, "--data_root={tmp}/data",
         make=lambda w, mp: edit_meta(w, lambda m: "{not json")),
    case("train.py", "train.bin", *TRAIN, "--data_root={tmp}/data", make=lambda w, mp: np.full(
        (copy_data(w) / "train.bin").stat().st_size // 2, 300, dtype=np.uint16).tofile(
        w["tmp"] / "data" / "tiny" / "train.bin")),  # ids beyond the vocabulary, same size
    # sample.py
    case("sample.py", "model", "--init_from={tmp}/run", make=lambda w, mp: flip(copy_run(w),
                                                                                 "model")),
    case("sample.py", "random.pt", "--init_from={tmp}/random.pt",
         make=write("random.pt", os.urandom(4096))),
    case("sample.py", "log.jsonl", "--init_from={run}/log.jsonl"),  # not called damaged
    case("sample.py", "no checkpoint at", "--init_from={tmp}/absent"),
    case("sample.py", "--prompt_file", "--init_from={run}", "--prompt_file={tmp}/nope.txt"),
    case("sample.py", "--device", "--init_from={run}", "--device=foo"),
    case("sample.py", "config.json", "--init_from={tmp}/hf", make=export_naming(["gpt2"])),
    # prepare_data.py
    case("prepare_data.py", "--tokenizer=bytes", "text", "--input", "{tmp}/a.txt",
         "--out_dir={tmp}/out", make=offline),
    case("prepare_data.py", "typo.txt", "text", "--input", "{tmp}/typo.txt",
         "--out_dir={tmp}/out", make=offline),  # checked before the tokenizer loads
    case("prepare_data.py", "--out_dir", "text", "--input", "{corpus}",
         "--out_dir={tmp}/README.md", make=no_tokenizer),
    case("prepare_data.py", "bad.txt", "text", "--input", "{tmp}/good.txt", "{tmp}/bad.txt",
         "--name=tiny", "--out_dir={tmp}/data", "--tokenizer=bytes", "--num_proc=1", "--force",
         make=both(lambda w, mp: copy_data(w), write("good.txt", b"fine\n" * 99),
                   write("bad.txt", b"caf\xe9\n"))),  # the --force rebuild fails: tiny is kept
    case("prepare_data.py", "looks binary", "text", "--input", "{tmp}/noise.txt",
         "--tokenizer=bytes", "--out_dir={tmp}/out", "--decode_errors=replace",
         make=write("noise.txt", random.Random(0).randbytes(4096))),
    case("prepare_data.py", "00.jsonl.zst", "pile", "--input", "{tmp}/00.jsonl.zst",
         "--tokenizer=bytes", "--out_dir={tmp}/out", make=write("00.jsonl.zst", b"not zstd")),
    case("prepare_data.py", "empty", "text", "--input", "{tmp}/e1.txt", "{tmp}/e2.txt",
         "--tokenizer=bytes", "--out_dir={tmp}/out", make=both(write("e1.txt", b""),
                                                               write("e2.txt", b""))),
    case("prepare_data.py", "--name", "text", "--input", "{corpus}", "--name=../x",
         "--tokenizer=bytes", "--out_dir={tmp}/out"),
    case("prepare_data.py", "--input", "text", "--out_dir={tmp}/out"),
    case("prepare_data.py", "255 bytes", "text", "--input", "{corpus}", "--name=" + "a" * 300),
    case("prepare_data.py", "--input", "shakespeare", "--input", "{corpus}",
         "--out_dir={tmp}/out"),
    # lab/export.py and bench_cache.py
    case("lab/export.py", "no checkpoint at", "{tmp}/absent", "{tmp}/hf"),
    case("lab/export.py", "--overwrite", "{run}", "{export}"),
    case("lab/export.py", "255 bytes", "{run}", "{tmp}/" + "a" * 300 + "/hf"),
    case("bench_cache.py", "foo", "--modes=foo"),
    case("bench_cache.py", "--preset", "--preset=foo"),
    case("bench_cache.py", "--json", "--json={tmp}/dir/", make=write("dir/x", b"")),
    # lab/eval.py and lab/ablate.py
    case("lab/eval.py", "no checkpoint at", "--init_from={tmp}/absent", skip=not LAB["eval.py"]),
    case("lab/eval.py", "ckpt.dcp", "--init_from={run}", "--json={tmp}/r/ckpt.dcp/eval.json",
         skip=not LAB["eval.py"]),
    case("lab/ablate.py", "--seeds", "--seeds=0", skip=not LAB["ablate.py"]),
    case("lab/ablate.py", "ckpt.dcp", "--out={tmp}/r/ckpt.dcp/sweep", skip=not LAB["ablate.py"]),
]


@pytest.mark.parametrize("script, args, fragment, make", CASES)
def test_bad_input_is_one_error_line_and_changes_nothing(world, tmp_path, monkeypatch, script,
                                                         args, fragment, make):
    w = {**world, "tmp": tmp_path}
    if make:
        make(w, monkeypatch)
    before = snapshot(world["root"], tmp_path)
    code, out, err = cli(script, *(a.format(**w) for a in args))
    assert code == 2, (code, err[-2000:])
    assert_one_error_line(code, out, err, fragment)
    after = snapshot(world["root"], tmp_path)
    assert {p: after.get(p) for p in before} == before  # every file that was there is as it was


@pytest.mark.parametrize("setting", [
    "--beta1=1.5", "--seed=-1", "--device=foo", "--depth_mode=Value",
    "--micro_batch=3", "--n_kv_head=3"])
def test_a_setting_train_refuses_writes_nothing(world, tmp_path, setting):
    code, out, err = cli("train.py", *(a.format(**world, tmp=tmp_path) for a in TRAIN), setting)
    assert_one_error_line(code, out, err, setting.split("=")[0].lstrip("-"))
    assert not (tmp_path / "new").exists()


def test_the_interpreter_prints_the_same_one_line(world, tmp_path):
    flip(copy_run({**world, "tmp": tmp_path}), "model")
    proc = subprocess.run([sys.executable, "sample.py", f"--init_from={tmp_path / 'run'}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, "model")


# ----------------------------------------------------------------------------- the work continues

def test_a_second_writer_is_refused_and_a_released_lock_blocks_nothing(world, tmp_path):
    copy_run({**world, "tmp": tmp_path})
    run = tmp_path / "run"
    with open(run / "train.lock", "a") as held:  # a live run holds the lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(run)
        assert_one_error_line(*cli("train.py", f"--out_dir={run}", "--resume"), str(run))
        assert snapshot(run) == before
    code, out, err = cli("train.py", f"--out_dir={run}", "--resume")  # gone with its run
    assert code == 0 and "done: step 4" in out, err[-2000:]


def test_a_resume_names_changed_keys_and_config_json_keeps_the_history(world, tmp_path):
    """...and a torn checkpoint write or log line a kill left is dropped, said."""
    copy_run({**world, "tmp": tmp_path})
    run = tmp_path / "run"
    (run / "ckpt.pt.tmp12345").write_bytes(b"torn")
    with open(run / "log.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    code, out, err = cli("train.py", f"--out_dir={run}", "--resume", "--max_iters=6",
                         "--learning_rate=5e-3")
    assert code == 0 and "last line was cut short" in err, err[-2000:]
    warning = next(line for line in err.splitlines() if "changed settings" in line)
    assert "max_iters 4 -> 6" in warning and "learning_rate 0.01 -> 0.005" in warning
    assert json.loads((run / "config.json").read_text())["resumes"] == [
        {"step": 4, "changed": {"max_iters": [4, 6], "learning_rate": [0.01, 0.005]}}]
    assert read_checkpoint(run / "ckpt.pt")["step"] == 6 and not list(run.glob("*.tmp*"))
    code, _, err = cli("train.py", f"--out_dir={run}", "--resume")  # unchanged: no warning
    assert code == 0 and "warning" not in err
    assert json.loads((run / "config.json").read_text())["resumes"][-1] == {"step": 6,
                                                                            "changed": {}}


def test_overwrite_starts_over(world, tmp_path):
    copy_run({**world, "tmp": tmp_path})
    run = tmp_path / "run"
    code, out, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}",
                         f"--out_dir={run}", "--overwrite", "--max_iters=2")
    assert code == 0 and "--overwrite" in out and "ckpt.pt" in out, err[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 2] and read_checkpoint(run / "ckpt.pt")["step"] == 2  # one log


def test_damage_to_the_optimizer_does_not_stop_sampling(world, tmp_path):
    """sample.py verifies what it reads, the model; a resume verifies everything (above)."""
    flip(copy_run({**world, "tmp": tmp_path}), "optimizer")
    code, out, err = cli("sample.py", f"--init_from={tmp_path / 'run'}", "--max_new_tokens=3")
    assert code == 0 and "3 new tokens" in out, err[-2000:]


# ----------------------------------------------------------------------------- a full disk, a kill

@contextmanager
def file_size_limit(limit):
    """Writes past `limit` bytes fail with EFBIG, as on a full disk with ENOSPC (SIGXFSZ, which
    would kill the process, ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def append_a_long_line(log):
    return run_main(lambda argv: append_line(log, json.dumps({"step": 1, "note": "x" * 4000})),
                    [])


BENCH = ["--n_layer=2", "--n_embd=16", "--n_head=2", "--n_kv_head=1", "--head_dim=8",
         "--mlp_hidden=32", "--block_size=16", "--vocab_size=64", "--batch=1", "--prompt_len=4",
         "--new_tokens=2", "--warmup=0", "--repeats=1", "--device=cpu", "--modes=vanilla,value"]
# (the command, the limit in bytes, the output it must name and leave as it was)
FULL_DISK = [
    (["train.py", *TRAIN], 20_000, "{tmp}/new/ckpt.pt"),  # the first checkpoint, after the log
    (["prepare_data.py", "text", "--input", "{corpus}", "--tokenizer=bytes", "--num_proc=1",
      "--out_dir={tmp}/data"], 2_000, "{tmp}/data/text"),
    (["lab/export.py", "{run}", "{tmp}/hf"], 2_000, "{tmp}/hf"),
    (["bench_cache.py", *BENCH, "--json={tmp}/bench.json"], 50, "{tmp}/bench.json"),
    (["log.jsonl"], 1_000, "{tmp}/log.jsonl"),  # a line appended whole or not at all
    (["lab/eval.py", "--init_from={run}", "--tasks=", "--ppl=tiny", "--data_root={data_root}",
      "--json={tmp}/eval.json"], 50, "{tmp}/eval.json"),
    (["lab/ablate.py", "--curves={run}", "--figure={tmp}/curves.png"], 1_000, "{tmp}/curves.png"),
]


@pytest.mark.parametrize("argv, limit, output", FULL_DISK, ids=lambda v: str(v)[:24])
def test_a_full_disk_is_one_line_naming_the_path_and_the_space(world, tmp_path, capsys, argv,
                                                               limit, output):
    if not (ROOT / argv[0]).exists() and argv[0].endswith(".py"):
        pytest.skip(f"{argv[0]} is not here yet")
    w = {**world, "tmp": tmp_path}
    output = Path(output.format(**w))
    if output.name == "log.jsonl":
        output.write_text('{"step": 0}\n')
    before = output.read_bytes() if output.exists() else None
    with file_size_limit(limit):
        if argv == ["log.jsonl"]:
            code, out, err = append_a_long_line(output), "", capsys.readouterr().err
        else:
            code, out, err = cli(*(a.format(**w) for a in argv))
    assert code == 2, err[-3000:]
    assert_one_error_line(code, out, err, str(output))
    assert "no space left on device" in err and " MB" in err.split("free")[-1], err
    assert (output.read_bytes() if output.exists() else None) == before
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name], list(tmp_path.rglob("*"))


def test_a_full_disk_keeps_the_previous_checkpoint(world, tmp_path, monkeypatch):
    save, calls = torch.save, []

    def full_disk(obj, f):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"partial")
            raise OSError(28, "No space left on device")
        return save(obj, f)
    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "full"
    code, stdout, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}",
                            f"--out_dir={out}")
    assert_one_error_line(code, stdout, err, "ckpt.pt at step 4")
    assert "step 2 is kept" in err and "--resume" in err
    monkeypatch.undo()
    assert read_checkpoint(out / "ckpt.pt")["step"] == 2 and not list(out.glob("ckpt.pt.tmp*"))


# train.py whose second checkpoint write meets `SECOND`: a kill -9 half-way, or a Ctrl-C typed twice
DURING_SAVE = """
import io, os, runpy, signal, sys, torch
real_save, calls = torch.save, []
class Typed:  # the file torch.save writes; Ctrl-C twice at its second write, as a user types it
    def __init__(self, f):
        self.f, self.n = f, 0
    def write(self, data):
        self.n += 1
        for _ in range(2 * (self.n == 2)):  # (a loop: the handler runs between the two)
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(data)
    def flush(self):
        self.f.flush()
def second_save(obj, f):
    calls.append(1)
    if len(calls) == 1:
        return real_save(obj, f)
    SECOND
torch.save = second_save
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""
KILLED_SAVE = DURING_SAVE.replace("SECOND", """buf = io.BytesIO()
    real_save(obj, buf)
    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    f.flush()
    os._exit(9)""")


def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(world, tmp_path, monkeypatch):
    """Killed while writing its second checkpoint (a checkpoint follows every evaluation): the
    first stays, the torn write is removed by the resume, which gives the run never killed."""
    args = [*TINY_SHORT, "--max_iters=8", "--eval_interval=2",
            f"--data_root={world['data_root']}"]
    assert train(monkeypatch, *args, f"--out_dir={tmp_path / 'whole'}") is None
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, *args, f"--out_dir={killed}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-3000:]
    torn = list(killed.glob("ckpt.pt.tmp*"))
    assert len(torn) == 1 and read_checkpoint(killed / "ckpt.pt")["step"] == 2
    with pytest.raises(CheckpointError):
        read_checkpoint(torn[0])
    assert train(monkeypatch, f"--out_dir={killed}", "--resume") is None
    assert not torn[0].exists()
    diff = max_diff(read_log(killed), read_log(tmp_path / "whole"))
    assert diff == 0, f"losses after the kill and resume differ by up to {diff:.3e}"


def test_ctrl_c_twice_during_a_save_is_interrupted_and_130_with_the_last_checkpoint_kept(
        world, tmp_path):
    """The second Ctrl-C raises inside torch.save's writer, which wraps it in a RuntimeError."""
    proc = subprocess.run([sys.executable, "-c", DURING_SAVE.replace("SECOND", "real_save(obj, "
                           "Typed(f))"), *SHORT, f"--data_root={world['data_root']}",
                           f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith("interrupted; the last checkpoint is intact")
    assert read_checkpoint(tmp_path / "ckpt.pt")["step"] == 2 and not list(tmp_path.glob("*.tmp*"))


# ----------------------------------------------------------------------------- folders

def users_folder(where):
    where.mkdir()
    for name, text in [("config.json", '{"mine": 1}'), ("log.jsonl", "{}\n"),
                       ("README.md", "card"), ("ckpt.pt.tmp123", "not a torn write")]:
        (where / name).write_text(text)
    return where


# foreign folder -> (the folder given as the target, the folder whose files must stay)
FOREIGN = {
    "an export": lambda w, tmp: (w["export"], w["export"]),
    "a user's folder": lambda w, tmp: (users_folder(tmp / "mine"),) * 2,
    "the current folder": lambda w, tmp: (Path("."), users_folder(tmp / "here")),
    "a parent of the run": lambda w, tmp: (w["run"].parent, w["run"].parent),
    "a symlink to a user's folder": lambda w, tmp: (
        os.symlink(users_folder(tmp / "target"), tmp / "link") or tmp / "link", tmp / "target"),
    "the command's own source": lambda w, tmp: (w["run"], w["run"]),
}
# writer -> its command line writing into folder f with --overwrite; its source: the run (the
# corpus for prepare_data.py, the run's checkpoint as its input for "own source")
WRITERS = {
    "train.py": lambda f, w: ("train.py", *SHORT, f"--data_root={w['data_root']}",
                              f"--out_dir={f}", "--overwrite", f"--init_from={w['run']}"),
    "lab/export.py": lambda f, w: ("lab/export.py", w["run"], f, "--overwrite"),
    "prepare_data.py": lambda f, w: (
        "prepare_data.py", "text", "--input", w["run"] / "ckpt.pt" if f == w["run"] else
        w["corpus"], "--force", "--out_dir", Path(f).resolve().parent, "--name",
        Path(f).resolve().name),
    "course/make.py": lambda f, w: ("course/make.py", f, "--overwrite"),
    "lab/ablate.py": lambda f, w: ("lab/ablate.py", f"--out={f}", "--runs=vanilla", "--seeds=1",
                                   f"--base={ROOT / 'configs/ablations/cpu.py'}", "--overwrite"),
}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("foreign", FOREIGN)
def test_no_writer_touches_a_folder_it_did_not_make(writer, foreign, world, tmp_path,
                                                    monkeypatch):
    if writer == "lab/ablate.py" and not LAB["ablate.py"]:
        pytest.skip("lab/ablate.py is not here yet")
    if (writer, foreign) == ("lab/export.py", "an export"):
        pytest.skip("its own folder: test_overwrite_keeps_what_the_writer_did_not_write")
    target, kept = FOREIGN[foreign](world, tmp_path)
    if foreign == "the current folder":
        monkeypatch.chdir(kept)
    before = snapshot(kept, world["run"], world["export"])
    code, out, err = cli(*WRITERS[writer](target, world))
    assert code == 2, err[-2000:]
    assert_one_error_line(code, out, err, "")
    assert snapshot(kept, world["run"], world["export"]) == before


def test_overwrite_keeps_what_the_writer_did_not_write(world, tmp_path):
    """train.py --overwrite in its own run deletes its files, not a user's notes; an export is
    replaced whole, so a user's file there is named and the folder kept."""
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    (run / "notes.txt").write_text("mine")
    code, out, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}",
                         f"--out_dir={run}", "--overwrite", "--max_iters=2")
    assert code == 0 and "notes.txt" in out, err[-2000:]
    assert (run / "notes.txt").read_text() == "mine"
    export = tmp_path / "export"
    shutil.copytree(world["export"], export)
    (export / "README.md").write_text("a model card")
    before = snapshot(export)
    assert_one_error_line(*cli("lab/export.py", run, export, "--overwrite"), "README.md")
    assert snapshot(export) == before
    (export / "README.md").unlink()
    assert cli("lab/export.py", run, export, "--overwrite")[0] == 0
    assert manifest(export)["written_by"].startswith("export.py")
    assert load_model(export).model.state_dict().keys() == load_model(run).model.state_dict().keys()


def test_a_students_file_in_a_subfolder_of_the_copy_is_named_not_replaced(tmp_path):
    """course/make.py's manifest lists every file it wrote, at any depth. (Processes: its
    fixtures add a row to model.DEPTH_MODES.)"""
    copy = tmp_path / "student"
    run("course/make.py", copy, "--untracked")
    (copy / "course" / "my_draft.md").write_text("a student's draft")
    proc = run("course/make.py", copy, "--overwrite", "--untracked", check=False)
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, "course/my_draft.md")
    assert (copy / "course" / "my_draft.md").read_text() == "a student's draft"


def test_a_run_from_before_manifests_resumes_and_nothing_else_is_adopted(world, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(world["run"], old)
    (old / MANIFEST).unlink()
    code, out, err = cli("train.py", f"--out_dir={old}", "--resume", "--max_iters=5")
    assert code == 0, err[-2000:]
    assert manifest(old)["written_by"].startswith("train.py")
    with pytest.raises(ConfigError, match="export.py"):
        claim(world["export"], "train.py", "--out_dir")


def test_a_forged_manifest_reaches_nothing_outside_its_folder(tmp_path):
    """The names a manifest lists are paths down its folder: one listing ../x or /etc is no
    manifest, nor a link to a well-formed one; a path through a link deletes nothing."""
    for files in (["../victim"], ["/etc/passwd"], ["a/../b"], ["a//b"], [".."], "ckpt.pt", [1]):
        (tmp_path / MANIFEST).write_text(json.dumps({"written_by": "train.py, Depth-Attention",
                                                     "files": files}))
        assert manifest(tmp_path) == {}
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "ckpt.pt").write_text("the user's")
    folder = claim(tmp_path / "run", "train.py", "--out_dir", ["link", "link/ckpt.pt"])
    folder.record()
    (tmp_path / "run" / "link").symlink_to(tmp_path / "victim")
    claim(tmp_path / "run", "train.py", "--out_dir").clear()
    assert (tmp_path / "victim" / "ckpt.pt").read_text() == "the user's"
    assert not (tmp_path / "run" / "link").is_symlink()  # the link itself was the run's
    elsewhere = tmp_path.parent / f"{tmp_path.name}.json"
    elsewhere.write_text('{"written_by": "train.py, Depth-Attention", "files": ["ckpt.pt"]}')
    (tmp_path / MANIFEST).unlink()
    (tmp_path / MANIFEST).symlink_to(elsewhere)
    assert manifest(tmp_path) == {}


def test_an_export_from_python_is_marked_as_the_command_marks_it(tmp_path):
    save_pretrained(tiny_model(vocab_size=257), tmp_path / "hf", None)
    assert manifest(tmp_path / "hf")["written_by"].startswith("export.py")
    (tmp_path / "hf" / "stray.pt").write_bytes(b"a user's")
    with pytest.raises(ConfigError, match="stray.pt"):
        save_pretrained(tiny_model(vocab_size=257), tmp_path / "hf", None, overwrite=True)


def test_a_folder_it_cannot_write_is_one_error_naming_it(tmp_path, monkeypatch):
    """Read-only (root writes anywhere, so the refusal is stood in): the manifest's write fails as
    the first write would, a ConfigError naming the flag, not a PermissionError."""
    def refused(self, raw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "write_bytes", refused)
    with pytest.raises(ConfigError, match="--out_dir=.*Permission denied"):
        claim(tmp_path / "run", "train.py", "--out_dir").record()


def test_a_killed_exports_temporaries_are_removed_by_the_next_export(world, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process holds now
    left = [tmp_path / f".hf.tmp{dead.pid}", tmp_path / f".hf.old{dead.pid}"]
    for folder in left:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"part")
    code, out, err = cli("lab/export.py", world["run"], tmp_path / "hf")
    assert code == 0, err[-2000:]
    assert not any(f.exists() for f in left) and (tmp_path / "hf" / "config.json").is_file()


# ----------------------------------------------------------------------------- a live run's readers

# train.py recording, after every save, a line "step digest" of the weights it saved
RECORDING = """
import os, sys
sys.path.insert(0, os.getcwd())
import checkpoint, configurator, train
record = sys.argv.pop(1)
save = train.save

def recording(run, lr):
    save(run, lr)
    sd = run.model.state_dict()
    with open(record, "a") as f:
        f.write(f"{run.step} {checkpoint.checksums({'m': {k: sd[k] for k in sorted(sd)}})['m']}\\n")

train.save = recording
sys.exit(configurator.run_main(train.main))
"""


def test_reading_a_run_while_it_saves_every_step_never_misreads(world, tmp_path):
    """load_model 100 times, and on till six saved steps were read, against a run saving every
    step (counted, not timed: on a loaded machine either side may fall behind): no false
    "damaged", and every read's weights are those saved at the step it reports."""
    out, record = tmp_path / "run", tmp_path / "saved.txt"
    (tmp_path / "recording.py").write_text(RECORDING)
    writer = subprocess.Popen(
        [sys.executable, str(tmp_path / "recording.py"), str(record), *TINY_SHORT,
         f"--data_root={world['data_root']}", f"--out_dir={out}", "--ckpt_interval=1",
         "--eval_interval=0", "--max_iters=100000"],
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, retried = [], 0
    try:
        while len(seen) + retried < 100 or len({s for s, _ in seen}) < 6:
            assert writer.poll() is None, f"the run stopped: {writer.stderr.read()[-2000:]}"
            if not (out / "ckpt.pt").exists():
                time.sleep(0.05)
                continue
            try:
                loaded = load_model(out)
            except CheckpointError as e:
                assert "replaced while being read" in str(e), f"a false alarm: {e}"
                retried += 1
                continue
            sd = loaded.model.state_dict()
            seen.append((loaded.step, checkpoint.checksums({"m": {k: sd[k] for k in sorted(sd)}})
                         ["m"]))
    finally:
        writer.terminate()  # SIGTERM: the run saves, records and stops
        writer.wait(timeout=120)
    saved = dict(line.split() for line in record.read_text().splitlines())
    wrong = [(s, d) for s, d in seen if saved.get(str(s)) != d]
    assert not wrong, f"{len(wrong)} of {len(seen)} reads gave weights not saved at their step"
    assert retried <= len(seen), f"{retried} of {len(seen) + retried} reads were asked to retry"


def test_a_shard_gone_mid_read_is_a_replaced_folder_not_an_error(tmp_path):
    """A shard renamed away by the run's swap while a read is inside the folder: the reader reads
    the new folder, not raise."""
    from lab.shards import snapshot as read_snapshot
    live, calls = tmp_path / "ckpt.dcp", []
    live.mkdir()

    def read(path):
        calls.append(path)
        if len(calls) == 1:  # the run replaces the folder while this read is inside it
            live.rename(tmp_path / "ckpt.dcp.old")
            live.mkdir()
            raise FileNotFoundError(path / "__0_0.distcp")
        return "the new step"
    assert read_snapshot(lambda: live, read) == "the new step" and len(calls) == 2


def test_a_lone_old_sharded_checkpoint_is_the_checkpoint(tmp_path):
    """Killed between a sharded save's two renames, only ckpt.dcp.old is left: readers take it,
    and the next run's lock puts it back as ckpt.dcp (the FSDP resume itself: test_sharded)."""
    run = tmp_path / "run"
    claim(run, "train.py", "--out_dir", RUN_FILES).record()
    (run / "ckpt.dcp.old").mkdir()
    (run / "ckpt.dcp.old" / "run.pt").write_bytes(b"")
    assert checkpoint.checkpoint_path(run) == run / "ckpt.dcp.old"
    assert checkpoint.checkpoint_path(run / "ckpt.dcp" / "run.pt") == run / "ckpt.dcp"
    lock = lock_run_folder(run, resuming=True, overwrite=False)
    lock.close()
    assert (run / "ckpt.dcp" / "run.pt").is_file() and not (run / "ckpt.dcp.old").exists()


def test_a_closed_pipe_is_silent(world):
    """`python sample.py ... | head -1`: no BrokenPipeError traceback, exit 128 + SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "sample.py", f"--init_from={world['run']}",
                             "--num_samples=3", "--max_new_tokens=8"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM

RUN = [*TINY_SHORT, "--max_iters=400", "--eval_interval=10", "--ckpt_interval=0"]
UNTIL = 40  # every run is compared up to this step


@pytest.fixture(scope="module")
def uninterrupted(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = cli("train.py", *RUN, f"--data_root={world['data_root']}", f"--out_dir={out}",
                       f"--stop_at_step={UNTIL}")
    assert code == 0, err[-2000:]
    return read_log(out)


def interrupt(command, out_dir, signum, target=lambda proc: proc.pid):
    """Start command, send signum to target(proc) once two steps are logged; (returncode,
    stderr)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    log, deadline = Path(out_dir) / "log.jsonl", time.monotonic() + 300  # a hang's bound
    while not (log.is_file() and log.read_text().count('"kind": "train"') >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no two steps logged"
        time.sleep(0.005)
    os.kill(target(proc), signum)
    _, err = proc.communicate(timeout=120)
    step = read_checkpoint(Path(out_dir) / "ckpt.pt")["step"]
    assert 2 <= step < UNTIL and max(s for kind, s in read_log(out_dir) if kind == "train") == step
    return proc.returncode, err, step


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_resuming_is_the_same_run(
        world, uninterrupted, tmp_path, monkeypatch):
    code, err, step = interrupt([sys.executable, "train.py", *RUN,
                                 f"--data_root={world['data_root']}", f"--out_dir={tmp_path}"],
                                tmp_path, signal.SIGINT)
    assert code == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert f"SIGINT after step {step}" in last and f"{tmp_path}/ckpt.pt" in last, err
    assert "--resume" in last
    assert train(monkeypatch, f"--out_dir={tmp_path}", "--resume",
                 f"--stop_at_step={UNTIL}") is None
    diff = max_diff(read_log(tmp_path), uninterrupted)
    assert diff == 0, f"stopped by Ctrl-C and resumed, the losses differ by up to {diff:.3e}"


def rank_pid(launcher, rank):
    """The pid of torchrun's worker with RANK=rank (its environment says which)."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{launcher.pid}\n" in status.read_text() and f"RANK={rank}".encode() in \
                    (status.parent / "environ").read_bytes().split(b"\0"):
                return int(status.parent.name)
        except OSError:  # a process that ended meanwhile
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun")


def test_sigterm_to_one_of_two_gloo_ranks_stops_both_and_one_process_finishes_the_run(
        world, uninterrupted, tmp_path, monkeypatch):
    """Both ranks stop after the same step, rank 0 saves and says so; one process resumes the
    checkpoint: every loss, the two ranks' and the one process's, is the one process's run."""
    code, err, step = interrupt([*TORCHRUN, "train.py", *RUN, "--micro_batch=2",
                                 f"--data_root={world['data_root']}", f"--out_dir={tmp_path}"],
                                tmp_path, signal.SIGTERM, lambda p: rank_pid(p, 1))
    assert code != 0 and f"stopped by SIGTERM after step {step}" in err, err[-3000:]
    assert train(monkeypatch, f"--out_dir={tmp_path}", "--resume",
                 f"--stop_at_step={UNTIL}") is None
    diff = max_diff(read_log(tmp_path), uninterrupted)
    assert diff < 1e-5, f"two ranks, stopped and resumed, differ from one process by {diff:.3e}"


# Every file a user runs: those with a __main__ guard, at the root and a folder down (lab/,
# course/), outside tests/ and hidden folders.
SCRIPTS = sorted(rel.as_posix() for p in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py")]
                 if (rel := p.relative_to(ROOT)).parts[0] != "tests"
                 and not rel.parts[0].startswith(".")
                 and 'if __name__ == "__main__":' in p.read_text())

def pending(pid, signum) -> bool:
    """Whether signum waits to be delivered to pid (its own or its group's pending set)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return any(int(line.split()[1], 16) >> (signum - 1) & 1 for line in status.splitlines()
               if line.startswith(("SigPnd:", "ShdPnd:")))


def imports_a_package(pid, script="") -> bool:
    """Whether pid runs one of our scripts (ending in script) and has mapped a compiled file from
    outside the standard library (torch, numpy: seconds of a script's imports in real life)."""
    try:
        path = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1]  # exec'd, not a fork
        started = path.startswith(str(ROOT).encode()) and path.endswith(script.encode())
        maps = Path(f"/proc/{pid}/maps").read_text()
    except (OSError, IndexError):
        return False
    return started and any(f" {os.path.realpath(p)}/" in maps for p in PACKAGES)


def ctrl_c_in_a_terminal(argv, cwd, at=lambda pid: pid if imports_a_package(pid) else None,
                         env=None):
    """`python argv` started as a shell in a terminal starts it: in a pseudo-terminal, its own
    session and foreground group, no hook inside it. Once at(pid) names a process (the script or a
    child) in the state to test, that one is frozen (SIGSTOP, as Ctrl-Z) so the moment stays,
    Ctrl-C is typed (the tty driver signals the whole foreground group) and, once pending, the
    process goes on. Returns (exit status, the lines it printed but the echoed ^C)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: only exec
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, *map(str, argv)], env or os.environ)
    output, deadline = b"", time.monotonic() + 120  # a hang's bound: the wait ends on the state
    try:
        while (target := at(pid)) is None:
            assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0), \
                "the process ended before the moment"
            output += os.read(fd, 1 << 16) if select.select([fd], [], [], 0.005)[0] else b""
        os.kill(target, signal.SIGSTOP)
        while "State:\tT" not in Path(f"/proc/{target}/status").read_text():
            time.sleep(0.001)  # stopped: the Ctrl-C waits (a stopping one may take it first)
        os.write(fd, b"\x03")
        while not pending(target, signal.SIGINT):
            assert time.monotonic() < deadline, "Ctrl-C never reached the process"
            time.sleep(0.001)
        os.kill(target, signal.SIGCONT)
        while select.select([fd], [], [], 120)[0] and (chunk := os.read(fd, 1 << 16)):
            output += chunk
    except OSError:  # the terminal closed with the process: its output is all read
        pass
    except BaseException:  # a failed wait leaves nothing running
        os.killpg(pid, signal.SIGKILL)
        raise
    finally:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os.close(fd)
    text = output.decode(errors="replace").replace("\r", "").replace("^C", "")
    return code, [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_ctrl_c_while_a_script_imports_is_one_line_and_130(script, tmp_path):
    """In a terminal, while the script imports: with nothing of the suite's in the process."""
    assert ctrl_c_in_a_terminal([ROOT / script], tmp_path) == (130, ["interrupted"])


def test_ctrl_c_while_importing_is_said_by_rank_0_alone(tmp_path):
    env = {**os.environ, "RANK": "1"}
    assert ctrl_c_in_a_terminal([ROOT / "train.py"], tmp_path, env=env) == (130, [])


def test_ctrl_c_while_train_prepares_the_demo_data_is_one_line_and_130(tmp_path):
    """python train.py's first run prepares Shakespeare in a child process: Ctrl-C reaches it."""
    def child_importing(pid):
        kids = Path(f"/proc/{pid}/task/{pid}/children")
        found = [int(k) for k in kids.read_text().split()] if kids.exists() else []
        return next((k for k in found if imports_a_package(k, "prepare_data.py")), None)
    code, lines = ctrl_c_in_a_terminal([ROOT / "train.py", "--max_iters=1", "--eval_interval=0",
                                        "--sample_tokens=0"], tmp_path, child_importing)
    assert code == 130 and lines[-1] == "interrupted" and lines.count("interrupted") == 1, lines
    assert not (tmp_path / "data" / "shakespeare").exists()


def test_every_script_first_imports_the_quiet_ctrl_c():
    """configurator (interruptible) before anything slow to import: a new script without it fails
    here and above."""
    assert {"train.py", "lab/export.py", "course/grade.py"} <= set(SCRIPTS), SCRIPTS

    def first(path):
        imports = sorted((n for n in ast.walk(ast.parse(path.read_text()))
                          if isinstance(n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno)
        names = [name for n in imports for name in
                 ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or "."])]
        return next(n for n in names if n.partition(".")[0] not in sys.stdlib_module_names)
    late = {s: f for s in SCRIPTS if (f := first(ROOT / s)) != "configurator"}
    assert not late, f"scripts whose first import outside the standard library is not " \
                     f"configurator: {late}"


# prepare_data.py whose tokenizer tasks never end: each worker marks its pid in the folder given
# first, then waits, so a Ctrl-C sent once both have marked finds them inside a task.
STUCK_PREPARE = """
import os, signal, sys
sys.path.insert(0, ".")
import configurator, prepare_data
marks = sys.argv.pop(1)
def stuck(task):
    open(os.path.join(marks, str(os.getpid())), "w").close()
    signal.pause()  # Ctrl-C is ignored in a worker; the pool's terminate ends it
stuck.__module__, stuck.__qualname__ = "prepare_data", "_encode"  # pickled by that name
prepare_data._encode = stuck  # workers forked after this take it
sys.exit(configurator.run_main(prepare_data.main, sys.argv[1:]))
"""


def test_ctrl_c_while_preparing_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C reaches the whole process group: the tokenizer workers say nothing."""
    docs, marks, out = tmp_path / "docs", tmp_path / "marks", tmp_path / "d"
    docs.mkdir()
    marks.mkdir()
    for i in range(40):  # a train task and a val task: one for each worker
        (docs / f"doc{i}.txt").write_text("the cat sat on the mat. " * 50)
    proc = subprocess.Popen([sys.executable, "-c", STUCK_PREPARE, str(marks), "text", "--input",
                             str(docs), "--tokenizer=bytes", "--num_proc=2", f"--out_dir={out}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 300  # a hang's bound: the wait ends on the marks
    while len(list(marks.iterdir())) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers never began their tasks"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted"), err[-3000:]
    assert not (out / "text").exists() and not list(out.glob("text.tmp*"))
