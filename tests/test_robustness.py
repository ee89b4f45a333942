"""Bad input and faults, as a user meets them. Every case ends in one of three ways: the work
continues correctly; one `error:` line that names the problem and the fix, with a non-zero exit; or
a warning that says exactly what changed. Never a traceback, a silent wrong result or lost work:
each failing case hashes the dataset and the checkpoints before and after.

The scripts run in this process exactly as `python script.py ARGS` runs them (runpy as __main__; a
SystemExit message is what the interpreter prints before exiting with 1, any other exception is what
it prints as a traceback), because a subprocess per case would spend a second or more on imports. A
few cases also run as real subprocesses to show the interpreter prints the same one line.
"""
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken.registry
import torch

from support.checkpoint import read_checkpoint
from helpers import ENV, ROOT, SINGLE, TINY  # the tiny model and batch of the end-to-end tests
from helpers import assert_one_error_line, cli, snapshot

SHORT = [*TINY, *SINGLE, "--max_iters=4", "--eval_interval=2", "--ckpt_interval=2", "--eval_seqs=2"]
# a fresh out_dir: only the case is wrong
TRAIN = [*SHORT, "--data_root={data_root}", "--out_dir={tmp}/new"]


@pytest.fixture(scope="module")
def world(data_root, tmp_path_factory):
    """A copy of the tiny dataset and one tiny finished run (4 steps, checkpoints at 2 and 4) to
    break copies of."""
    root = tmp_path_factory.mktemp("robust")
    shutil.copytree(data_root / "tiny", root / "data" / "tiny")
    code, out, err = cli("train.py", *SHORT, f"--data_root={root / 'data'}",
                         f"--out_dir={root / 'run'}")
    assert code == 0, err[-3000:]
    return {"root": root, "data_root": root / "data", "run": root / "run"}


def copy_run(w):
    shutil.copytree(w["run"], w["tmp"] / "run")
    return w["tmp"] / "run" / "ckpt.pt"


def copy_data(w):
    shutil.copytree(w["data_root"], w["tmp"] / "data")
    return w["tmp"] / "data" / "tiny"


def flip(path, entry):
    """XOR 4 KiB of the file's bytes inside the first tensor of the checkpoint's `entry` (model or
    optimizer)."""
    ckpt = torch.load(path, weights_only=True)
    first = next(iter(ckpt[entry].values())) if entry == "model" else ckpt[entry]["state"][0]["exp_avg"]
    data = bytearray(path.read_bytes())
    at = data.find(first.numpy().tobytes()[:64])
    assert at > 0 and first.numel() * 4 >= 4096
    data[at:at + 4096] = bytes(b ^ 0xFF for b in data[at:at + 4096])
    path.write_bytes(data)


def truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def offline(w, monkeypatch):
    """No gpt2 BPE files cached and no network: tiktoken's download meets a closed port."""
    # forget a gpt2 loaded earlier in this process
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(w["tmp"] / "tiktoken"))
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    (w["tmp"] / "a.txt").write_text("some text\n" * 50)


def bad_meta(w, meta):
    meta_path = copy_data(w) / "meta.json"
    meta_path.write_text(meta(json.loads(meta_path.read_text())))


