"""Exports that transformers runs exactly (hf.py's REMOTE_ARCH): a Depth-Attention, looped or
baseline folder carries our code (model.py, baselines.py, hf_remote/), so
AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) gives our logits, our greedy
tokens and our cached decoding, from any working directory and on a machine without this repository;
without trust_remote_code transformers refuses it (it used to load it as a Llama that skips the
depth step: wrong logits, with at most a notice). lm-eval's own `hf` backend scores such a folder as
eval.py does. transformers, lm-eval and accelerate are test-only dependencies
(requirements-dev.txt)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, Trainer,
                          TrainerCallback, TrainingArguments)

from conftest import tiny_model
import eval as eval_py
import export as export_py
from support import hf
from support.checkpoint import load_model
from support.tokenizer import get_tokenizer
from helpers import ROOT, make_tokenizer_json, write_authors_folder

SIZE = dict(vocab_size=256, block_size=64, n_layer=4, n_embd=64, n_head=4, n_kv_head=2, head_dim=16,
            mlp_hidden=128)
BASELINE = dict(depth_mode="vanilla", depth_stride=None)
MODES = {"value": dict(depth_mode="value", depth_stride=2), "kv-tied": dict(depth_mode="kv",
                                                                            depth_stride=1,
                                                                            depth_recent_window=1,
                                                                            tie_embeddings=True),
         "looped-value": dict(depth_mode="value", n_layer=2, n_loops=3, depth_stride=None),
         "denseformer": dict(residual="denseformer", denseformer_dwa_period=2, **BASELINE),
         "attnres": dict(residual="attnres", attnres_block_size=2, **BASELINE),
         "mhc": dict(residual="mhc", mhc_num_streams=2, mhc_sinkhorn_iters=5, **BASELINE),
         "keyless-value": dict(attention="keyless", depth_mode="value", depth_stride=1)}
TOL = 1e-5  # float32 on both sides, and the same code: any drift is a bug, not rounding


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small run several times faster on one thread than on threads that wait for each
    other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def max_diff(a, b):
    return (a - b).abs().max().item()


def export(tmp_path, name, tokenizer=None, **overrides):
    model = tiny_model(**{**SIZE, **overrides}).eval()
    folder = tmp_path / f"{name}_hf"
    hf.save_pretrained(model, folder, tokenizer)
    return model, folder


def load_elsewhere(folder, monkeypatch, tmp_path, **kwargs):
    """transformers' model for folder, loaded from another working directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.chdir(elsewhere)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


@pytest.mark.parametrize("mode", MODES)
def test_transformers_runs_the_export_exactly(tmp_path, monkeypatch, mode):
    ours, folder = export(tmp_path, mode, **MODES[mode])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    idx = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want, _ = ours(idx)
        got = theirs(input_ids=idx)
        diff = max_diff(got.logits, want)
        assert diff < TOL, f"{mode}: transformers' {type(theirs).__name__} differs from ours by {diff:.3e}"
        assert got.cache is None  # a plain call runs the cacheless forward
    assert type(theirs).__name__ == hf.REMOTE_ARCH and theirs.config.model_type == hf.REMOTE_MODEL_TYPE
    # a tied head is shared, not a second matrix
    assert theirs.num_parameters() == ours.num_params()
    with torch.no_grad():
        labels = idx.clone()
        # transformers' convention: labels are the inputs, -100 ignored, shifted inside
        labels[:, :5] = -100
        keep = labels[:, 1:] != -100
        ref = F.cross_entropy(want[:, :-1][keep], idx[:, 1:][keep])
        loss = theirs(input_ids=idx, labels=labels).loss
        assert abs(loss.item() - ref.item()) < TOL, (loss.item(), ref.item())

        # Cached decoding through transformers' interface: a prefill, then a token at a time, each
        # step continuing the cache the previous call returned; it must equal the full forward at
        # every position.
        out = theirs(input_ids=idx[:, :9], use_cache=True)
        parts, cache = [out.logits], out.cache
        for t in range(9, 24):
            out = theirs(input_ids=idx[:, t:t + 1], cache=cache)
            parts.append(out.logits)
        cached = max_diff(torch.cat(parts, 1), want)
        assert cached < 1e-5 * want.abs().max().item(), f"{mode}: cached decoding differs by {cached:.3e}"

    generated = theirs.generate(idx[:, :5], max_new_tokens=20, do_sample=False)
    assert torch.equal(generated, ours.generate(idx[:, :5], 20,
                                                temperature=0)), f"{mode}: greedy tokens differ"
    back = hf.from_pretrained(folder).eval()  # our own loader reads the folder as before
    with torch.no_grad():
        assert torch.equal(back(idx)[0], want)


