"""Hugging Face folders in (lab/hf.py), and train.py --init_from continuing their weights
(lab/continued.py).

No network: every folder is written here, in the layout of the authors' released checkpoints (a
Llama config.json with their depth keys, Llama names, their unused lm_head_layernorm.weight) by
tests/helpers.py, or as transformers saves a Qwen3, so the loader is checked against the published
formats rather than against itself. Exports (lab/export.py) are tests/test_export.py's.
"""
import contextlib
import io
import json
import shlex
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from checkpoint import load_model
from conftest import tiny_model
from configurator import CheckpointError, DataError
from data import load_meta, read_tokens
from helpers import (ENV, HIGH_ID, QWEN3_EOT, QWEN3_VOCAB, ROOT, TINY_SHORT, WORDS,
                     assert_one_error_line, cli, eval_losses, log_records, make_tokenizer_json,
                     max_diff, qwen3_tokenizer, read_log, train, write_authors_folder)
from lab.hf import HFTokenizer, from_pretrained, looks_like_hub_id
from reference import reference_forward

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the authors' layout

def test_the_authors_depth_attention_layout_is_the_reference_with_k_norm_after_rope(tmp_path):
    """Depth-attention-3B's layout (here in 3 shards) is read with k_norm after RoPE, the order
    its authors trained; a vanilla folder with Qwen3's, and config.json's own key overrides the
    guess. The reference states the order; the other order is far off."""
    source = tiny_model(dtype=torch.float64, depth_mode="value", depth_stride=2)
    model = from_pretrained(write_authors_folder(tmp_path / "da", source, shards=3))
    c = model.config
    assert (c.depth_mode, c.depth_stride, c.k_norm_after_rope, c.norm_eps, c.tie_embeddings,
            c.qk_norm) == ("value", 2, True, 1e-5, False, True)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    idx = torch.randint(0, c.vocab_size, (2, 9))
    with torch.no_grad():
        logits = model(idx)[0]
        assert max_diff(logits, reference_forward(model, idx, k_norm_after_rope=True)) < 1e-10
        assert max_diff(logits, reference_forward(model, idx, k_norm_after_rope=False)) > 1e-2
    vanilla = tiny_model(dtype=torch.float64, depth_mode="vanilla")
    for folder, k_norm_after_rope in [
            (write_authors_folder(tmp_path / "vanilla", vanilla, depth=False), False),
            (write_authors_folder(tmp_path / "said", source, k_norm_after_rope=False), False)]:
        model = from_pretrained(folder)
        assert model.config.k_norm_after_rope is k_norm_after_rope, folder
        with torch.no_grad():
            diff = max_diff(model(idx)[0], reference_forward(model, idx, k_norm_after_rope=False))
        assert diff < 1e-10, (folder, diff)


def test_the_authors_baseline_layouts_build_their_baselines(tmp_path):
    """AttnRes-3B, DenseFormer-3B, mHC-3B: baseline_mode (in any of the authors' spellings) and its
    knobs pick the model; their parameters are ours under `model.`, with no reshaping."""
    cases = {"densetransformer": ("denseformer", {"denseformer_dwa_period": 2}),
             "attnres": ("attnres", {"attnres_block_size": 2}),
             "mhc": ("mhc", {"mhc_num_streams": 2, "mhc_sinkhorn_iters": 5})}
    idx = torch.randint(0, 50, (2, 9))
    for spelling, (residual, knobs) in cases.items():
        source = tiny_model(depth_mode="vanilla", residual=residual, norm_eps=1e-5,
                            depth_stride=None, **knobs).eval()
        folder = write_authors_folder(tmp_path / spelling, source, depth=False,
                                      baseline_mode=spelling, initializer_range=0.3, **knobs)
        model = from_pretrained(folder).eval()
        assert type(model) is type(source) and asdict(model.config) == asdict(source.config)
        with torch.no_grad():
            assert torch.equal(model(idx)[0], source(idx)[0]), spelling


