"""A run read while it trains, resumed onto other data, or stopped at the door (issue 36): a reader
takes one consistent snapshot of a live run (never a false "damaged", never weights of another
step), a lone ckpt.dcp.old is the checkpoint, resume is as strict as init, and the entry points
say one line."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support import checkpoint
from support.checkpoint import CheckpointError, load_model
from support.errors import ConfigError, run_main
from helpers import ENV, FSDP_RUN, ROOT, TINY, TORCHRUN

# The writer: train.py, with every save followed by a line "step digest" of the weights it saved
# (the full state dict, gathered under FSDP), so a reader's weights can be checked against the
# steps that were really written.
RECORDING = """
import os, sys
sys.path.insert(0, os.getcwd())
import torch.distributed as dist
import support.checkpoint as checkpoint
import train
record = sys.argv.pop(1)
save = train.save

def digest(model):
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    else:
        sd = model.state_dict()
    return checkpoint.checksums({"model": {k: sd[k] for k in sorted(sd)}})["model"]

def recording(run, lr):
    save(run, lr)
    d = digest(run.par.model)
    if run.proc.master:
        with open(record, "a") as f:
            f.write(f"{run.step} {d}\\n")

train.save = recording
sys.exit(train.run_main(train.interruptible, sys.argv[1:]))
"""


def weights_digest(model):
    sd = model.state_dict()
    return checkpoint.checksums({"model": {k: sd[k] for k in sorted(sd)}})["model"]


def hammer(out, writer, reads=100, steps=6):
    """load_model(out) `reads` times, and on till the reads saw `steps` steps, while writer trains
    into out (counted, not timed: on a loaded machine either side can fall behind): the count of
    "replaced while being read" answers, and every other outcome checked (no error, weights of the
    step they say)."""
    seen, retried = [], 0
    try:
        while len(seen) + retried < reads or len({s for s, _ in seen}) < steps:
            assert writer.poll() is None, f"the run stopped: {writer.stderr.read()[-2000:]}"
            if not any((out / n).exists() for n in ("ckpt.pt", checkpoint.SHARDED,
                                                      "ckpt.dcp.old")):
                time.sleep(0.05)
                continue
            try:
                loaded = load_model(out)
            except CheckpointError as e:
                assert "replaced while being read" in str(e), f"a false alarm on a live run: {e}"
                retried += 1
                continue
            seen.append((loaded.step, weights_digest(loaded.model)))
    finally:  # SIGTERM: the run saves, records and stops (torchrun passes it on to its ranks)
        writer.terminate()
        writer.wait(timeout=120)
    return seen, retried


def check_reads(out, record, seen, retried, reads=100):
    saved = {}
    for line in (out.parent / record).read_text().splitlines():
        step, d = line.split()
        saved[int(step)] = d
    assert len(seen) + retried >= reads, f"the run ended after {len(seen) + retried} reads"
    print(f"{len(seen)} reads of {len(set(s for s, _ in seen))} steps, {retried} asked to retry")
    wrong = [(s, d) for s, d in seen if saved.get(s) != d]
    assert not wrong, f"{len(wrong)} of {len(seen)} reads gave weights not saved at their step"
    # a read that spans a save is asked to retry: rare (a few in 100 on an idle machine, 14 with
    # two busy loops beside), never the usual answer
    assert retried <= len(seen), f"{retried} of {len(seen) + retried} reads were asked to try again"
    assert len({s for s, _ in seen}) > 5, "the reads did not overlap the run's saves"


def start_writer(tmp_path, data_root, *args, launcher=(sys.executable,)):
    script = tmp_path / "recording.py"
    script.write_text(RECORDING)
    out = tmp_path / "run"
    cmd = [*launcher, str(script), str(tmp_path / "saved.txt"), *TINY, f"--data_root={data_root}",
           f"--out_dir={out}", "--ckpt_interval=1", "--eval_interval=0", *args]
    return out, subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)


def test_reading_a_run_while_it_saves_every_step_never_misreads(data_root, tmp_path):
    """1 in 85 load_model calls on a live ckpt.pt said "damaged": torch.load(mmap=True) opened the
    file twice, with the run's rename between."""
    out, writer = start_writer(tmp_path, data_root, "--max_iters=100000", "--micro_batch=4",
                               "--batch_tokens=256")
    seen, retried = hammer(out, writer)
    check_reads(out, "saved.txt", seen, retried)