def ids_beyond_vocab(w):
    train = copy_data(w) / "train.bin"
    # same size, so meta.json still agrees
    np.full(train.stat().st_size // 2, 300, dtype=np.uint16).tofile(train)


def write(name, data):
    return lambda w, mp: (w["tmp"] / name).write_bytes(data)


def case(script, fragment, *args, make=None, skip=False):
    return pytest.param(script, args, fragment, make, id=f"{script} {' '.join(args[-3:])}"[:90],
                        marks=pytest.mark.skipif(skip, reason="this machine has the device"))


CASES = [
    # train.py: never lose a run, never write a wrong one
    case("train.py", "already holds a checkpoint; continue it with --resume=True, or start over with --overwrite=True",
         *SHORT, "--data_root={data_root}", "--out_dir={run}"),
    case("train.py", "pass one of them", "--out_dir={run}", "--resume=True", "--overwrite=True"),
    case("train.py", "ckpt.pt is corrupt: its model no longer match", "--out_dir={tmp}/run",
         "--resume=True", make=lambda w, mp: flip(copy_run(w), "model")),
    case("train.py", "ckpt.pt is corrupt: its optimizer no longer match", "--out_dir={tmp}/run",
         "--resume=True", make=lambda w, mp: flip(copy_run(w), "optimizer")),
    case("train.py", "ckpt.pt is not a readable checkpoint", "--out_dir={tmp}/run", "--resume=True",
         make=lambda w, mp: truncate(copy_run(w))),
    case("train.py", "ckpt.pt is not a readable checkpoint", "--out_dir={tmp}/run", "--resume=True",
         make=lambda w, mp: copy_run(w).write_bytes(os.urandom(5000))),
    case("train.py", "holds a model but not a run to continue (no config, optimizer, step, best_val_loss, rng)",
         "--out_dir={tmp}", "--resume=True", make=lambda w, mp: torch.save(
             {k: v for k, v in torch.load(w["run"] / "ckpt.pt", weights_only=True).items()
              if k in ("model", "model_config")}, w["tmp"] / "ckpt.pt")),
    case("train.py", "file is a file; give a folder", *TRAIN, "--out_dir={tmp}/file",
         make=write("file", b"")),
    case("train.py", "which began from scratch; --init_from=", "--out_dir={tmp}/run", "--resume=True",
         "--init_from={run}", make=lambda w, mp: copy_run(w)),  # recorded as loaded, it never was

    case("train.py", "bad.py, line 1: SyntaxError", *TRAIN, "{tmp}/bad.py", make=write("bad.py", b"n_layer = = 3\n")),
    # optimizer ranges
    case("train.py", "--learning_rate must be a finite number > 0, got -1.0", *TRAIN,
         "--learning_rate=-1"),
    case("train.py", "--learning_rate must be a finite number > 0, got inf", *TRAIN,
         "--learning_rate=1e999"),
    case("train.py", "--beta1 must be a finite number in [0, 1), got 1.5", *TRAIN, "--beta1=1.5"),
    case("train.py", "--beta2 must be a finite number in [0, 1), got 1.0", *TRAIN, "--beta2=1"),
    case("train.py", "--adam_eps must be a finite number > 0, got 0.0", *TRAIN, "--adam_eps=0"),
    case("train.py", "--grad_clip must be a finite number >= 0, got -1.0", *TRAIN,
         "--grad_clip=-1"),
    case("train.py", "--weight_decay must be a finite number >= 0, got -1.0", *TRAIN,
         "--weight_decay=-1"),
    case("train.py", "--warmup_frac must be a finite number in [0, 1], got 2.0", *TRAIN,
         "--warmup_frac=2"),
    case("train.py", "--seed must be a finite number in [0, 2**63), got -1", *TRAIN, "--seed=-1"),
    # devices
    case("train.py", "unknown device 'foo'", *TRAIN, "--device=foo"),
    case("train.py", "torch sees no CUDA GPU", *TRAIN, "--device=cuda",
         skip=torch.cuda.is_available()),
    case("train.py", "mps is not available", *TRAIN, "--device=mps",
         skip=torch.backends.mps.is_available()),
    # data
    case("train.py", "meta.json is not a valid prepare_data.py output (JSONDecodeError", *TRAIN,
         "--data_root={tmp}/data", make=lambda w, mp: bad_meta(w, lambda m: "{not json")),
    case("train.py", "meta.json is not a valid prepare_data.py output (KeyError", *TRAIN,
         "--data_root={tmp}/data", make=lambda w, mp: bad_meta(w, lambda m: json.dumps({"tokens": m["tokens"]}))),
    case("train.py", "train.bin holds token id 300, beyond the model's vocab_size 257", *TRAIN,
         "--data_root={tmp}/data", make=lambda w, mp: ids_beyond_vocab(w)),
    case("train.py", "ids up to 299; set --vocab_size=300 or more", *TRAIN, "--data_root={tmp}/data",
         make=lambda w, mp: bad_meta(w, lambda m: json.dumps({**m, "max_token_id": 299}))),
    # sample.py
    case("sample.py", "--temperature must be a finite number >= 0, got -1.0", "--out_dir={run}",
         "--temperature=-1"),
    case("sample.py", "--temperature must be a finite number >= 0, got inf", "--out_dir={run}",
         "--temperature=inf"),
    case("sample.py", "--top_k must be a finite number >= 0, got -5", "--out_dir={run}",
         "--top_k=-5"),
    case("sample.py", "--num_samples must be a finite number >= 1, got 0", "--out_dir={run}",
         "--num_samples=0"),
    case("sample.py", "--max_new_tokens must be a finite number >= 0, got -5", "--out_dir={run}",
         "--max_new_tokens=-5"),
    case("sample.py", "nope.txt: No such file or directory", "--out_dir={run}",
         "--prompt_file={tmp}/nope.txt"),
    case("sample.py", "unknown device 'foo'", "--out_dir={run}", "--device=foo"),
    case("sample.py", "torch sees no CUDA GPU", "--out_dir={run}", "--device=cuda",
         skip=torch.cuda.is_available()),
    case("sample.py", "ckpt.pt is corrupt: its model no longer match", "--out_dir={tmp}/run",
         make=lambda w, mp: flip(copy_run(w), "model")),
    case("sample.py", "ckpt.pt is not a readable checkpoint", "--ckpt={tmp}/run/ckpt.pt",
         make=lambda w, mp: truncate(copy_run(w))),
    case("sample.py", "random.pt is not a readable checkpoint", "--ckpt={tmp}/random.pt",
         make=write("random.pt", os.urandom(4096))),
    case("sample.py", "no checkpoint at", "--out_dir={tmp}/absent"),
    # two models in one command: one was sampled and the other ignored without a word
    case("sample.py", "--ckpt={run}/ckpt.pt each name a model; give one of them",
         "--init_from={run}", "--ckpt={run}/ckpt.pt"),
    case("sample.py", "--init_from={run} and --out_dir={tmp}/absent each name a model",
         "--init_from={run}", "--out_dir={tmp}/absent"),
    case("sample.py", "--ckpt={run}/ckpt.pt and --out_dir={run} each name a model",
         "--out_dir={run}", "--ckpt={run}/ckpt.pt"),
    # prepare_data.py
    case("prepare_data.py", "or use --tokenizer=bytes", "text", "--input", "{tmp}/a.txt",
         "--out_dir={tmp}/out", make=offline),
    case("prepare_data.py", "no input files match", "text", "--input", "{tmp}/typo.txt", "--out_dir={tmp}/out",
         make=offline),  # the input is checked before the tokenizer is loaded
    case("prepare_data.py", "bad.txt is not UTF-8 (byte 0xe9 at offset 3)", "text", "--input", "{tmp}/good.txt",
         "{tmp}/bad.txt", "--name=tiny", "--out_dir={tmp}/data", "--tokenizer=bytes", "--num_proc=1", "--force",
         make=lambda w, mp: (copy_data(w), write("good.txt", b"fine\n" * 99)(w, mp),
                             # the --force rebuild fails: tiny is kept
                             write("bad.txt", b"caf\xe9\n")(w, mp))),
    case("prepare_data.py", "00.jsonl.zst (ZstdError", "pile", "--input", "{tmp}/00.jsonl.zst",
         "--tokenizer=bytes", "--out_dir={tmp}/out", make=write("00.jsonl.zst", b"not zstd")),
    case("prepare_data.py", "no input files match", "text", "--input", "{tmp}/empty",
         "--tokenizer=bytes", make=lambda w, mp: (w["tmp"] / "empty").mkdir()),
    case("prepare_data.py", "no text to prepare: the 2 input file(s) are empty", "text", "--input",
         "{tmp}/e1.txt", "{tmp}/e2.txt", "--tokenizer=bytes", make=lambda w, mp: (write("e1.txt",
                                                                                        b"")(w, mp),
                                                                                  write("e2.txt",
                                                                                        b"")(w,
                                                                                             mp))),
    case("prepare_data.py", "val_fraction must be in (0, 0.5], got 0.9", "text", "--input",
         "{tmp}/a.txt", "--val_fraction=0.9", make=write("a.txt", b"text")),
    case("prepare_data.py", "mine holds notes.txt and was not written by prepare_data.py", "text",
         "--input", "{tmp}/a.txt", "--name=mine", "--out_dir={tmp}", "--tokenizer=bytes",
         make=lambda w, mp: ((w["tmp"] / "mine").mkdir(), write("mine/notes.txt", b"mine")(w, mp),
                             write("a.txt", b"text")(w, mp))),
    case("prepare_data.py", "zeros.bin looks binary (4096 of its 4096 bytes are control characters",
         "text", "--input", "{tmp}/a.txt", "{tmp}/zeros.bin", "--tokenizer=bytes",
         "--out_dir={tmp}/out", make=lambda w, mp: (write("a.txt", b"text\n" * 9)(w, mp),
                                                    write("zeros.bin", bytes(4096))(w, mp))),
    *(case("prepare_data.py", "must be a folder name, not a path", "text", "--input", "{tmp}/a.txt",
           f"--name={name}", "--tokenizer=bytes", "--out_dir={tmp}/out", make=write("a.txt",
                                                                                    b"text"))
      for name in ("../x", "{tmp}/abs", "..", "a/b")),
    # nothing is written inside a sharded checkpoint, which the run's next save replaces whole
    *(case(script, "a sharded checkpoint that the run's next save replaces whole", *args)
      for script, *args in [("train.py", *TRAIN, "--out_dir={tmp}/r/ckpt.dcp"),
                            ("train.py", *TRAIN, "--out_dir={tmp}/r/ckpt.dcp.tmp/sub"),
                            ("prepare_data.py", "text", "--input", "{tmp}", "--out_dir={tmp}/r/ckpt.dcp"),
                            ("eval.py", "--init_from={run}", "--json={tmp}/r/ckpt.dcp/eval.json"),
                            ("bench_cache.py", "--json={tmp}/r/ckpt.dcp.old/bench.json"),
                            ("ablate.py", "--out={tmp}/r/ckpt.dcp/sweep")]),
    # bench_cache.py and ablate.py
    case("bench_cache.py", "--preset=foo is not a choice; choices: paper_3b, paper_1p5b",
         "--preset=foo"),
    case("bench_cache.py", "unknown mode 'foo'; choose from vanilla", "--modes=foo"),
    case("bench_cache.py", "unknown device 'foo'", "--device=foo"),
    # cuda = the current GPU
    case("bench_cache.py", "runs on cpu, cuda (or auto), not 'cuda:0'", "--device=cuda:0"),
    case("ablate.py", "--seeds must be a finite number >= 1, got 0", "--seeds=0"),
    case("ablate.py", "--jobs must be a finite number >= 1, got 0", "--jobs=0"),
    # train.py's arguments after --, read as train.py reads them (a bare --compile is True)
    case("ablate.py", "unknown config key 'max_iter'; did you mean --max_iters?",
         "--out={tmp}/sweep", "--", "--max_iter", "3"),
]


@pytest.mark.parametrize("script, args, fragment, make", CASES)
def test_bad_input_is_one_error_line_and_changes_nothing(world, tmp_path, monkeypatch, script, args,
                                                         fragment, make):
    w = {**world, "tmp": tmp_path}
    if make:
        make(w, monkeypatch)
    before = snapshot(world["root"], tmp_path)
    assert_one_error_line(*cli(script, *(a.format(**w) for a in args)), fragment.format(**w))
    after = snapshot(world["root"], tmp_path)
    assert {p: after.get(p) for p in before} == before  # every file that existed is as it was


@pytest.mark.parametrize("script, args, fragment", [
    ("train.py", ["--beta1=1.5"], "--beta1 must be a finite number in [0, 1), got 1.5"),
    ("sample.py", ["--out_dir={run}", "--temperature=-1"], "--temperature must be a finite number >= 0"),
    ("sample.py", ["--out_dir={tmp}/run"], "ckpt.pt is corrupt: its model no longer match"),
])
def test_the_interpreter_prints_the_same_one_line(world, tmp_path, script, args, fragment):
    flip(copy_run({**world, "tmp": tmp_path}), "model")
    proc = subprocess.run([sys.executable, script, *(a.format(**world, tmp=tmp_path)
                                                     for a in args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr[-2000:]
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, fragment)


# ----------------------------------------------------------------------------- the work continues
# correctly

def test_a_second_writer_is_refused_and_a_released_lock_blocks_nothing(world, tmp_path):
    copy_run({**world, "tmp": tmp_path})
    run = tmp_path / "run"
    with open(run / "train.lock", "a") as held:  # a live run holds the lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(run)
        assert_one_error_line(*cli("train.py", f"--out_dir={run}", "--resume=True"),
                              f"is writing to {run}")
        assert snapshot(run) == before
    # that run is gone: its lock with it
    code, out, err = cli("train.py", f"--out_dir={run}", "--resume=True")
    assert code == 0 and "done: step 4" in out, err[-2000:]


def test_resume_names_changed_keys_and_config_json_keeps_the_history(world, tmp_path):
    copy_run({**world, "tmp": tmp_path})
    run = tmp_path / "run"
    (run / "ckpt.pt.tmp12345").write_bytes(b"torn")  # a checkpoint write cut short by a kill
    code, out, err = cli("train.py", f"--out_dir={run}", "--resume=True", "--max_iters=6",
                         "--learning_rate=5e-3")
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert "warning: resuming at step 4 with changed settings: max_iters 4 -> 6, learning_rate 0.01 -> 0.005" in err
    config = json.loads((run / "config.json").read_text())
    assert config["max_iters"] == 6 and config["resumes"] == [
        {"step": 4, "changed": {"max_iters": [4, 6], "learning_rate": [0.01, 0.005]}}]
    assert read_checkpoint(run / "ckpt.pt")["step"] == 6 and not list(run.glob("ckpt.pt.tmp*"))
    # unchanged: no warning, one more entry
    code, _, err = cli("train.py", f"--out_dir={run}", "--resume=True")
    assert code == 0 and "warning" not in err
    assert json.loads((run / "config.json").read_text())["resumes"][-1] == {"step": 6,
                                                                            "changed": {}}


def test_overwrite_starts_over(world, tmp_path):
    copy_run({**world, "tmp": tmp_path})
    run = tmp_path / "run"
    code, _, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}", f"--out_dir={run}",
                       "--overwrite=True", "--max_iters=2")
    assert code == 0 and f"warning: --overwrite=True: deleting ckpt.pt and the log of {run}" in err, \
        err[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    # one run's log, not two
    assert steps == [0, 1, 2, 2] and read_checkpoint(run / "ckpt.pt")["step"] == 2


def test_divergence_stops_before_a_bad_checkpoint(world, tmp_path):
    out = tmp_path / "diverged"
    code, _, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}", f"--out_dir={out}",
                       "--learning_rate=1e6", "--ckpt_interval=1")
    assert_one_error_line(code, "", err, "training diverged at step 2 (train_loss")
    assert "its last checkpoint (step 1) is kept: lower --learning_rate" in err
    ckpt = read_checkpoint(out / "ckpt.pt")  # verified: intact, and finite
    assert ckpt["step"] == 1 and all(t.isfinite().all() for t in ckpt["model"].values())
    assert all(json.loads(line)["step"] <= 1
               for line in (out / "log.jsonl").read_text().splitlines())


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
    code, _, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}", f"--out_dir={out}")
    assert_one_error_line(code, "", err, "ckpt.pt at step 4: no space left on device; the checkpoint of step 2 is "
                                         "kept: free 1 MB, then --resume=True")
    monkeypatch.undo()
    assert read_checkpoint(out / "ckpt.pt")["step"] == 2 and not list(out.glob("ckpt.pt.tmp*"))


