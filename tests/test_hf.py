"""Hugging Face interop (hf.py): the authors' released layout, our exports, transformers, the
scripts' --init_from.

No network: every folder is written here, in the layout of the authors' released checkpoints (a
Llama config.json with their depth keys, Llama parameter names, their unused
lm_head_layernorm.weight), by code that does not use hf.py, so the loader is checked against the
published format rather than against itself.
"""
import copy
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from baselines import DEPTH_MODES
from conftest import tiny_model
import export
import sample
from support import hf, tokenizer
from support.hub import HFTokenizer
from support.checkpoint import CheckpointError, load_model
from helpers import ROOT, TINY_SHORT, eval_losses, make_tokenizer_json, train, write_authors_folder
from reference import reference_forward

def max_diff(a, b):
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- the authors' layout

def test_released_depth_attention_layout_gives_the_reference_with_k_norm_after_rope(tmp_path):
    source = tiny_model(dtype=torch.float64, depth_mode="value", depth_stride=2)
    folder = write_authors_folder(tmp_path, source)
    model = hf.from_pretrained(folder)
    c = model.config
    assert (c.depth_mode, c.depth_stride, c.k_norm_after_rope, c.norm_eps, c.tie_embeddings, c.qk_norm) == \
        ("value", 2, True, 1e-5, False, True)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    idx = torch.randint(0, c.vocab_size, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        # the order stated here, not read from c
        ref = reference_forward(model, idx, k_norm_after_rope=True)
        wrong = reference_forward(model, idx, k_norm_after_rope=False)
    assert max_diff(logits, ref) < 1e-10, \
        f"logits differ from the k_norm-after-RoPE reference by {max_diff(logits, ref):.3e}"
    assert max_diff(logits, wrong) > 1e-2, "the test cannot tell the two k_norm orders apart"


def test_released_vanilla_layout_keeps_qwen3_order(tmp_path):
    source = tiny_model(dtype=torch.float64, depth_mode="vanilla")
    model = hf.from_pretrained(write_authors_folder(tmp_path, source, depth=False))
    assert (model.config.depth_mode, model.config.k_norm_after_rope) == ("vanilla", False)
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        diff = max_diff(model(idx)[0], reference_forward(model, idx, k_norm_after_rope=False))
    assert diff < 1e-10, f"vanilla logits differ from the reference by {diff:.3e}"


def test_sharded_bf16_folder_loads_as_bf16(tmp_path):
    source = tiny_model(depth_mode="value", depth_stride=2)
    model = hf.from_pretrained(write_authors_folder(tmp_path, source, shards=3,
                                                    dtype=torch.bfloat16))
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for name, p in model.named_parameters():
        assert torch.equal(p, source.state_dict()[name].to(torch.bfloat16)), name
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        ref = reference_forward(copy.deepcopy(model).double(), idx, k_norm_after_rope=True)
    assert logits.dtype == torch.bfloat16
    assert max_diff(logits.double(),
                    ref) < 0.05 * ref.abs().max().item(), "bf16 logits far from the reference"
    f32 = hf.from_pretrained(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in f32.parameters()} == {torch.float32}


MEMORY_PROBE = """
import json, sys, torch
from support import hf
def anon_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1])
hf.from_pretrained(sys.argv[1])  # warm-up: the first meta-device build imports torch's meta kernels (~70 MB)
out = {}
for dtype in (None, torch.float32):  # None keeps bf16: views of the file; float32 converts: a real copy
    before = anon_kib()
    model = hf.from_pretrained(sys.argv[1], dtype=dtype)
    total = sum(float(p.detach().sum()) for p in model.parameters())  # touch every weight
    out[str(dtype)] = anon_kib() - before
    del model
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(),
                    reason="reads RssAnon from /proc (Linux)")
def test_loading_maps_the_file_instead_of_copying_it(tmp_path):
    """A 3B bf16 model must load in 24 GB: weights are views of the memory-mapped file, so loading
    them adds almost no anonymous memory; converting to float32 (the control) adds twice the
    file."""
    source = tiny_model(vocab_size=16384, n_embd=512, n_head=8, n_kv_head=4, head_dim=64,
                        mlp_hidden=1024, n_layer=2, init_std=0.02)
    write_authors_folder(tmp_path, source, dtype=torch.bfloat16)
    file_kib = (tmp_path / "model.safetensors").stat().st_size // 1024
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew = json.loads(proc.stdout)
    assert file_kib > 30_000
    assert grew["None"] < 0.1 * file_kib, \
        f"bf16 load added {grew['None']} KiB of anonymous memory ({file_kib} KiB file)"
    assert grew["torch.float32"] > 1.5 * file_kib, f"the control did not copy ({grew})"


@pytest.mark.parametrize("drop, extra, changes, fragment", [
    (["model.layers.1.self_attn.k_norm.weight"], None, {}, "missing tensor model.layers.1.self_attn.k_norm.weight"),
    ([], {"model.layers.0.self_attn.v_norm.weight": torch.ones(8)}, {},
     "unknown tensor model.layers.0.self_attn.v_norm.weight"),
    ([], None, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unknown architecture GPT2LMHeadModel"),
    ([], None, {"baseline_mode": "densenet"}, "not one of the paper's baselines"),
    ([], None, {"baseline_mode": "mhc", "use_depth_attention": False}, "missing tensors model.layers.0.attn_residual"),
    ([], None, {"hidden_act": "gelu"}, "'hidden_act': 'gelu'"),
    ([], None, {"intermediate_size": 48}, "config.json implies"),
    ([], None, {"num_hidden_layers": None}, "n_layer must be a positive integer"),
], ids=["missing", "unknown-tensor", "architecture", "baseline", "baseline-weights", "activation", "shape",
        "bad-config"])
def test_bad_folders_fail_with_a_clear_error(tmp_path, drop, extra, changes, fragment):
    folder = write_authors_folder(tmp_path, tiny_model(), drop=drop, extra=extra, **changes)
    with pytest.raises(CheckpointError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        hf.from_pretrained(folder)


@pytest.mark.parametrize("mode, residual", [("densetransformer", "denseformer"), ("attnres",
                                                                                  "attnres"),
                                            ("mhc", "mhc")])
def test_released_baseline_layout_builds_the_baseline(tmp_path, mode, residual):
    """AttnRes-3B, DenseFormer-3B, mHC-3B: baseline_mode (in the authors' spelling) and its knobs
    pick the model; their parameter names are ours under `model.`, with no reshaping."""
    knobs = {"denseformer": {"denseformer_dwa_period": 2}, "attnres": {"attnres_block_size": 2},
             "mhc": {"mhc_num_streams": 2, "mhc_sinkhorn_iters": 5}}[residual]
    source = tiny_model(depth_mode="vanilla", residual=residual, norm_eps=1e-5, depth_stride=None,
                        **knobs).eval()
    folder = write_authors_folder(tmp_path, source, depth=False, baseline_mode=mode,
                                  initializer_range=0.3, **knobs)
    model = hf.from_pretrained(folder).eval()
    assert type(model) is type(source) and asdict(model.config) == asdict(source.config)
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert max_diff(model(idx)[0], source(idx)[0]) == 0.0


# ----------------------------------------------------------------------------- our exports

ROUND_TRIPS = [dict(depth_mode=m) for m in DEPTH_MODES] + [
    dict(depth_mode="value", n_layer=2, n_loops=3, depth_stride=None),
    dict(depth_mode="kv", depth_stride=1, depth_recent_window=2, n_kv_head=1),
    dict(depth_mode="value", k_norm_after_rope=True, tie_embeddings=True),
    dict(depth_mode="vanilla", qk_norm=False, tie_embeddings=True),
] + [dict(depth_mode="vanilla", residual=r) for r in ("denseformer", "attnres", "mhc")]


@pytest.mark.parametrize("overrides", ROUND_TRIPS, ids=str)
def test_save_pretrained_round_trips(tmp_path, overrides):
    model = tiny_model(**overrides).eval()
    hf.save_pretrained(model, tmp_path, None)
    back = hf.from_pretrained(tmp_path).eval()
    assert asdict(back.config) == asdict(model.config)
    assert back.num_params() == model.num_params()  # a tied head is shared again, not duplicated
    idx = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        assert torch.equal(back(idx)[0], model(idx)[0])
        cache = back.new_cache(2, 11)
        parts = [back(idx[:, :6], cache=cache)[0]] + [back(idx[:, t:t + 1], cache=cache)[0]
                                                      for t in range(6, 11)]
    assert max_diff(torch.cat(parts, 1),
                    model(idx)[0]) < 1e-5, "cached decoding of the loaded model"


def test_bf16_export_round_trips(tmp_path):
    model = tiny_model(dtype=torch.bfloat16).eval()
    hf.save_pretrained(model, tmp_path, None)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = hf.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(back(idx)[0], model(idx)[0])


def test_depth_export_is_in_the_authors_layout(tmp_path):
    """Our architecture (transformers runs it with its code) keeps the authors' keys: without our
    own record they alone rebuild a model that uses their k_norm order, read as our folder or as
    theirs."""
    model = tiny_model(depth_mode="value", depth_stride=2, k_norm_after_rope=True, norm_eps=1e-5)
    hf.save_pretrained(model, tmp_path, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [hf.REMOTE_ARCH] and cfg["use_depth_attention"] is True
    assert (cfg["depth_attention_stride"], cfg["depth_attention_recent_window"]) == (2, 0)
    assert cfg["model_config"]["k_norm_after_rope"] is True and cfg["model_config"]["n_loops"] == 1
    del cfg["model_config"]
    assert asdict(hf.config_from_hf(cfg)) == asdict(model.config)
    authors = {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert asdict(hf.config_from_hf(authors)) == asdict(model.config)
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == {hf.hf_name(k) for k in model.state_dict()}
        assert "model.layers.3.self_attn.k_norm.weight" in f.keys() and "lm_head.weight" in f.keys()


@pytest.mark.parametrize("overrides, arch", [(dict(n_kv_head=2), "Qwen3ForCausalLM"),
                                             (dict(n_kv_head=1, tie_embeddings=True),
                                              "Qwen3ForCausalLM"), (dict(qk_norm=False),
                                                                    "LlamaForCausalLM")],
                         ids=["qwen3-gqa", "qwen3-mqa-tied", "llama-no-qk-norm"])
def test_transformers_loads_a_vanilla_export(tmp_path, overrides, arch):
    from transformers import AutoModelForCausalLM
    model = tiny_model(depth_mode="vanilla", rope_theta=500.0, block_size=64, **overrides).eval()
    hf.save_pretrained(model, tmp_path, None)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == arch
    idx = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        diff = max_diff(theirs(input_ids=idx).logits, model(idx)[0])
    assert diff < 1e-4, f"transformers' {arch} differs from our export by {diff:.3e}"


# ----------------------------------------------------------------------------- tokenizer and
# load_model

def test_tokenizer_json_behind_the_tiktoken_interface(tmp_path):
    make_tokenizer_json(tmp_path / "tokenizer.json")
    enc = tokenizer.load_tokenizer(tmp_path / "tokenizer.json")
    text = "the cat sat on the log, then ran. ÷ é"
    assert enc.decode(enc.encode(text)) == text and enc.eot_token == 0
    with pytest.raises(ValueError, match="special tokens"):
        enc.encode("a<|endoftext|>b")
    ids = enc.encode("a<|endoftext|>b", allowed_special="all")
    assert 0 in ids and enc.decode(ids) == "a<|endoftext|>b"
    plain = enc.encode_ordinary("a<|endoftext|>b")
    assert 0 not in plain and enc.decode(plain) == "a<|endoftext|>b"


@pytest.fixture
def released(tmp_path):
    """A tiny released-style Depth-Attention folder with a tokenizer.json, as the hub serves it."""
    folder = tmp_path / "Depth-attention-tiny"
    folder.mkdir()
    vocab = make_tokenizer_json(folder / "tokenizer.json")
    write_authors_folder(folder, tiny_model(vocab_size=vocab, block_size=64, depth_stride=2),
                         dtype=torch.bfloat16)
    return folder


def test_load_model_reads_a_folder_and_a_hub_id(released, monkeypatch):
    loaded = load_model(released)
    assert isinstance(loaded.tokenizer, HFTokenizer) and loaded.tokenizer.eot_token == 0
    assert not loaded.model.training and loaded.model.config.k_norm_after_rope
    calls = []
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub, "snapshot_download", lambda repo_id, **kw: calls.append(repo_id)
                        or str(released))
    assert tokenizer.looks_like_hub_id("zeng123/Depth-attention-3B")
    assert not tokenizer.looks_like_hub_id("tests/nothing")
    loaded = load_model("zeng123/Depth-attention-3B")
    assert calls == ["zeng123/Depth-attention-3B"] and loaded.model.config.depth_mode == "value"
    with pytest.raises(CheckpointError, match="no checkpoint at tests/nothing"):
        load_model("tests/nothing")  # a missing local path is not sent to the hub


def test_sample_runs_from_a_released_folder(released, capsys):
    sample.main([f"--init_from={released}", "--prompt=the cat", "--max_new_tokens=8",
                 "--num_samples=2", "--device=cpu"])
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and out.count("\nthe cat") == 2


# ----------------------------------------------------------------------------- the scripts, end to
# end

def test_export_then_init_from_continues_from_the_same_weights(data_root, tmp_path, monkeypatch, capsys):
    src, exported, tuned = tmp_path / "src", tmp_path / "src_hf", tmp_path / "tuned"
    assert train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}", f"--out_dir={src}",
                 "--max_iters=6", "--eval_interval=0") is None
    export.main([str(src), str(exported)])
    assert "DepthAttentionForCausalLM" in capsys.readouterr().out and (exported / "model.safetensors").is_file()
    assert json.loads((exported / "config.json").read_text())["tokenizer"] == "bytes"
    sample.main([f"--init_from={exported}", "--prompt=the cat", "--max_new_tokens=5"])
    assert "7 prompt + 5 new tokens" in capsys.readouterr().out
    # Fresh optimizer, same weights: the first evaluation equals the source run's last one.
    assert train(monkeypatch, "--dataset=tiny", f"--data_root={data_root}", f"--out_dir={tuned}",
                 f"--init_from={exported}", "--max_iters=2", "--eval_interval=1", "--eval_seqs=6",
                 "--sample_tokens=0", "--micro_batch=4", "--batch_tokens=128") is None
    assert eval_losses(tuned)[0] == pytest.approx(eval_losses(src)[6], abs=1e-6)
    # the model keys came from the weights
    assert json.loads((tuned / "config.json").read_text())["n_layer"] == 2
    error = train(monkeypatch, f"--data_root={data_root}", "--dataset=tiny",
                  f"--out_dir={tmp_path / 'x'}", f"--init_from={exported}", "--n_layer=5")
    assert "'n_layer': (2, 5)" in error and "drop them" in error


def test_init_from_refuses_data_with_another_tokenizer(data_root, released, tmp_path, monkeypatch):
    error = train(monkeypatch, f"--data_root={data_root}", "--dataset=tiny",
                  f"--out_dir={tmp_path / 'x'}", f"--init_from={released}")
    assert "prepare the data with the model's tokenizer" in error