def test_without_trust_remote_code_transformers_refuses(tmp_path, monkeypatch):
    _, folder = export(tmp_path, "value", **MODES["value"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [hf.REMOTE_ARCH] and cfg["model_type"] == "depth_attention"
    # A vanilla model stays a plain Qwen3 folder with no code to trust (tests/test_hf.py loads it in
    # transformers).
    _, plain = export(tmp_path, "vanilla", depth_mode="vanilla")
    cfg = json.loads((plain / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and "auto_map" not in cfg and not list(plain.glob("*.py"))
    # k_norm after RoPE (the authors' order) or a looped vanilla model is not what Qwen3 computes:
    # our code
    for overrides in (dict(k_norm_after_rope=True), dict(n_loops=2)):
        assert hf.hf_config(tiny_model(depth_mode="vanilla", **overrides).config, torch.float32)["architectures"] \
            == [hf.REMOTE_ARCH]


def test_the_folder_runs_our_code(tmp_path):
    """model.py, baselines.py and support/variants.py with only their imports of one another made
    relative, hf_remote/'s classes as they are."""
    _, folder = export(tmp_path, "mhc", **MODES["mhc"])
    for source in (ROOT / "model.py", ROOT / "baselines.py", ROOT / "support" / "variants.py"):
        ours, copied = source.read_text().splitlines(), (folder / source.name).read_text().splitlines()
        changed = [(a, b) for a, b in zip(ours, copied) if a != b]
        assert len(ours) == len(copied) and bool(changed) == (source.name != "model.py"), source.name
        for a, b in changed:
            assert a.lstrip().startswith(("from model import", "from baselines import")) \
                and b == a.replace("from ", "from .", 1), (source.name, a, b)
    codes = sorted((ROOT / "support" / "hf_remote").glob("*.py"))
    assert len(codes) == 2
    for code in codes:
        assert (folder / code.name).read_bytes() == code.read_bytes(), code.name
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert config.model_type == hf.REMOTE_MODEL_TYPE and config.model_config["residual"] == "mhc"


def test_two_folders_with_other_model_code_each_run_their_own(tmp_path):
    """Two exports of the same name whose model.py differ (two versions of this repository), loaded
    in one process: transformers registers a model class per config class, and each runs its own
    folder's code (the second used to run the first's model.py: logits off by a factor of 2 here,
    silently)."""
    ours, first = export(tmp_path / "a", "value", **MODES["value"])
    _, second = export(tmp_path / "b", "value", **MODES["value"])
    source = (second / "model.py").read_text()
    line = "        logits = self.lm_head(self.norm(x))"
    assert source.count(line) == 1
    (second / "model.py").write_text(source.replace(line, "        logits = 2 * self.lm_head(self.norm(x))"))
    idx = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        want = ours(idx)[0]
        for folder, scale in ((first, 1), (second, 2), (first, 1)):
            got = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()(input_ids=idx).logits
            assert max_diff(got, scale * want) < TOL, (folder, scale)


CLEAN_MACHINE = """
import importlib.util, sys, torch
from transformers import AutoModelForCausalLM
assert not any(importlib.util.find_spec(m) for m in ("support", "baselines", "model")), "the repository is importable"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
idx = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save({"logits": model(input_ids=idx).logits, "tokens": model.generate(idx[:, :7], max_new_tokens=12,
                do_sample=False)}, sys.argv[3])
"""


def test_the_folder_runs_without_this_repository(tmp_path):
    """Only torch and transformers: run from a folder that does not hold this repository, nor has it
    on sys.path."""
    ours, folder = export(tmp_path, "looped", **MODES["looped-value"])
    idx = torch.randint(0, 256, (2, 20))
    torch.save(idx, tmp_path / "idx.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CLEAN_MACHINE, str(folder), "idx.pt", "out.pt"],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        assert max_diff(got["logits"], ours(idx)[0]) < TOL
    assert torch.equal(got["tokens"], ours.generate(idx[:, :7], 12, temperature=0))


@pytest.mark.parametrize("baseline_mode", [None, "densetransformer"], ids=["Depth-attention-3B",
                                                                           "DenseFormer-3B"])
def test_export_of_the_authors_layout_runs_in_transformers(tmp_path, monkeypatch, baseline_mode):
    """A folder as the authors released it (Llama config.json with their keys, their names,
    tokenizer.json), through `export.py`, loads in transformers to what our loader reads from the
    original."""
    released = tmp_path / "released"
    released.mkdir()
    vocab = make_tokenizer_json(released / "tokenizer.json")
    depth = baseline_mode is None
    source = tiny_model(**{**SIZE, "vocab_size": vocab,
                           **(MODES["value"] if depth else MODES["denseformer"])})
    write_authors_folder(released, source, depth=depth,
                         **({} if depth else {"baseline_mode": baseline_mode,
                                              "denseformer_dwa_period": 2}))
    out = tmp_path / "exported"
    export_py.main([str(released), str(out)])
    theirs = load_elsewhere(out, monkeypatch, tmp_path)
    ours = hf.from_pretrained(released).eval()
    assert ours.config.k_norm_after_rope == depth  # the authors' order, recorded in the export
    idx = torch.randint(0, vocab, (2, 30))
    with torch.no_grad():
        diff = max_diff(theirs(input_ids=idx).logits, ours(idx)[0])
    assert diff < TOL, f"the exported released layout differs in transformers by {diff:.3e}"
    assert torch.equal(theirs.generate(idx[:, :6], max_new_tokens=10, do_sample=False,
                                       eos_token_id=None), ours.generate(idx[:, :6], 10,
                                                                         temperature=0))
    text = "the cat sat on the mat, then ran"
    assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False).input_ids == \
        load_model(released).tokenizer.encode(text)


def test_a_folder_transformers_saves_again_still_loads_everywhere(tmp_path, monkeypatch):
    """After model.save_pretrained (a fine-tune, a merged adapter, a push to the Hub): the code
    travels along and our loader reads it (transformers' config.json, its names)."""
    ours, folder = export(tmp_path, "attnres", **MODES["attnres"])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    theirs.save_pretrained(tmp_path / "again")
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want, _ = ours(idx)
        assert torch.equal(hf.from_pretrained(tmp_path / "again")(idx)[0], want)
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)
        assert max_diff(again(input_ids=idx).logits, want) < TOL


@pytest.mark.parametrize("mode", ["kv-tied", "keyless-value"])  # K and V, V alone
def test_what_the_cache_cannot_do_is_refused_and_beam_search_reorders_it(tmp_path, monkeypatch,
                                                                         mode):
    _, folder = export(tmp_path, "kv", **MODES[mode])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    idx = torch.randint(0, 256, (2, 6))
    gapped = torch.ones_like(idx)
    gapped[0, 2] = 0
    with pytest.raises(ValueError, match="one run of ones per row"):
        theirs(input_ids=idx, attention_mask=gapped)
    left_padded = torch.ones_like(idx)
    left_padded[0, :3] = 0
    with pytest.raises(NotImplementedError, match="unpadded batch"):  # beams would share a row
        theirs.generate(idx, attention_mask=left_padded, max_new_tokens=3, num_beams=2,
                        do_sample=False)
    with pytest.raises(ValueError, match="its own KV cache, not a DynamicCache"):
        theirs(input_ids=idx, cache=DynamicCache())
    ones = theirs.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=6,
                           do_sample=False)
    # what lm-eval passes
    assert torch.equal(ones, theirs.generate(idx, max_new_tokens=6, do_sample=False))
    # Beam search reorders the cache's rows after every step: equal to beam search that recomputes
    # everything.
    beams = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(theirs.generate(idx, **beams), theirs.generate(idx, use_cache=False,
                                                                      **beams))


def test_lm_eval_hf_backend_scores_as_eval_py(tmp_path, monkeypatch):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` against eval.py, on
    the local task of docs/eval_tasks (no download): the same accuracies and the same log-likelihood
    per choice."""
    tokenizer_json = tmp_path / "tokenizer.json"
    vocab = make_tokenizer_json(tokenizer_json)
    _, folder = export(tmp_path, "value_tok", get_tokenizer(str(tokenizer_json)), **MODES["value"],
                       init_std=0.05, vocab_size=vocab)
    # lm-eval alone reads the task's data_files from the current folder (eval.py from the YAML's)
    monkeypatch.chdir(ROOT / "docs" / "eval_tasks")
    task, limit = "shakespeare_last_word", 24
    eval_py.main([f"--init_from={folder}", f"--tasks={task}", "--include_path=.",
                  f"--limit={limit}", "--batch_size=8", "--device=cpu",
                  f"--json={tmp_path / 'eval.json'}"])
    ours = json.loads((tmp_path / "eval.json").read_text())["results"][task]
    theirs = lm_eval.simple_evaluate(model="hf",
                                     model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32",
                                     tasks=[task],
                                     task_manager=TaskManager(include_path=".",
                                                              include_defaults=False), limit=limit,
                                     batch_size=8, device="cpu", log_samples=True)
    assert (theirs["results"][task]["acc,none"], theirs["results"][task]["acc_norm,none"]) == \
        (ours["acc,none"], ours["acc_norm,none"])
    samples = theirs["samples"][task]
    pairs = [pair for s in samples for pair in s["arguments"]]
    loaded = load_model(folder)
    lm = eval_py.EvalLM(loaded.model, loaded.tokenizer, batch_size=8)
    mine = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i,
                             pair in enumerate(pairs)])
    hf_lls = [resp[0][0] for s in samples for resp in s["resps"]]
    diff = max(abs(a - b) for (a, _), b in zip(mine, hf_lls))
    assert len(mine) == len(hf_lls) == 4 * limit and diff < 1e-4, f"log-likelihoods differ by up to {diff:.3e}"


def test_trainer_with_gradient_accumulation_gets_the_mean_gradient(tmp_path, monkeypatch):
    """transformers' Trainer, two micro-batches per step: the gradient it steps on is the mean
    loss's, as a plain backward over both micro-batches gives (the model must not claim to scale its
    loss by num_items_in_batch, or Trainer stops dividing by the accumulation steps: gradients twice
    too large, silently)."""
    _, folder = export(tmp_path, "value", **MODES["value"])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    idx = torch.randint(0, 256, (4, 16))
    # equal lengths, nothing ignored: the mean of the two means
    theirs(input_ids=idx, labels=idx).loss.backward()
    want = {name: p.grad.clone() for name, p in theirs.named_parameters()}
    theirs.zero_grad()
    seen = {}

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.update((name, p.grad.clone()) for name, p in model.named_parameters())

    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, max_grad_norm=0,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)
    # a list is a Dataset: no `datasets` needed
    rows = [{"input_ids": row, "labels": row} for row in idx]
    Trainer(model=theirs, args=args, train_dataset=rows, callbacks=[Grads()]).train()
    assert seen.keys() == want.keys()
    for name, g in want.items():
        diff, ratio = max_diff(seen[name], g), (seen[name].norm() / g.norm()).item()
        assert diff <= 1e-5 * g.abs().max().item(), f"{name}: Trainer's gradient is {ratio:.3f} x the mean " \
            f"loss's (max difference {diff:.3e})"


def test_generate_allocates_the_cache_once_and_decode_steps_read_no_mask(tmp_path, monkeypatch):
    """The prefill allocates room ahead (as growth does), so the first new token does not copy the
    whole cache; a decode step does not read attention_mask (a read is a device-to-host sync on a
    GPU, every token)."""
    ours, folder = export(tmp_path, "value", **MODES["value"])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    calls, new_cache = [], theirs.gpt.new_cache

    def counted(*args, **kwargs):
        calls.append(args)
        return new_cache(*args, **kwargs)

    monkeypatch.setattr(theirs.gpt, "new_cache", counted)
    idx = torch.randint(0, 256, (2, 8))
    generated = theirs.generate(idx, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(generated, ours.generate(idx, 6, temperature=0))
    assert len(calls) == 1, f"the cache was allocated {len(calls)} times: {calls}"
    with torch.no_grad():
        out = theirs(input_ids=idx, attention_mask=torch.ones_like(idx), use_cache=True)
        # A mask on the meta device has no values: reading it (as .all() does) raises.
        meta_mask = torch.ones(2, 9, dtype=torch.long, device="meta")
        step = theirs(input_ids=generated[:, 8:9], attention_mask=meta_mask, cache=out.cache)
        want, _ = ours(generated[:, :9])
    assert max_diff(step.logits[:, -1], want[:, -1]) < TOL


def test_a_bf16_export_generates_in_transformers_as_ours(tmp_path, monkeypatch):
    """A folder saved in bf16 and loaded in bf16 (as docs/pretrained.md loads the released model):
    transformers' greedy tokens are ours, token for token."""
    _, folder = export(tmp_path, "value_bf16", dtype=torch.bfloat16, **MODES["value"])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path, dtype=torch.bfloat16)
    ours = hf.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert theirs.lm_head.weight.dtype == ours.lm_head.weight.dtype == torch.bfloat16
    idx = torch.randint(0, 256, (2, 7))
    got, want = theirs.generate(idx, max_new_tokens=16, do_sample=False, eos_token_id=None), \
        ours.generate(idx, 16, temperature=0)
    assert torch.equal(got, want), f"greedy tokens differ:\n{got}\n{want}"


def test_a_byte_level_export_runs_in_autotokenizer_and_pipeline(tmp_path, monkeypatch):
    """The quick start's model (the bytes tokenizer) had no tokenizer.json, so AutoTokenizer and
    pipeline() could not load it: the folder's tokenizer.json gives our ids for any text (id = the
    UTF-8 byte, 256 the end of text) and pipeline("text-generation") prints our greedy
    continuation."""
    from transformers import pipeline
    ours_tok = get_tokenizer("bytes")
    ours, folder = export(tmp_path, "bytes", ours_tok, vocab_size=257, **MODES["value"])
    monkeypatch.chdir(tmp_path)
    theirs_tok = AutoTokenizer.from_pretrained(folder)
    text = "  First Citizen:\n\tBefore we proceed — ça va? 你好 \x00\x7f\r\n" + "".join(map(chr,
                                                                                          range(32,
                                                                                                600,
                                                                                                7)))
    assert theirs_tok(text)["input_ids"] == ours_tok.encode(text)
    assert theirs_tok.decode(ours_tok.encode(text)) == text
    assert theirs_tok.eos_token_id == ours_tok.eot_token == 256 and theirs_tok.eos_token == "<|endoftext|>"
    # as train.py's documents are joined
    assert theirs_tok("a<|endoftext|>b")["input_ids"] == [97, 256, 98]
    prompt = "ROMEO: "
    want = ours.generate(torch.tensor([ours_tok.encode(prompt)]), 12, temperature=0)[0].tolist()
    generate = pipeline("text-generation", model=str(folder), tokenizer=str(folder),
                        trust_remote_code=True, device="cpu")
    got = generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                   return_full_text=True)
    assert got[0]["generated_text"] == theirs_tok.decode(want)
    assert got[0]["generated_text"] == ours_tok.decode(want)
    noise = torch.randint(0, 257, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    # invalid UTF-8 included, replaced alike
    assert theirs_tok.decode(noise) == ours_tok.decode(noise)


# ----------------------------------------------------------------------------- what transformers
# users pass (issue 39): hidden states, gradient checkpointing under Trainer, PEFT's defaults,
# lm-eval's batches

def test_hidden_states_are_qwen3s_for_vanilla_weights(tmp_path, monkeypatch):
    """output_hidden_states: the tuple transformers' Qwen3 returns for the same weights (the
    embeddings, each layer's output, the last after the final norm); a looped model gives one per
    effective layer; a baseline's (no single stream) is refused."""
    from dataclasses import asdict
    vanilla, qwen3_folder = export(tmp_path, "plain", **BASELINE)
    qwen3 = load_elsewhere(qwen3_folder, monkeypatch, tmp_path)
    assert type(qwen3).__name__ == "Qwen3ForCausalLM"
    remote = load_elsewhere(export(tmp_path, "value", **MODES["value"])[1], monkeypatch, tmp_path)
    ours = type(remote)(type(remote.config)(model_config=asdict(vanilla.config))).eval()
    ours.gpt.load_state_dict(vanilla.state_dict())
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = qwen3(input_ids=idx, output_hidden_states=True).hidden_states
        got = ours(input_ids=idx, output_hidden_states=True)
    assert len(got.hidden_states) == len(want) == SIZE["n_layer"] + 1
    for i, (a, b) in enumerate(zip(got.hidden_states, want)):
        assert max_diff(a, b) < 1e-4 * b.abs().max().item(), f"hidden state {i} differs"
    assert torch.equal(ours.lm_head(got.hidden_states[-1]), got.logits)
    assert ours(input_ids=idx).hidden_states is None  # only when asked
    looped = load_elsewhere(export(tmp_path, "looped", **MODES["looped-value"])[1], monkeypatch,
                            tmp_path)
    assert len(looped(input_ids=idx, output_hidden_states=True).hidden_states) == 2 * 3 + 1
    mhc = load_elsewhere(export(tmp_path, "mhc", **MODES["mhc"])[1], monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="plain residual stream"):
        mhc(input_ids=idx, output_hidden_states=True)


def trainer_run(model, tmp_path, rows, checkpointing):
    """Two Trainer steps on rows; returns the parameters after them."""
    args = TrainingArguments(output_dir=str(tmp_path / f"trainer{checkpointing}"),
                             per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, gradient_checkpointing=checkpointing, seed=0)
    Trainer(model=model, args=args, train_dataset=rows).train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["value", "attnres"])
def test_trainer_with_gradient_checkpointing_equals_without(mode, tmp_path, monkeypatch):
    """TrainingArguments(gradient_checkpointing=True) recomputes every block in the backward pass
    (counted) and trains to the same weights; the depth step's gradient to earlier layers survives
    (a reentrant checkpoint would drop it: their K and V reach a block in lists)."""
    _, folder = export(tmp_path, mode, **MODES[mode])
    idx = torch.randint(0, 256, (4, 16))
    rows = [{"input_ids": row, "labels": row} for row in idx]
    calls = []
    after = {}
    for checkpointing in (False, True):
        model = load_elsewhere(folder, monkeypatch, tmp_path)
        # a pre-hook: the recomputation stops once it has what backward needs (torch's early
        # stop), before the block's last module returns
        first = model.gpt.layers[0].input_layernorm
        first.register_forward_pre_hook(lambda *a: calls.append(checkpointing))
        after[checkpointing] = trainer_run(model, tmp_path, rows, checkpointing)
        assert model.is_gradient_checkpointing == checkpointing
    # two steps of one batch each: one forward each, and with checkpointing one recomputation
    assert calls.count(False) == 2 and calls.count(True) == 4, calls
    for name, p in after[False].items():
        assert max_diff(after[True][name], p) < 1e-6, name
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing and "forward" not in vars(model.gpt.layers[0])


def test_peft_lora_needs_no_target_modules(tmp_path, monkeypatch):
    """get_peft_model(model, LoraConfig(r=...)) on an export: LoRA on every layer's q_proj and
    v_proj (Qwen3's defaults), the base model's logits at init, and only LoRA trains."""
    peft = pytest.importorskip("peft")
    _, folder = export(tmp_path, "value", **MODES["value"])
    model = load_elsewhere(folder, monkeypatch, tmp_path)
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = model(input_ids=idx).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8))
    wrapped = {name.split(".")[-1] for name, m in lora.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)}
    count = sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in lora.modules())
    assert wrapped == {"q_proj", "v_proj"} and count == 2 * SIZE["n_layer"]
    with torch.no_grad():
        assert torch.equal(lora(input_ids=idx).logits, want)  # LoRA's B starts at zero
    lora(input_ids=idx, labels=idx).loss.backward()
    trained = {name for name, p in lora.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in name for name in trained)


def test_lm_eval_hf_backend_at_batch_size_4_equals_batch_size_1(tmp_path, monkeypatch):
    """lm-eval's hf backend pads a batch of requests of different lengths to one length: the
    log-likelihoods must not depend on the batch they were scored in."""
    tokenizer_json = tmp_path / "tokenizer.json"
    vocab = make_tokenizer_json(tokenizer_json)
    _, folder = export(tmp_path, "value_tok", get_tokenizer(str(tokenizer_json)), **MODES["value"],
                       init_std=0.05, vocab_size=vocab)
    monkeypatch.chdir(ROOT / "docs" / "eval_tasks")  # lm-eval reads the data_files from here
    task, scores = "shakespeare_last_word", {}
    for batch in (1, 4):
        out = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32",
            tasks=[task], task_manager=TaskManager(include_path=".",
                                                   include_defaults=False),
            limit=8, batch_size=batch, device="cpu", log_samples=True)
        scores[batch] = [resp[0][0] for s in out["samples"][task] for resp in s["resps"]]
    diff = max(abs(a - b) for a, b in zip(scores[1], scores[4]))
    assert len(scores[1]) == len(scores[4]) == 32 and diff < 1e-4, diff


def padded_batch(prompts, side, pad=7):
    """(input_ids, attention_mask, each row's slice of real tokens) of prompts padded on side."""
    T = max(len(q) for q in prompts)
    ids, mask = torch.full((len(prompts), T), pad), torch.zeros(len(prompts), T, dtype=torch.long)
    where = [slice(T - len(q), T) if side == "left" else slice(0, len(q)) for q in prompts]
    for b, (q, at) in enumerate(zip(prompts, where)):
        ids[b, at], mask[b, at] = q, 1
    return ids, mask, where


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["value", "looped-value"])
def test_a_padded_batch_gives_each_row_its_unpadded_run(mode, side, tmp_path, monkeypatch):
    """Three prompts of different lengths, padded: each row's logits and hidden states at its real
    tokens are those of the row alone (positions from the mask, no pad in the depth step or the
    attention), zeros at the pads, and the loss is the unpadded rows' token mean."""
    _, folder = export(tmp_path, mode, **MODES[mode])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    prompts = [torch.randint(0, 256, (n,)) for n in (5, 11, 8)]
    ids, mask, where = padded_batch(prompts, side)
    with torch.no_grad():
        out = theirs(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                     output_hidden_states=True)
        alone = [theirs(input_ids=q[None], labels=q[None], output_hidden_states=True)
                 for q in prompts]
    for b, (one, at) in enumerate(zip(alone, where)):
        scale = one.logits.abs().max().item()
        assert max_diff(out.logits[b, at], one.logits[0]) < 1e-5 * scale, f"row {b}"
        for h, h_one in zip(out.hidden_states, one.hidden_states):
            assert max_diff(h[b, at], h_one[0]) < 1e-5 * h_one.abs().max().item(), f"row {b}"
        assert not out.logits[b][mask[b] == 0].any()
    tokens = [len(q) - 1 for q in prompts]
    mean = sum(one.loss.item() * n for one, n in zip(alone, tokens)) / sum(tokens)
    assert abs(out.loss.item() - mean) < 1e-5, (out.loss.item(), mean)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["value", "kv-tied"])
def test_cached_generation_of_a_padded_batch_equals_each_row_alone(mode, side, tmp_path,
                                                                   monkeypatch):
    """Right padding too: a right-padded row's next token comes from its last real token, and
    continues the row's own cache (transformers' own classes read the pad's logits there)."""
    _, folder = export(tmp_path, mode, **MODES[mode])
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    prompts = [torch.randint(0, 256, (n,)) for n in (3, 7, 5)]
    ids, mask, _ = padded_batch(prompts, side)
    batch = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            pad_token_id=7)
    for b, q in enumerate(prompts):
        one = theirs.generate(q[None], max_new_tokens=6, do_sample=False, pad_token_id=7)
        assert torch.equal(batch[b, ids.shape[1]:], one[0, len(q):]), f"row {b}"


@pytest.mark.parametrize("mode", ["value", "vanilla"])
def test_an_exports_tokenizer_pads_batches_on_the_left_for_generate(mode, tmp_path, monkeypatch,
                                                                    caplog):
    """The exported tokenizer pads with end-of-text on the left, as Qwen3's: tok(batch,
    padding=True) then generate gives each row what it gives alone, for our architecture and for a
    vanilla export (transformers' own Qwen3 class). Right padding: ours stays exact (the test
    above); transformers' class is not, and transformers says so, as for any model."""
    overrides = MODES[mode] if mode != "vanilla" else {"depth_mode": "vanilla"}
    _, folder = export(tmp_path, mode, get_tokenizer("bytes"), **{**overrides, "vocab_size": 257,
                                                                 "init_std": 0.05})
    theirs = load_elsewhere(folder, monkeypatch, tmp_path)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert (tok.pad_token, tok.padding_side, tok.pad_token_id) == ("<|endoftext|>", "left", 256)
    prompts = ["To be", "or not to be, that", "is the q"]

    def generated(side):
        """(the batch, whether each row generates what it does alone), its forward checked."""
        tok.padding_side = side
        batch = tok(prompts, padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = theirs(**batch).logits
            for row, p, keep in zip(logits, prompts, batch.attention_mask.bool()):
                one = theirs(**tok([p], return_tensors="pt")).logits[0]
                assert max_diff(row[keep], one) < 1e-5 * one.abs().max().item(), (side, p)
        out = theirs.generate(**batch, max_new_tokens=6, do_sample=False)[:, -6:]
        alone = [theirs.generate(**tok([p], return_tensors="pt"), max_new_tokens=6,
                                 do_sample=False)[0, -6:] for p in prompts]
        return batch, [torch.equal(a, b) for a, b in zip(out, alone)]
    batch, same = generated("left")
    assert batch.input_ids[0, 0] == 256 and batch.attention_mask[0, 0] == 0 and all(same), same
    transformers.utils.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            _, same = generated("right")
    finally:
        transformers.utils.logging.disable_propagation()
    warned = "right-padding was detected" in caplog.text
    assert warned and (all(same) if mode == "value" else not all(same)), (warned, same)