MEMORY_PROBE = """
import json, sys, torch
from lab.hf import from_pretrained
def anon_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1])
from_pretrained(sys.argv[1])  # the first meta-device build imports torch's meta kernels (~70 MB)
grew, dtypes = {}, {}
for dtype in (None, torch.float32):  # None keeps bf16, views of the file; float32 is a real copy
    before = anon_kib()
    model = from_pretrained(sys.argv[1], dtype=dtype)
    total = sum(float(p.detach().sum()) for p in model.parameters())  # touch every weight
    grew[str(dtype)], dtypes[str(dtype)] = anon_kib() - before, str(model.lm_head.weight.dtype)
    del model
print(json.dumps([grew, dtypes]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssAnon from /proc")
def test_loading_maps_the_file_instead_of_copying_it(tmp_path):
    """A 3B bf16 model must load in 24 GB: the weights stay bf16 views of the memory-mapped file,
    adding almost no anonymous memory; converting to float32 (the control) adds twice the file."""
    source = tiny_model(vocab_size=16384, n_embd=512, n_head=8, n_kv_head=4, head_dim=64,
                        mlp_hidden=1024, n_layer=2, init_std=0.02)
    write_authors_folder(tmp_path, source, dtype=torch.bfloat16)
    file_kib = (tmp_path / "model.safetensors").stat().st_size // 1024
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew, dtypes = json.loads(proc.stdout)
    assert file_kib > 30_000 and dtypes == {"None": "torch.bfloat16",
                                            "torch.float32": "torch.float32"}
    assert grew["None"] < 0.1 * file_kib, f"a bf16 load added {grew} KiB ({file_kib} KiB file)"
    assert grew["torch.float32"] > 1.5 * file_kib, f"the control did not copy ({grew})"


# ----------------------------------------------------------------------------- broken folders

def truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def edit_config(folder, change):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change(cfg)))


# (name, write_authors_folder's keywords, damage done after, the message's fragment)
BROKEN = [
    ("missing", dict(drop=["model.layers.1.self_attn.k_norm.weight"]), None,
     "missing tensor model.layers.1.self_attn.k_norm.weight"),
    ("unknown tensor", dict(extra={"model.layers.0.self_attn.v_norm.weight": torch.ones(8)}), None,
     "unknown tensor model.layers.0.self_attn.v_norm.weight"),
    ("architecture", dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), None,
     "unknown architecture GPT2LMHeadModel"),
    ("baseline", dict(baseline_mode="densenet"), None, "not one of the paper's baselines"),
    ("baseline weights", dict(baseline_mode="mhc", use_depth_attention=False), None,
     "missing tensors model.layers.0.attn_residual_connector"),
    ("activation", dict(hidden_act="gelu"), None, "'hidden_act': 'gelu'"),
    ("shape", dict(intermediate_size=48), None, "config.json implies"),
    ("bad value", dict(num_hidden_layers=None), None, "n_layer must be a positive integer"),
    ("wrong type", dict(rope_theta="high"), None, "a value of the wrong type"),
    ("no key", {}, lambda f: edit_config(f, lambda c: {k: v for k, v in c.items()
                                                       if k != "vocab_size"}),
     "lacks the key 'vocab_size'"),
    ("truncated tail", {}, lambda f: truncate(f / "model.safetensors", -100),
     "not a readable safetensors file"),
    ("truncated header", {}, lambda f: truncate(f / "model.safetensors", 50),
     "not a readable safetensors file"),
    ("config truncated", {}, lambda f: truncate(f / "config.json", -20), "not readable JSON"),
    ("config list", {}, lambda f: (f / "config.json").write_text("[1, 2]"), "holds a JSON list"),
    ("stale index", {}, lambda f: (f / "model.safetensors.index.json").write_text(
        '{"weight_map": {"x": "model-1.safetensors"}}'), "beside an index that lists other files"),
    ("index broken", dict(shards=2), lambda f: (f / "model.safetensors.index.json").write_text("{"),
     "index.json is not readable JSON"),
    ("shard missing", dict(shards=2), lambda f: (f / "model-00002-of-00002.safetensors").unlink(),
     "the download is incomplete"),
    ("tokenizer", {}, lambda f: (f / "tokenizer.json").write_text('{"not": "a tokenizer"}'),
     "not a readable tokenizer.json"),
]


def test_a_broken_folder_is_an_error_naming_what_is_wrong(tmp_path, monkeypatch):
    """Each way a folder can be wrong (the config, the tensors, the files) is a CheckpointError or
    DataError from load_model naming it: one `error:` line from sample.py and train.py
    --init_from (shown for a file and a tensor), never a traceback."""
    tokenizer_json = tmp_path / "tokenizer.json"
    make_tokenizer_json(tokenizer_json)
    for name, keywords, damage, fragment in BROKEN:
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "tokenizer.json").write_text(tokenizer_json.read_text())
        write_authors_folder(folder, tiny_model(vocab_size=300), **keywords)
        if damage:
            damage(folder)
        with pytest.raises((CheckpointError, DataError)) as e:
            load_model(folder)
        assert fragment in str(e.value), (name, str(e.value))
    for name, fragment in (BROKEN[0][0], BROKEN[0][-1]), (BROKEN[-2][0], BROKEN[-2][-1]):
        folder = tmp_path / name.replace(" ", "_")
        assert_one_error_line(*cli("sample.py", f"--init_from={folder}"), fragment)
        error = train(monkeypatch, f"--init_from={folder}", f"--out_dir={tmp_path / 'run'}")
        assert error.startswith("error:") and fragment in error, error


# ----------------------------------------------------------------------------- folders and hub ids

def test_load_model_and_sample_read_a_folder_and_a_hub_id(tmp_path, monkeypatch):
    """A released-style folder with its tokenizer.json (behind tiktoken's interface), and the same
    as a hub id (the download mocked); a missing local path is not sent to the hub."""
    folder = tmp_path / "Depth-attention-tiny"
    vocab = make_tokenizer_json(folder.mkdir() or folder / "tokenizer.json")
    write_authors_folder(folder, tiny_model(vocab_size=vocab, block_size=64), dtype=torch.bfloat16)
    loaded = load_model(folder)
    assert not loaded.model.training and loaded.model.config.k_norm_after_rope
    enc = loaded.tokenizer
    assert isinstance(enc, HFTokenizer) and enc.eot_token == 0  # config.json's eos_token_id
    text = "the cat sat on the log, then ran. ÷ é"
    assert enc.decode(enc.encode(text)) == text
    with pytest.raises(ValueError, match="special tokens"):
        enc.encode("a<|endoftext|>b")
    assert 0 in enc.encode("a<|endoftext|>b", allowed_special="all")
    plain = enc.encode_ordinary("a<|endoftext|>b")
    assert 0 not in plain and enc.decode(plain) == "a<|endoftext|>b"

    hub, calls = pytest.importorskip("huggingface_hub"), []
    monkeypatch.setattr(hub, "snapshot_download",
                        lambda repo_id, **kw: calls.append(repo_id) or str(folder))
    assert looks_like_hub_id("zeng123/Depth-attention-3B") and not looks_like_hub_id("tests/x")
    code, out, err = cli("sample.py", "--init_from=zeng123/Depth-attention-3B", "--prompt=the cat",
                         "--max_new_tokens=8", "--num_samples=2", "--device=cpu")
    assert code == 0 and out.count("--- sample") == 2 and out.count("\nthe cat") == 2, err
    assert calls and set(calls) == {"zeng123/Depth-attention-3B"}
    with pytest.raises(CheckpointError, match="no checkpoint at tests/nothing"):
        load_model("tests/nothing")


# ----------------------------------------------------------------------------- Qwen3

HUB_ID = "Qwen/Qwen3-0.6B-Base"
# Qwen3's own settings at a tiny width: 151,936 tokens, RoPE base 1e6, tied embeddings, q/k-norm
TINY_QWEN3 = dict(vocab_size=QWEN3_VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, bos_token_id=QWEN3_EOT, eos_token_id=QWEN3_EOT)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3 folder as transformers saves one, with a tokenizer.json of Qwen3's size, and a
    corpus of its words."""
    folder = tmp_path_factory.mktemp("Qwen3-tiny")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_QWEN3)).save_pretrained(folder)
    qwen3_tokenizer(folder / "tokenizer.json")
    corpus = folder.parent / "my_corpus"
    corpus.mkdir()
    rng = torch.Generator().manual_seed(0)
    for i in range(4):
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (400,), generator=rng)]
        (corpus / f"doc{i}.txt").write_text(" ".join(words) + " .")
    return folder, corpus