def test_reading_a_sharded_run_while_it_saves_every_step_never_misreads(data_root, tmp_path):
    """2 of 3 sample.py calls on an FSDP run checkpointing every step said "damaged": run.pt and the
    shards were read at two moments with the run's renames between."""
    out, writer = start_writer(tmp_path, data_root, *FSDP_RUN[len(TINY):], "--max_iters=100000",
                               launcher=TORCHRUN)
    seen, retried = hammer(out, writer)
    check_reads(out, "saved.txt", seen, retried)


def test_a_shard_gone_mid_read_is_a_replaced_folder_not_an_error(tmp_path):
    """Seen once under load: a shard renamed away between verify_shards' is_file and its stat escaped
    as FileNotFoundError. Replayed without timing: the first read's file goes as the run swaps
    the folder; the reader must read the new folder, not raise."""
    live = tmp_path / "ckpt.dcp"
    live.mkdir()
    calls = []

    def read(path):
        calls.append(path)
        if len(calls) == 1:  # the run replaces the folder while this read is inside it
            live.rename(tmp_path / "ckpt.dcp.old")
            live.mkdir()
            raise FileNotFoundError(path / "__0_0.distcp")
        return "the new step"

    assert checkpoint.read_snapshot(lambda: live, read) == "the new step"
    assert len(calls) == 2


