"""What several test files share: the repository's root, the tiny train.py command lines, the ways a
test runs a script (a subprocess, or train.py in this process) and reads what the run logged, and a
few fixtures and folders built the same way by more than one file.

Test files import from here (`from helpers import ROOT, TINY, run`), never from one another;
pytest puts tests/ on sys.path for the files in it, and conftest.py puts it there for
test_model.py. The naive reference is the other shared module, tests/reference.py. conftest.py
keeps the tiny models (tiny_config, tiny_model, tiny_variant) and data_root.
"""
import contextlib
import functools
import gc
import hashlib
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Two ranks share two cores; the same threads in every run.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# where this Python finds its packages: a venv's own and (made --system-site-packages) its base's
PACKAGES = [p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]
WORDS = "the a cat dog sat ran on under mat log and then".split()  # conftest.data_root's corpus

# ----------------------------------------------------------------------------- tiny train.py
# command lines

# The tiny model every end-to-end run trains, less its depth (each command line names its n_layer).
TINY_SHAPE = ["--n_head=2", "--n_kv_head=1", "--head_dim=8", "--n_embd=16", "--mlp_hidden=32",
              "--block_size=32"]
# The subprocess runs' yardstick (tests/test_train.py's reference run and those that must reproduce
# it): three layers, 16 steps with an evaluation and a checkpoint every 4; the batch is SINGLE or
# the caller's.
TINY = ["--dataset=tiny", "--n_layer=3", *TINY_SHAPE, "--learning_rate=1e-2", "--max_iters=16",
        "--eval_interval=4", "--eval_seqs=6", "--log_interval=4", "--ckpt_interval=4", "--sample_tokens=0"]
# 8 sequences per step: 2 micro-steps in one process
SINGLE = ["--micro_batch=4", "--batch_tokens=256"]
# The in-process runs (train() below): two layers and the batch; the caller sets the steps.
TINY_SHORT = ["--dataset=tiny", "--n_layer=2", *TINY_SHAPE, "--learning_rate=1e-2", "--eval_seqs=6",
              "--log_interval=4", "--sample_tokens=0", "--micro_batch=4", "--batch_tokens=128"]
# Two gloo ranks, launched through the interpreter (a `torchrun` on PATH may be another Python's).
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
# TINY sharded by FSDP over TORCHRUN's two ranks (tests/test_sharded.py, tests/test_live_run.py).
FSDP_RUN = [*TINY, "--micro_batch=2", "--batch_tokens=256", "--parallel=fsdp"]

# ----------------------------------------------------------------------------- running the scripts