def test_a_qwen3_folder_computes_transformers_qwen3(qwen3, tmp_path):
    """vanilla is Qwen3: a folder transformers saved (Qwen3's vocabulary, MQA, tied; and MHA,
    untied) gives the logits of transformers' Qwen3ForCausalLM, an implementation written
    independently of ours; a wrong RoPE base in theirs is caught."""
    mha = tmp_path / "mha"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**TINY_QWEN3, "vocab_size": 64, "num_key_value_heads": 2,
           "tie_word_embeddings": False})).save_pretrained(mha)
    for folder in (qwen3[0], mha):
        ours = from_pretrained(folder).eval()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        c = ours.config
        assert (c.depth_mode, c.k_norm_after_rope, c.qk_norm, c.rope_theta) == \
            ("vanilla", False, True, 1e6)
        assert c.tie_embeddings == (folder != mha) and ours.num_params() == theirs.num_parameters()
        idx = torch.randint(0, 64, (2, 40))
        with torch.no_grad():
            mine = ours(idx)[0]
            assert max_diff(mine, theirs(input_ids=idx).logits) < 1e-4, folder
    theirs.model.rotary_emb.inv_freq.mul_(0.5)
    with torch.no_grad():
        assert max_diff(mine, theirs(input_ids=idx).logits) > 1e-2, "a wrong RoPE passes"