# Every writer with a file-size limit below its output: a write past it fails with EFBIG, as one on
# a full disk fails with ENOSPC. (the command after `python`, the limit in bytes, the output it must
# name and leave as it was; {corpus}: the text files of the tiny dataset.)
FULL_DISK = [
    (["train.py", *TRAIN], 20_000, "{tmp}/new/ckpt.pt"),  # the first checkpoint, after log lines
    (["prepare_data.py", "text", "--input", "{corpus}", "--tokenizer=bytes", "--name=tiny",
      "--out_dir={tmp}/data"], 2_000, "{tmp}/data/tiny"),
    (["eval.py", "--init_from={run}", "--tasks=", "--ppl=tiny", "--data_root={data_root}",
      "--json={tmp}/eval.json"], 50, "{tmp}/eval.json"),
    (["bench_cache.py", "--n_layer=2", "--n_embd=16", "--n_head=2", "--n_kv_head=1", "--head_dim=8",
      "--mlp_hidden=32", "--block_size=16", "--vocab_size=64", "--batch=1", "--prompt_len=4",
      "--new_tokens=2", "--warmup=0", "--repeats=1", "--device=cpu", "--modes=vanilla,value",
      "--json={tmp}/bench.json"], 50, "{tmp}/bench.json"),
    (["ablate.py", "--curves={run}", "--figure={tmp}/curves.png"], 1_000, "{tmp}/curves.png"),
    (["ablate.py", "--depth_weights={run}", "--figure={tmp}/weights.png"], 1_000,
     "{tmp}/weights.png"),
    (["export.py", "{run}", "{tmp}/hf"], 2_000, "{tmp}/hf"),
    # train.py's log.jsonl, appended a line a step: an earlier line is kept whole, no torn one added
    (["-c", "import sys; from pathlib import Path; from support.errors import run_main; "
      "from support.runlog import log; sys.exit(run_main(lambda argv: log(dict(step=1, "
      "note='x' * 4000), Path(argv[0]), None)))", "{tmp}"], 1_000, "{tmp}/log.jsonl"),
]