def cli(script, *args):
    """(exit status, stdout, stderr) of `python script args`, run in this process."""
    argv, code, out, err = sys.argv, 0, io.StringIO(), io.StringIO()
    sys.argv, sigint = [str(ROOT / script), *map(str, args)], signal.getsignal(signal.SIGINT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # what the interpreter would print as a traceback
        traceback.print_exc(file=err)
        code = 1
    finally:  # a script's interruptible() leaves the suite's Ctrl-C as it found it
        sys.argv = argv
        signal.signal(signal.SIGINT, sigint)
        # a failed run's frames hold its out_dir lock; release it like a process exit would
        gc.collect()
    # sys.exit("error: ...") prints the message to stderr and exits with 1
    if isinstance(code, str):
        err.write(code + "\n")
        code = 1
    return code or 0, out.getvalue(), err.getvalue()


def assert_one_error_line(code, out, err, fragment):
    assert code != 0, f"exit status 0:\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and fragment in last, f"expected {fragment!r} in the last line:\n{err[-2000:]}"


def snapshot(*folders):
    """{file: sha256} under the folders, every file (train.lock too: no run writes it)."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for folder in folders
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def run(*args, launcher=(sys.executable,), check=True):
    """A script as a user runs it, in a subprocess from the repository root; with check, a failure
    is an AssertionError showing the end of its output."""
    proc = subprocess.run([*launcher, *map(str, args)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def train(monkeypatch, *args):
    """train.py as a user runs it (as __main__), in this process: a subprocess would spend most of
    its time importing torch. Returns the error line it printed when it exits, None on success."""
    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, args)])
    err, sigint = io.StringIO(), signal.getsignal(signal.SIGINT)
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as e:
        return err.getvalue().strip().splitlines()[-1] if e.code else None
    finally:  # as cli()
        signal.signal(signal.SIGINT, sigint)
    return None

def resumed_losses(monkeypatch, args, out_dir, stop):
    """{step: val_loss} of train.py stopped at step `stop`, then resumed to its end."""
    assert train(monkeypatch, *args, f"--out_dir={out_dir}", f"--stop_at_step={stop}") is None
    assert train(monkeypatch, f"--out_dir={out_dir}", "--resume") is None
    return eval_losses(out_dir)

# ----------------------------------------------------------------------------- what a run logged


def log_records(out_dir):
    """out_dir/log.jsonl, a record a line."""
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def read_log(out_dir):
    """{(kind, step): loss} from out_dir/log.jsonl, asserting each step was logged once."""
    records = log_records(out_dir)
    losses = {(r["kind"], r["step"]): r.get("train_loss", r.get("val_loss")) for r in records}
    assert len(losses) == len(records), "a step was logged twice"
    return losses


def eval_losses(out_dir):
    """{step: val_loss} of out_dir/log.jsonl's evaluations."""
    return {r["step"]: r["val_loss"] for r in log_records(out_dir) if r["kind"] == "eval"}


def max_diff(a, b):
    """The largest difference of two tensors, or of two read_log results (which must have logged
    the same steps)."""
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item()
    assert a.keys() == b.keys(), f"different steps logged: {sorted(a.keys() ^ b.keys())}"
    return max(abs(a[k] - b[k]) for k in a)

# ----------------------------------------------------------------------------- Hugging Face folders


def write_authors_folder(folder, model, *, depth=True, shards=1, dtype=None, drop=(), extra=None,
                         **changes):
    """model's weights in the published layout: the authors' config.json keys and Llama names (plus
    their unused lm_head_layernorm), one safetensors file or `shards` files with an index."""
    from safetensors.torch import save_file
    c = model.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
           "hidden_size": c.n_embd, "head_dim": c.head_dim, "intermediate_size": c.mlp_hidden,
           "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
           "num_key_value_heads": c.n_kv_head, "hidden_act": "silu",
           "max_position_embeddings": c.block_size, "initializer_range": 0.01, "rms_norm_eps": 1e-5,
           "pretraining_tp": 1, "use_cache": True, "pad_token_id": 1, "bos_token_id": 0,
           "eos_token_id": 0, "tie_word_embeddings": False, "rope_theta": c.rope_theta,
           "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
           "use_depth_attention": depth, "use_qk_norm": True, "scale_embeds": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.46.1"}
    if depth:
        cfg |= {"depth_attention_stride": c.depth_stride,
                "depth_attention_recent_window": c.depth_recent_window}
    cfg |= changes
    tensors = {("" if k.startswith("lm_head") else "model.") + k: v.detach().to(dtype or v.dtype).contiguous()
               for k, v in model.state_dict().items()}
    tensors["lm_head_layernorm.weight"] = torch.ones(c.n_embd, dtype=dtype or torch.float32)
    tensors |= extra or {}
    for name in drop:
        del tensors[name]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        names, weight_map = sorted(tensors), {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in names[i::shards]}, folder / file,
                      metadata={"format": "pt"})
            weight_map |= dict.fromkeys(names[i::shards], file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def word_tokenizer(path, size):
    """A tokenizer.json of `size` whole words, <|endoftext|> = 0: not the bytes tokenizer of the
    data."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


QWEN3_VOCAB, QWEN3_EOT = 151_936, 151_643  # Qwen3's vocab_size and its <|endoftext|> id
HIGH_ID = 100_000  # qwen3_tokenizer's first word: ids that no uint16 holds


def qwen3_tokenizer(path):
    """A tokenizer.json of Qwen3's size, 151,936 entries: WORDS and "." at ids from HIGH_ID on,
    <|endoftext|> at Qwen3's id (special), the rest filler; whole words, decoded with spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    named = {"[UNK]": 0, **{w: HIGH_ID + i for i, w in enumerate([*WORDS, "."])},
             "<|endoftext|>": QWEN3_EOT}
    taken = set(named.values())
    vocab = {**{f"w{i}": i for i in range(QWEN3_VOCAB) if i not in taken}, **named}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(path))
    return path