def docs_commands():
    """{script: argv} of docs/pretrained.md's commands that name HUB_ID, continuation lines
    joined."""
    text = (ROOT / "docs" / "pretrained.md").read_text().replace("\\\n", " ")
    return {words[1]: words[2:] for line in text.splitlines()
            if line.startswith("python ") and HUB_ID in line
            for words in [shlex.split(line, comments=True)]}


def test_the_docs_commands_continue_a_qwen3_as_depth_attention(qwen3, tmp_path, monkeypatch,
                                                               capsys):
    """docs/pretrained.md's commands, the folder for the hub id and a few settings to fit a tiny
    model: uint32 data beyond uint16's ids, the folder continued as value (its shape, vocabulary,
    RoPE base and tokenizer), a resume as exact as the whole run, a sample of its words."""
    folder, corpus = qwen3
    commands = {k: [a.replace(HUB_ID, str(folder)).replace("my_corpus", str(corpus)) for a in v]
                for k, v in docs_commands().items()}
    assert set(commands) == {"prepare_data.py", "train.py"}, commands
    data_root = tmp_path / "data"
    code, _, err = cli("prepare_data.py", *commands["prepare_data.py"], f"--out_dir={data_root}",
                       "--val_fraction=0.25", "--num_proc=1")
    assert code == 0, err
    meta = load_meta(data_root / "mine_qwen3")
    ids = read_tokens(data_root / "mine_qwen3", "train", meta)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == QWEN3_VOCAB
    assert int(ids.min()) >= HIGH_ID and int(ids.max()) == QWEN3_EOT  # beyond uint16, kept whole

    argv = [*commands["train.py"], f"--data_root={data_root}", "--block_size=32",
            "--batch_tokens=64", "--micro_batch=2", "--max_iters=2", "--eval_interval=1",
            "--eval_seqs=4", "--log_interval=1", "--sample_tokens=0"]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    capsys.readouterr()
    assert train(monkeypatch, *argv, f"--out_dir={whole}") is None
    printed = capsys.readouterr().out
    assert "depth_mode 'vanilla' -> 'value'" in printed and "block_size 64 -> 32" in printed
    assert train(monkeypatch, *argv, f"--out_dir={halves}", "--stop_at_step=1") is None
    assert train(monkeypatch, *argv, f"--out_dir={halves}", "--resume=True") is None
    assert read_log(whole) == read_log(halves)
    evals = [r for r in log_records(whole) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r.get("depth_weights") for r in evals)

    loaded = load_model(whole)
    c = loaded.model.config
    assert (c.depth_mode, c.vocab_size, c.rope_theta, c.n_embd, c.n_layer, c.qk_norm,
            c.tie_embeddings) == ("value", QWEN3_VOCAB, 1e6, 32, 2, True, True)
    assert loaded.tokenizer.text == (folder / "tokenizer.json").read_text()
    code, out, err = cli("sample.py", f"--init_from={whole}", "--prompt=the cat sat",
                         "--max_new_tokens=5", "--device=cpu")
    text = out.splitlines()[-1]
    assert code == 0 and text.startswith("the cat sat") and len(text.split()) == 3 + 5, out + err


# ------------------------------------------------------------------------ continued pretraining

def build(argv, data_root):
    """train.py's model for a command line over data_root/tiny, and what it printed."""
    import train as train_py
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg, _, init = train_py.resolve(argv)
        model = train_py.build(cfg, load_meta(data_root / "tiny"), data_root / "tiny", None, init)
    return model, cfg, out.getvalue()


def run_args(data_root, out_dir, *extra):
    """A short run over data_root/tiny that names no model key but those in extra."""
    return ["--dataset=tiny", f"--data_root={data_root}", f"--out_dir={out_dir}", "--max_iters=2",
            "--eval_interval=1", "--eval_seqs=6", "--log_interval=1", "--sample_tokens=0",
            "--micro_batch=4", "--batch_tokens=128", *extra]