@pytest.mark.parametrize("argv, limit, output", FULL_DISK, ids=lambda v: str(v)[:40])
def test_a_full_disk_is_one_line_naming_the_path_and_the_space(world, data_root, tmp_path, argv,
                                                               limit, output):
    w = {**world, "tmp": tmp_path, "corpus": data_root / "doc*.txt"}
    output = Path(output.format(**w))
    if output.name == "log.jsonl":
        output.write_text('{"step": 0}\n')
    before = output.read_bytes() if output.exists() else None

    def limited():  # in the child, before it runs: SIGXFSZ would kill it rather than fail the write
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    proc = subprocess.run([sys.executable, *(a.format(**w) for a in argv)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, str(output))
    assert re.search(r": no space left on device; .*free (more than )?\d+ MB", proc.stderr)
    assert (output.read_bytes() if output.exists() else None) == before
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name], list(tmp_path.rglob("*"))


def test_a_checkpoint_without_checksums_loads_with_a_warning(world, tmp_path):
    ckpt = torch.load(world["run"] / "ckpt.pt", weights_only=True)
    del ckpt["checksums"]
    torch.save(ckpt, tmp_path / "old.pt")
    code, out, err = cli("sample.py", f"--ckpt={tmp_path / 'old.pt'}", "--max_new_tokens=0",
                         "--prompt=the")
    assert code == 0 and "has no checksums" in err and out.endswith("the\n"), err[-2000:]