def make_tokenizer_json(path):
    """A byte-level BPE trained here on a few lines, with <|endoftext|> as id 0 like the GPT-NeoX
    tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran under the log",
                             "and then the cat ran"] * 20, trainer)
    tok.save(str(path))
    return tok.get_vocab_size()

# ------------------------------------------------------------------------ the contract's variants


def contract_variants(source_cases):
    """{variant: the config keys beyond conftest.tiny_config's} of every variant the contract holds
    (test_model.py) and tests/parallel_driver.py trains: each row of model.DEPTH_MODES, a
    looped model, value with each source rule of `source_cases` (reference.SOURCE_CASES, the
    registry a fork's rule joins), each baseline, each attention alone and with the value step."""
    from baselines import ATTENTIONS, BASELINES
    from model import DEPTH_MODES
    # LIMe reads every earlier layer, as published; AttnRes takes a snapshot at every layer, so
    # caching exercises its snapshots.
    # ResFormer reads layer 0 alone, its own default.
    shapes = {"lime": dict(depth_stride=None), "attnres": dict(attnres_block_size=2),
              "resformer": dict(depth_stride=None), "resformer_learned": dict(depth_stride=None)}
    variants = {**{mode: dict(depth_mode=mode) for mode in DEPTH_MODES},
                "looped": dict(depth_mode="value", n_layer=2, n_loops=2, depth_stride=None),
                **{f"value+{rule}": dict(depth_mode="value", **keys)
                   for rule, keys in source_cases.items()},
                **{name: dict(depth_mode="vanilla", residual=name) for name in BASELINES},
                **{f"{name}{plus}": dict(depth_mode=mode, attention=name)
                   for name in ATTENTIONS if name != "standard"
                   for plus, mode in (("", "vanilla"), ("+value", "value"))}}
    return {name: {**keys, **shapes.get(name, {})} for name, keys in variants.items()}


# ----------------------------------------------------------------------------- the course's grader
# course/ is imported inside these functions only, so that the rest of the suite runs without it.

def grade_cli(copy, *args, grader=ROOT, ok=True):
    """`python course/grade.py copy --json=...` of grader's tree: (printed, its JSON, the process);
    ok: it must exit 0. Never a traceback."""
    out = copy.parent / f"{copy.name}.grade.json"  # beside the copy, never in the repository
    proc = subprocess.run([sys.executable, str(grader / "course" / "grade.py"), str(copy),
                           f"--json={out}", *args], cwd=grader, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0 or not ok, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text()) if out.is_file() else None, proc


@contextlib.contextmanager
def grading_here():
    """Gradings in this process (grade_py.grade: a grader's start is most of a small grading),
    their hidden scenarios drawn once for all, as --seed would (the reference's outputs are the
    rest), leaving it as it was: the reference's extra row of DEPTH_MODES, torch's threads."""
    import model
    from course import grade as grade_py
    threads, reference = torch.get_num_threads(), grade_py.reference
    drawn = functools.cache(lambda: reference(0))  # every test's scenarios, seed 0
    grade_py.reference = lambda seed, names: drawn()
    try:
        yield
    finally:
        grade_py.reference = reference
        torch.set_num_threads(threads)
        for table in (model.DEPTH_MODES, model.DEFAULT_STRIDES):
            table.pop("own_stride", None)


def earned(result):
    return {e["problem"]: e["earned"] for e in result["problems"] if e["graded"]}


def reasons(result):  # every failing test's reason
    return [t["why"] for e in result["problems"] if e["graded"] for t in e["tests"] if t["why"]]


def failing(result):
    """{problem: the names of its failing tests} for the problems with one."""
    return {e["problem"]: {t["test"] for t in e["tests"] if t["why"] is not None}
            for e in result["problems"] if e["graded"] and e["earned"] < e["points"]}


def copy_repository(where):
    """The repository's files as they are, untracked ones too (an instructor's working tree)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (where / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, where / f)
    return where