@pytest.fixture(scope="module")
def vanilla_runs(data_root, tmp_path_factory):
    """Two vanilla train.py runs at peak 1e-2: one finished its 4 steps (its final rate, the
    cosine's floor, is 1e-3), one stopped at step 2 of 8; and the finished one's export."""
    root = tmp_path_factory.mktemp("vanilla")
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, steps in (("finished", ["--max_iters=4"]),
                            ("stopped", ["--max_iters=8", "--stop_at_step=2"])):
            assert train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}",
                         f"--out_dir={root / name}", *steps, "--eval_interval=0",
                         "--depth_mode=vanilla") is None
    code, out, err = cli("lab/export.py", root / "finished", root / "finished_hf")
    assert code == 0 and "Qwen3ForCausalLM" in out, err
    return root


def test_a_vanilla_model_continues_as_depth_attention_from_exactly_its_weights(
        vanilla_runs, data_root, tmp_path, monkeypatch):
    """Depth-Attention adds no parameter: --init_from a vanilla run or its Hugging Face export
    with --depth_mode value, uniform, key or kv builds exactly their weights, says so in one line,
    and computes another function; without --depth_mode the run continues the same model, whose
    first evaluation is the source's last."""
    run, folder = vanilla_runs / "finished", vanilla_runs / "finished_hf"
    vanilla = load_model(run).model
    idx = torch.randint(0, 257, (2, 16))
    for src in (run, folder):
        for mode in ("value", "uniform", "key", "kv"):
            model, _, printed = build(run_args(data_root, tmp_path / "x", f"--init_from={src}",
                                               f"--depth_mode={mode}"), data_root)
            assert (model.config.depth_mode, model.config.n_layer) == (mode, 2)
            switched = [line for line in printed.splitlines() if "switched" in line]
            assert len(switched) == 1 and f"depth_mode 'vanilla' -> '{mode}'; no parameter " \
                "added" in switched[0], printed
            theirs = vanilla.state_dict()
            assert all(torch.equal(theirs[k], v) for k, v in model.state_dict().items())
            with torch.no_grad():
                assert max_diff(model.eval()(idx)[0], vanilla(idx)[0]) > 1e-3, (src, mode)
    tuned = tmp_path / "tuned"
    assert train(monkeypatch, *run_args(data_root, tuned, f"--init_from={folder}")) is None
    assert eval_losses(tuned)[0] == pytest.approx(eval_losses(run)[4], abs=1e-6)
    assert json.loads((tuned / "config.json").read_text())["depth_mode"] == "vanilla"


def test_what_init_from_cannot_continue_is_one_error_line(vanilla_runs, qwen3, data_root,
                                                          tmp_path, monkeypatch):
    """A mode with parameters of its own (LIMe's routers), a baseline's or another shape, and data
    in another tokenizer than the weights'."""
    run = vanilla_runs / "finished"
    for extra, fragment in [
            ([f"--init_from={run}", "--depth_mode=lime"], "other parameters than the checkpoint"),
            ([f"--init_from={run}", "--n_layer=6"], "'n_layer': (2, 6)"),
            ([f"--init_from={run}", "--residual=denseformer"], "fixes the model"),
            ([f"--init_from={qwen3[0]}", "--block_size=32"],
             "prepare the data with the model's tokenizer")]:
        error = train(monkeypatch, *run_args(data_root, tmp_path / "x", *extra))
        assert error and error.startswith("error:") and fragment in error, (extra, error)


def test_continuing_a_finished_run_rewarms_to_its_final_rate(vanilla_runs, data_root, tmp_path):
    """--init_lr=last, the default, re-warms to the rate a finished run ended at (said in one
    line); --init_lr=peak or --learning_rate give another peak; a run stopped before its end, or
    a folder with no schedule, starts at learning_rate (the folder with a warning)."""
    finished, stopped = vanilla_runs / "finished", vanilla_runs / "stopped"
    notice = "finished its schedule: the rate re-warms to its final 0.001"
    for src, extra, peak, said in [(finished, [], 1e-3, notice),
                                   (finished, ["--init_lr=peak"], 3e-3, None),
                                   (finished, ["--learning_rate=5e-4"], 5e-4, None),
                                   (stopped, [], 3e-3, None),
                                   (vanilla_runs / "finished_hf", [], 3e-3, "no schedule")]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            _, cfg, printed = build(run_args(data_root, tmp_path / "x", f"--init_from={src}",
                                             "--depth_mode=value", *extra), data_root)
        assert cfg["learning_rate"] == pytest.approx(peak), (src.name, extra)
        assert ("re-warms" in printed + err.getvalue()) == (said == notice)
        assert said is None or said in printed + err.getvalue(), (src.name, printed)