def test_a_lone_old_checkpoint_is_the_checkpoint_for_readers_and_resume(data_root, tmp_path):
    """Killed between save_sharded's two renames: --resume said there was no checkpoint, a fresh
    run that there was one, and sample/export said "train one"."""
    out = tmp_path / "run"
    run = [sys.executable, "train.py", *TINY, *FSDP_RUN[len(TINY):], f"--data_root={data_root}",
           f"--out_dir={out}"]
    subprocess.run([*TORCHRUN, *run[1:], "--stop_at_step=4"], cwd=ROOT, env=ENV, check=True,
                   capture_output=True, timeout=300)
    # --init_from=RUN/ckpt.dcp/run.pt (tab completion) was a KeyError 'model': the folder is meant
    assert load_model(out / checkpoint.SHARDED / "run.pt").step == 4
    (out / checkpoint.SHARDED).rename(out / "ckpt.dcp.old")
    assert load_model(out).step == 4
    proc = subprocess.run([*TORCHRUN, *run[1:], "--resume=True"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_model(out).step == 16 and not (out / "ckpt.dcp.old").exists()


# ----------------------------------------------------------------------------- resume as strict as init

def train(*args):
    return subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)


def error_line(proc):
    """The one error line of a refused command (no traceback)."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def vanilla_run(data_root, tmp_path_factory):
    """A vanilla 3-layer run stopped at step 2 (TINY: n_layer=3; the defaults: 6, depth_mode=value)."""
    out = tmp_path_factory.mktemp("vanilla") / "run"
    proc = train(*TINY, f"--data_root={data_root}", f"--out_dir={out}", "--depth_mode=vanilla",
                 "--stop_at_step=2", "--micro_batch=4", "--batch_tokens=256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_run(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def test_resume_onto_data_of_another_tokenizer_is_refused(vanilla_run, data_root, tmp_path):
    """--resume=True --dataset=OTHER with a vocabulary the model holds trained on ids that mean other
    text, and rewrote the checkpoint's tokenizer record."""
    from support.prepare import prepare
    from helpers import word_tokenizer
    out = copy_run(vanilla_run, tmp_path)
    words = word_tokenizer(tmp_path / "tokenizer.json", 200)  # fewer ids than bytes' 257
    prepare("text", name="words", tokenizer=str(words), inputs=[str(data_root / "doc*.txt")],
            out_dir=tmp_path / "data", num_proc=1)
    before = (out / "ckpt.pt").read_bytes()
    line = error_line(train(f"--out_dir={out}", "--resume=True", "--dataset=words",
                            f"--data_root={tmp_path / 'data'}"))
    assert "tokenizer bytes" in line and str(words) in line and "--dataset" in line, line
    assert (out / "ckpt.pt").read_bytes() == before


def test_a_torn_last_log_line_is_dropped_on_resume(vanilla_run, tmp_path):
    """kill -9 mid-write left half a line in log.jsonl: every --resume was a JSONDecodeError."""
    out = copy_run(vanilla_run, tmp_path)
    with open(out / "log.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    proc = train(f"--out_dir={out}", "--resume=True")
    assert proc.returncode == 0 and "last line was cut short" in proc.stderr, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps[-1] == 16


@pytest.mark.parametrize("setting", ["--n_layer=6"])
def test_init_from_refuses_a_typed_setting_that_equals_the_default(setting, vanilla_run, data_root,
                                                                    tmp_path):
    """--n_layer=6 on a 3-layer run trained 3 layers: the clash check compared with the defaults,
    not with what was typed (--depth_mode=value on a vanilla run now switches: test_upcycle.py)."""
    line = error_line(train(f"--init_from={vanilla_run}", setting, "--dataset=tiny",
                            f"--data_root={data_root}", f"--out_dir={tmp_path / 'new'}"))
    key = setting[2:].split("=")[0]
    assert "fixes the model" in line and key in line, line


# ----------------------------------------------------------------------------- the entry-point guard

def test_ctrl_c_is_one_line_and_exit_130(capsys):
    def main(argv):
        raise KeyboardInterrupt("the last checkpoint is intact")
    code = run_main(main, [])
    err = capsys.readouterr().err
    assert code == 130 and err == "interrupted; the last checkpoint is intact\n", err


def test_a_user_error_exits_2(capsys):
    def main(argv):
        raise ConfigError("--x must be 1")
    code = run_main(main, [])
    assert code == 2 and capsys.readouterr().err == "error: --x must be 1\n"


def test_a_closed_pipe_is_silent(vanilla_run):
    """`python sample.py ... | head -1` ended in a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "sample.py", f"--init_from={vanilla_run}",
                             "--num_samples=3", "--max_new_tokens=8"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "BrokenPipe" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_a_seed_beyond_64_bits_is_refused_naming_the_flag(script, vanilla_run, tmp_path):
    """A traceback from torch's generator (train.py's after creating its lock file)."""
    where = [f"--out_dir={tmp_path / 'new'}"] if script == "train.py" else [
        f"--init_from={vanilla_run}"]
    proc = subprocess.run([sys.executable, script, *where, f"--seed={2**63}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    line = error_line(proc)
    assert proc.returncode == 2 and "--seed" in line and not (tmp_path / "new").exists(), line


def test_export_overwrite_replaces_only_an_earlier_export(vanilla_run, tmp_path):
    """export.py --overwrite deleted a folder of the user's own files, after the refusal itself
    suggested --overwrite."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "export.py", str(vanilla_run), str(mine), "--overwrite"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert "not written by export.py" in error_line(proc)
    assert (mine / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- messages that point the right way

@pytest.mark.parametrize("name", ["log.jsonl", "config.json"])
def test_a_log_or_config_given_as_a_checkpoint_is_not_called_damaged(name, vanilla_run):
    """--init_from=RUN/log.jsonl said "truncated or corrupt: retrain or restore it"."""
    proc = subprocess.run([sys.executable, "sample.py", f"--init_from={vanilla_run / name}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    line = error_line(proc)
    assert "is not a checkpoint; give a train.py out_dir" in line and "corrupt" not in line, line


def prepare(capsys, *args):
    """The one error line (exit 2) of `python prepare_data.py args`, run in this process."""
    import prepare_data
    capsys.readouterr()
    code = run_main(prepare_data.main, [str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and err[-1].startswith("error: "), err
    return err[-1]


def test_prepare_data_names_the_flag_before_loading_a_tokenizer(tmp_path, monkeypatch, capsys):
    """--out_dir=README.md and --num_proc=-1 failed on gpt2's download (offline), naming neither."""
    from support import prepare as preparation

    def loaded(*args):
        raise AssertionError("the tokenizer was loaded before the flags were checked")
    monkeypatch.setattr(preparation, "get_tokenizer", loaded)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("text\n" * 50)
    (tmp_path / "README.md").write_text("mine")
    line = prepare(capsys, "text", "--input", "a.txt", "--out_dir=README.md")
    assert "--out_dir=README.md is a file" in line, line
    assert (tmp_path / "README.md").read_text() == "mine"
    for flag in ("--num_proc=-1", "--num_proc=0", "--shards=0"):
        line = prepare(capsys, "text", "--input", "a.txt", flag, "--out_dir=d")
        assert line.startswith(f"error: {flag}") and not (tmp_path / "d").exists(), line


def test_random_bytes_are_binary_not_an_encoding_to_convert(tmp_path, capsys):
    """Random bytes were told to convert with iconv, and --decode_errors=replace then prepared
    noise."""
    rng = random.Random(0)
    (tmp_path / "noise.txt").write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    for extra in ([], ["--decode_errors=replace"]):
        line = prepare(capsys, "text", "--input", tmp_path / "noise.txt", "--tokenizer=bytes",
                       f"--out_dir={tmp_path / 'd'}", *extra)
        assert "looks binary" in line and "iconv" not in line, line
    latin1 = tmp_path / "latin1.txt"  # a real 8-bit text is still told to convert
    latin1.write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin1") * 50)
    line = prepare(capsys, "text", "--input", latin1, "--tokenizer=bytes",
                   f"--out_dir={tmp_path / 'd'}")
    assert "iconv" in line, line


def test_a_killed_exports_temporaries_are_removed_by_the_next_export(vanilla_run, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no process holds now
    left = [tmp_path / f".hf.tmp{dead.pid}", tmp_path / f".hf.old{dead.pid}"]
    for folder in left:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"part")
    proc = subprocess.run([sys.executable, "export.py", str(vanilla_run), str(tmp_path / "hf")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(f.exists() for f in left) and (tmp_path / "hf" / "config.json").is_file()


def test_export_help_keeps_its_whole_first_paragraph():
    text = subprocess.run([sys.executable, "export.py", "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60).stdout
    assert "the code transformers runs it with" in " ".join(text.split())


def test_resume_onto_data_with_more_ids_names_the_run_s_data(vanilla_run, data_root, tmp_path):
    """The hint said --vocab_size=N, which the next --resume refuses (a resumed run keeps its
    model)."""
    out = copy_run(vanilla_run, tmp_path)
    shutil.copytree(data_root / "tiny", tmp_path / "data" / "wide")
    meta = json.loads((tmp_path / "data" / "wide" / "meta.json").read_text())
    meta["max_token_id"] = 400  # the same tokenizer's record, with ids beyond the model's 257
    (tmp_path / "data" / "wide" / "meta.json").write_text(json.dumps(meta))
    line = error_line(train(f"--out_dir={out}", "--resume=True", "--dataset=wide",
                            f"--data_root={tmp_path / 'data'}"))
    assert "beyond the resumed run's vocab_size" in line and "--vocab_size" not in line, line


def test_eval_says_the_model_is_missing_before_loading_tasks(monkeypatch, tmp_path):
    """Offline, the default tasks spent minutes in download retries before a line that never said
    the model folder was missing."""
    import eval as eval_py
    from support.errors import CheckpointError

    def loaded_first(*args):
        raise AssertionError("the tasks were loaded before the model was found")
    monkeypatch.setattr(eval_py, "build_tasks", loaded_first)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        eval_py.main([f"--init_from={tmp_path / 'no_such_run'}"])


def test_depth_weights_of_an_export_names_the_run_it_needs(vanilla_run, tmp_path):
    subprocess.run([sys.executable, "export.py", str(vanilla_run), str(tmp_path / "hf")],
                   cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=120)
    proc = subprocess.run([sys.executable, "ablate.py", f"--depth_weights={tmp_path / 'hf'}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    line = error_line(proc)
    assert "is a Hugging Face folder" in line and "train one" not in line, line


# prepare_data.py whose tokenizer tasks never end: each worker marks its pid in the folder given
# first, then waits for the pool's end, so a Ctrl-C sent once every worker has marked finds them all
# inside a task (a sleep of a guessed length raced the work on a loaded machine).
STUCK_PREPARE = """
import os, runpy, signal, sys
sys.path.insert(0, ".")
import support.prepare as data
marks = sys.argv.pop(1)
def stuck(task):
    open(os.path.join(marks, str(os.getpid())), "w").close()
    signal.pause()  # Ctrl-C is ignored in a worker; the pool's terminate ends it
stuck.__module__, stuck.__qualname__ = "support.prepare", "_encode"  # pickled by that name
data._encode = stuck  # workers forked after this take it
sys.argv = ["prepare_data.py", *sys.argv[1:]]
runpy.run_path("prepare_data.py", run_name="__main__")
"""


def test_ctrl_c_while_preparing_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C reaches the whole process group: each tokenizer worker printed a traceback too."""
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