def test_optimizer_damage_does_not_stop_sampling(world, tmp_path):
    """sample.py verifies what it reads: the model. Resume verifies everything (see the cases
    above)."""
    flip(copy_run({**world, "tmp": tmp_path}), "optimizer")
    code, out, err = cli("sample.py", f"--out_dir={tmp_path / 'run'}", "--max_new_tokens=3")
    assert code == 0 and "3 new tokens" in out, err[-2000:]


def test_single_text_file_is_split_inside(tmp_path):
    text = "".join(f"line {i} of the only file\n" for i in range(200))
    (tmp_path / "one.txt").write_text(text)
    code, out, err = cli("prepare_data.py", "text", "--input", tmp_path / "one.txt", "--out_dir",
                         tmp_path / "out", "--tokenizer=bytes", "--num_proc=1")
    assert code == 0, err[-2000:]
    data = tmp_path / "out" / "text"
    train, val = (np.fromfile(data / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    assert bytes(train[:-1].astype(np.uint8)) + bytes(val[:-1].astype(np.uint8)) == text.encode()
    assert train[-1] == val[-1] == 256 and abs(len(val) / (len(train) + len(val)) - 0.1) < 0.01
    meta = json.loads((data / "meta.json").read_text())
    assert meta["split"] == "one document: its last 0.1 of characters are val" and meta["max_token_id"] == 256


def test_non_utf8_is_replaced_on_request_with_a_count(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 and \xff\xfe\n" * 10)
    (tmp_path / "b.txt").write_text("plain\n" * 10)
    code, out, err = cli("prepare_data.py", "text", "--input", tmp_path / "a.txt",
                         tmp_path / "b.txt", "--out_dir", tmp_path / "out", "--tokenizer=bytes",
                         "--num_proc=1", "--decode_errors=replace")
    assert code == 0 and f"warning: {tmp_path / 'a.txt'} is not UTF-8: 30 invalid bytes read as U+FFFD" in err
    # a.txt is document 0: val
    val = np.fromfile(tmp_path / "out" / "text" / "val.bin", dtype=np.uint16)
    assert bytes(val[:-1].astype(np.uint8)).decode() == "caf\ufffd and \ufffd\ufffd\n" * 10


def test_temporaries_of_killed_runs_are_removed(world, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    data = copy_data({**world, "tmp": tmp_path})
    before = snapshot(data)
    (tmp_path / "data" / f"tiny.tmp{dead.pid}").mkdir()
    (tmp_path / "data" / f"tiny.tmp{dead.pid}" / "train.bin").write_bytes(b"\0" * 1000)
    # the older naming, inside the dataset
    (data / f"train.bin.tmp{dead.pid}").write_bytes(b"\0" * 1000)
    (tmp_path / "data" / f"tiny.tmp{os.getppid()}").mkdir()  # a live process's build is left alone
    # a swap killed between its two renames
    shutil.copytree(data, tmp_path / "data" / f"other.old{dead.pid}")
    for name in ("tiny", "other"):
        code, out, err = cli("prepare_data.py", "text", "--input", "unused", "--name", name,
                             "--out_dir", tmp_path / "data")
        assert code == 0 and "is already prepared" in out, err[-2000:]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(["tiny", "other", f"tiny.tmp{os.getppid()}"])
    assert snapshot(data) == before and snapshot(tmp_path / "data" / "other") == {
        tmp_path / "data" / "other" / p.name: h for p, h in before.items()}


def test_a_resume_keeps_the_weights_it_began_from(world, tmp_path):
    """--resume=True with another --init_from used to continue the checkpoint while config.json
    recorded the other weights; the same weights, however spelled, continue."""
    run, tune = world["run"], tmp_path / "tune"
    code, _, err = cli("train.py", *SHORT, f"--data_root={world['data_root']}", f"--out_dir={tune}",
                       f"--init_from={run}", "--max_iters=2")
    assert code == 0, err[-2000:]
    spelled = os.path.relpath(run, Path.cwd()) + "/"
    code, out, err = cli("train.py", f"--out_dir={tune}", "--resume=True", f"--init_from={spelled}",
                         "--max_iters=4")
    assert code == 0 and "done: step 4" in out, err[-2000:]
    assert json.loads((tune / "config.json").read_text())["init_from"] in (str(run), spelled)
    code, out, err = cli("train.py", f"--out_dir={tune}", "--resume=True", f"--init_from={tune}")
    assert_one_error_line(code, out, err,
                          f"which began from --init_from={spelled}; --init_from={tune}")


@pytest.mark.parametrize("args, warned", [(["--depth_mode=value", "--lime_router_lr_mult=2"],
                                           {"lime_router_lr_mult": "only depth_mode=lime"}),
                                          (["--depth_mode=vanilla", "--depth_stride=2",
                                            "--depth_recent_window=1"],
                                           {"depth_stride": "depth_mode=vanilla has no depth step",
                                            "depth_recent_window": "has no depth step"}),
                                          (["--qk_norm=False", "--k_norm_after_rope=True"],
                                           {"k_norm_after_rope": "--qk_norm=False has no k_norm"}),
                                          (["--depth_mode=vanilla", "--residual=attnres",
                                            "--mhc_num_streams=2", "--denseformer_dwa_period=2"],
                                           {"mhc_num_streams": "only --residual=mhc",
                                            "denseformer_dwa_period": "only --residual=denseformer"}),
                                          (["--depth_mode=lime", "--lime_router_lr_mult=2",
                                            "--depth_stride=1"], {}), (["--depth_mode=vanilla",
                                                                        "--residual=mhc",
                                                                        "--mhc_num_streams=2"], {}),
                                          ])
def test_a_key_the_model_ignores_is_named(world, tmp_path, args, warned):
    """--lime_router_lr_mult on a run that is not lime was taken without a word: each key the run's
    model has no use for is a warning naming it; a key the model reads is not."""
    code, out, err = cli("train.py", *SHORT, "--max_iters=1", f"--data_root={world['data_root']}",
                         f"--out_dir={tmp_path / 'run'}", *args)
    assert code == 0, err[-2000:]
    said = {line.split("=")[0].removeprefix("warning: --"): line for line in err.splitlines()
            if line.startswith("warning: --") and "does nothing in this run" in line}
    assert said.keys() == warned.keys(), err
    assert all(why in said[key] for key, why in warned.items())
