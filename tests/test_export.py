"""Exports (lab/export.py): the command and save_pretrained, what a folder holds and how it is
replaced, and the folder in transformers with trust_remote_code: our code (model.py, baselines.py,
lab/hf_remote/) behind generate, padded batches, Trainer, PEFT and lm-eval's hf backend, with or
without this repository on sys.path. test_model.py's contract holds every variant's export to its
logits, in our loader and in transformers; this file tests what the contract does not.
transformers, peft, lm-eval and accelerate are test-only dependencies (requirements-dev.txt).
"""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from baselines import make_config
from checkpoint import load_model
from conftest import tiny_model
from configurator import CheckpointError
from helpers import (ENV, ROOT, assert_one_error_line, cli, make_tokenizer_json, max_diff,
                     write_authors_folder)
from lab.export import save_pretrained
from lab.hf import REMOTE_ARCH, config_from_hf, from_pretrained, shared_names
from outputs import MANIFEST, save_checkpoint, seal
from tokenizer import get_tokenizer, tokenizer_record

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

SIZE = dict(vocab_size=257, block_size=64, n_layer=4, n_embd=32, n_head=4, n_kv_head=2,
            head_dim=8, mlp_hidden=64)
BASELINE = dict(depth_mode="vanilla", depth_stride=None)
MODES = {"value": dict(depth_mode="value", depth_stride=2),
         "kv-tied": dict(depth_mode="kv", depth_stride=1, depth_recent_window=1,
                         tie_embeddings=True),
         "keyless": dict(attention="keyless", depth_mode="value", depth_stride=1),
         "looped": dict(depth_mode="value", n_layer=2, n_loops=3, depth_stride=None),
         "mhc": dict(residual="mhc", mhc_num_streams=2, mhc_sinkhorn_iters=5, **BASELINE),
         "vanilla": dict(depth_mode="vanilla")}
TOL = 1e-5  # float32 on both sides, and the same code: any drift is a bug, not rounding
BYTES = get_tokenizer("bytes")


def export(root, mode, tokenizer=None, dtype=torch.float32, **overrides):
    """(our model, its folder) for MODES[mode] at SIZE."""
    model = tiny_model(dtype=dtype, **{**SIZE, **MODES[mode], **overrides}).eval()
    save_pretrained(model, root / f"{mode}_hf", tokenizer)
    return model, root / f"{mode}_hf"


def load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{mode: (our model, its export with the bytes tokenizer, transformers' model)}, each loaded
    from another working directory than the repository."""
    root = tmp_path_factory.mktemp("exports")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(root)
        models = {}
        for mode in ("value", "kv-tied", "keyless", "vanilla"):
            model, folder = export(root, mode, BYTES)
            models[mode] = model, folder, load(folder)
        return models


# ----------------------------------------------------------------------------- the command

def test_the_command_exports_a_released_folder_that_transformers_runs_as_ours(tmp_path,
                                                                             monkeypatch):
    """`python lab/export.py SRC OUT --dtype=float32` on a folder in the authors' layout (bf16,
    k_norm after RoPE, their tokenizer.json): the folder transformers runs to what our loader reads
    from the original, AutoTokenizer giving our ids; save_pretrained writes the same files."""
    released = tmp_path / "released"
    vocab = make_tokenizer_json(released.mkdir() or released / "tokenizer.json")
    write_authors_folder(released, tiny_model(**{**SIZE, "vocab_size": vocab}, **MODES["value"]),
                         dtype=torch.bfloat16)
    out = tmp_path / "out"
    code, printed, err = cli("lab/export.py", released, out, "--dtype=float32")
    assert code == 0 and f"-> {out}" in printed and "trust_remote_code=True" in printed, err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST, "baselines.py", "config.json", "configuration_depth_attention.py", "model.py",
         "model.safetensors", "modeling_depth_attention.py", "tokenizer.json",
         "tokenizer_config.json"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and cfg["model_config"]["k_norm_after_rope"] is True
    monkeypatch.chdir(tmp_path)
    theirs = load(out)
    ours = from_pretrained(released, dtype=torch.float32).eval()
    idx = torch.randint(0, vocab, (2, 30))
    with torch.no_grad():
        assert max_diff(theirs(input_ids=idx).logits, ours(idx)[0]) < TOL
    text, tok = "the cat sat on the mat, then ran", AutoTokenizer.from_pretrained(out)
    assert tok(text).input_ids == load_model(released).tokenizer.encode(text)
    assert (tok.pad_token_id, tok.padding_side) == (0, "left")  # end-of-text, as Qwen3's

    loaded = load_model(released)
    save_pretrained(loaded.model.float(), tmp_path / "py", loaded.tokenizer)
    for name in sorted(p.name for p in out.iterdir()):
        assert (out / name).read_bytes() == (tmp_path / "py" / name).read_bytes(), name


@pytest.fixture
def run_dir(tmp_path):
    """A train.py checkpoint of a tiny value model with the bytes tokenizer."""
    model = tiny_model(vocab_size=257)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                     **tokenizer_record("bytes"), "step": 3}, run / "ckpt.pt")
    return run


def test_an_export_replaces_an_older_one_whole_or_not_at_all(run_dir, tmp_path, monkeypatch):
    """Only with --overwrite, only an export (shards its manifest does not list are named and
    kept), whole (no stale index survives, to be read before the new weights), never half (an
    interrupted export leaves the old folder), in the modes a plain copy gets under the umask;
    a tokenizer larger than the vocabulary writes nothing."""
    out = tmp_path / "out"
    save_pretrained(tiny_model(seed=7, vocab_size=257), out, None)
    from safetensors.torch import load_file, save_file
    state = load_file(out / "model.safetensors")
    names = sorted(state)
    for i, part in enumerate((names[:5], names[5:])):
        save_file({k: state[k] for k in part}, out / f"model-0000{i + 1}-of-00002.safetensors")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(names)}}))
    held = sorted(p.name for p in out.iterdir())
    assert_one_error_line(*cli("lab/export.py", run_dir, out), "already holds an export")
    assert_one_error_line(*cli("lab/export.py", run_dir, out, "--overwrite"),
                          "model.safetensors.index.json")
    assert sorted(p.name for p in out.iterdir()) == held  # refused: untouched
    seal(out, "export.py")  # as an export that wrote the shards would list them
    old = os.umask(0o077)
    try:
        assert cli("lab/export.py", run_dir, out, "--overwrite")[0] == 0
    finally:
        os.umask(old)
    assert "model.safetensors.index.json" not in os.listdir(out)
    new = load_model(run_dir).model.state_dict()
    assert all(torch.equal(new[k], v) for k, v in from_pretrained(out).state_dict().items())
    assert {(out / n).stat().st_mode & 0o777 for n in os.listdir(out)} == {0o600}
    assert out.stat().st_mode & 0o777 == 0o700

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import safetensors.torch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    code, _, err = cli("lab/export.py", run_dir, out, "--overwrite", "--dtype=bfloat16")
    assert code == 130 and {p.name: p.read_bytes() for p in out.iterdir()} == before, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temporary left
    with pytest.raises(CheckpointError, match="257 tokens, more than the model's vocab_size 50"):
        save_pretrained(tiny_model(vocab_size=50), tmp_path / "x", BYTES)
    assert not (tmp_path / "x").exists()


def test_a_runs_tokenizer_json_travels_with_its_checkpoint_and_export(tmp_path, monkeypatch):
    """A run whose data used a tokenizer.json named by a relative path keeps its contents: the
    run and its export sample the same after both are moved, the file deleted and the working
    directory changed, and the moved run exports the same tokenizer.json."""
    monkeypatch.chdir(tmp_path)
    vocab = make_tokenizer_json(tmp_path / "tokenizer.json")
    model = tiny_model(vocab_size=vocab)
    (tmp_path / "run").mkdir()
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                     **tokenizer_record("tokenizer.json"), "step": 3}, tmp_path / "run/ckpt.pt")

    def greedy(init_from):
        code, out, err = cli("sample.py", f"--init_from={init_from}", "--prompt=the cat",
                             "--max_new_tokens=6", "--temperature=0", "--device=cpu")
        assert code == 0, err
        return out.splitlines()[-1]
    expected = greedy("run")
    assert cli("lab/export.py", "run", "run_hf")[0] == 0
    assert (tmp_path / "run_hf/tokenizer.json").read_text() == \
        (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").unlink()
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move("run", moved / "run")
    shutil.move("run_hf", moved / "run_hf")
    monkeypatch.chdir(ROOT)
    assert greedy(moved / "run") == greedy(moved / "run_hf") == expected
    assert cli("lab/export.py", moved / "run", moved / "again")[0] == 0
    assert (moved / "again/tokenizer.json").read_text() == \
        (moved / "run_hf/tokenizer.json").read_text()


# ----------------------------------------------------------------------------- round trips

def test_save_pretrained_round_trips_every_setting(tmp_path):
    """Settings the contract's variants leave at their defaults (bf16, a recent window with MQA,
    tied embeddings, both k_norm orders, no q/k-norm, three loops) come back with the same config,
    the same tied head, the same logits and cached decoding. A vanilla model is a plain Qwen3 or
    Llama folder (no code) that transformers' own class runs to ours; anything Qwen3 does not
    compute is our architecture, whose authors' keys alone rebuild it."""
    cases = [(dict(dtype=torch.bfloat16), REMOTE_ARCH),
             (dict(depth_mode="kv", depth_stride=1, depth_recent_window=2, n_kv_head=1),
              REMOTE_ARCH),
             (dict(k_norm_after_rope=True, tie_embeddings=True), REMOTE_ARCH),
             (dict(depth_mode="value", n_layer=2, n_loops=3, depth_stride=None), REMOTE_ARCH),
             (dict(depth_mode="vanilla", k_norm_after_rope=True), REMOTE_ARCH),
             (dict(depth_mode="vanilla", n_loops=2), REMOTE_ARCH),
             (dict(depth_mode="vanilla", tie_embeddings=True), "Qwen3ForCausalLM"),
             (dict(depth_mode="vanilla", qk_norm=False, tie_embeddings=True), "LlamaForCausalLM")]
    idx = torch.randint(0, 50, (2, 11))
    for i, (overrides, arch) in enumerate(cases):
        model = tiny_model(**overrides).eval()
        folder = tmp_path / str(i)
        save_pretrained(model, folder, None)
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == [arch] and ("auto_map" in cfg) == (arch == REMOTE_ARCH)
        assert bool(list(folder.glob("*.py"))) == (arch == REMOTE_ARCH), overrides
        back = from_pretrained(folder).eval()
        assert asdict(back.config) == asdict(model.config), overrides
        assert shared_names(back) == shared_names(model) and back.num_params() == \
            model.num_params()
        with torch.no_grad():
            want = model(idx)[0]
            assert torch.equal(back(idx)[0], want), overrides
            cache = back.new_cache(2, 11)
            parts = [back(idx[:, :6], cache=cache)[0]] + [
                back(idx[:, t:t + 1], cache=cache)[0] for t in range(6, 11)]
            if "dtype" not in overrides:  # bf16 rounds the two ways apart
                assert max_diff(torch.cat(parts, 1), want) < TOL, overrides
        if (model.config.depth_mode, model.config.n_loops) == ("value", 1):  # the authors'
            # model: their keys, without our record, say all of it
            authors = {k: v for k, v in cfg.items() if k not in ("model_config", "auto_map")}
            authors |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
            assert asdict(make_config(**config_from_hf(authors))) == asdict(model.config)
        if arch != REMOTE_ARCH:
            theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
            assert type(theirs).__name__ == arch
            with torch.no_grad():
                assert max_diff(theirs(input_ids=idx).logits, want) < 1e-4, arch


# ----------------------------------------------------------------------------- transformers

def test_transformers_runs_only_the_folders_own_code(exported, tmp_path, monkeypatch):
    """Without trust_remote_code transformers refuses the folder (it once loaded it as a Llama that
    skips the depth step); with it, it runs the folder's copy of model.py and baselines.py (their
    imports of one another made relative) and lab/hf_remote/: two folders of one name whose
    model.py differ each run their own, in one process, and a folder transformers saves again
    still loads in both."""
    ours, folder, theirs = exported["value"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    for name in ("model.py", "baselines.py"):
        mine, copied = (ROOT / name).read_text().splitlines(), \
            (folder / name).read_text().splitlines()
        changed = [(a, b) for a, b in zip(mine, copied) if a != b]
        assert len(mine) == len(copied) and all(
            a.lstrip().startswith(("from model import", "from baselines import"))
            and b == a.replace("from ", "from .", 1) for a, b in changed), name
    for code in (ROOT / "lab" / "hf_remote").glob("*.py"):
        assert (folder / code.name).read_bytes() == code.read_bytes(), code.name
    assert AutoConfig.from_pretrained(folder, trust_remote_code=True).model_type == \
        "depth_attention"

    idx = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        want = ours(idx)[0]
    second = shutil.copytree(folder, tmp_path / "b" / folder.name)
    line = "        logits = self.lm_head(self.norm(x))"
    source = (second / "model.py").read_text()
    assert source.count(line) == 1
    (second / "model.py").write_text(source.replace(line, line.replace("=", "= 2 *")))
    theirs.save_pretrained(tmp_path / "again")
    with torch.no_grad():
        for path, scale in ((folder, 1), (second, 2), (folder, 1), (tmp_path / "again", 1)):
            assert max_diff(load(path)(input_ids=idx).logits, scale * want) < TOL, path
        assert torch.equal(from_pretrained(tmp_path / "again")(idx)[0], want)


def test_generate_runs_on_our_cache(exported):
    """The loss with labels (-100 ignored) is ours; cached decoding through transformers'
    interface equals the full forward; greedy generate is GPT.generate, with an all-ones mask
    too, its cache made with room for twice the prompt and doubled when full, a decode step
    reading no mask; beam search reorders the cache's rows (K and V, or V alone) as beam search
    without a cache; what the cache cannot do is refused."""
    from transformers import DynamicCache
    for mode in ("kv-tied", "keyless"):
        ours, _, theirs = exported[mode]
        idx = torch.randint(0, 257, (2, 24))
        with torch.no_grad():
            want = ours(idx)[0]
            labels = idx.clone()
            labels[:, :5] = -100
            keep = labels[:, 1:] != -100
            loss = F.cross_entropy(want[:, :-1][keep], idx[:, 1:][keep])
            assert abs(theirs(input_ids=idx, labels=labels).loss.item() - loss.item()) < TOL
            out = theirs(input_ids=idx[:, :9], use_cache=True)
            parts, cache = [out.logits], out.cache
            for t in range(9, 24):
                parts.append(theirs(input_ids=idx[:, t:t + 1], cache=cache).logits)
            assert max_diff(torch.cat(parts, 1), want) < TOL * want.abs().max().item(), mode
        calls, new_cache = [], theirs.gpt.new_cache
        theirs.gpt.new_cache = lambda *a, **k: calls.append(a) or new_cache(*a, **k)
        try:
            greedy = theirs.generate(idx[:, :5], max_new_tokens=12, do_sample=False,
                                     eos_token_id=None)
        finally:
            del theirs.gpt.new_cache
        assert torch.equal(greedy, ours.generate(idx[:, :5], 12, temperature=0)), mode
        assert calls == [(2, 10), (2, 20)], calls  # room for twice the prompt, then doubled
        assert torch.equal(greedy, theirs.generate(  # what lm-eval passes
            idx[:, :5], attention_mask=torch.ones_like(idx[:, :5]), max_new_tokens=12,
            do_sample=False, eos_token_id=None))
        beams = dict(max_new_tokens=8, num_beams=3, do_sample=False, eos_token_id=None)
        assert torch.equal(theirs.generate(idx[:, :6], **beams),
                           theirs.generate(idx[:, :6], use_cache=False, **beams)), mode
    with torch.no_grad():  # a mask on the meta device has no values: reading it raises
        out = theirs(input_ids=idx[:, :8], attention_mask=torch.ones_like(idx[:, :8]),
                     use_cache=True)
        step = theirs(input_ids=idx[:, 8:9], cache=out.cache,
                      attention_mask=torch.ones(2, 9, dtype=torch.long, device="meta"))
        assert max_diff(step.logits[:, -1], ours(idx[:, :9])[0][:, -1]) < TOL
    gapped, padded = torch.ones_like(idx[:, :6]), torch.ones_like(idx[:, :6])
    gapped[0, 2], padded[0, :3] = 0, 0
    with pytest.raises(ValueError, match="one run of ones per row"):
        theirs(input_ids=idx[:, :6], attention_mask=gapped)
    with pytest.raises(NotImplementedError, match="unpadded batch"):  # beams would share a row
        theirs.generate(idx[:, :6], attention_mask=padded, max_new_tokens=3, num_beams=2,
                        do_sample=False)
    with pytest.raises(ValueError, match="its own KV cache, not a DynamicCache"):
        theirs(input_ids=idx, cache=DynamicCache())


def padded_batch(prompts, side, pad=7):
    """(input_ids, attention_mask, each row's slice of real tokens) of prompts padded on side."""
    T = max(len(q) for q in prompts)
    ids, mask = torch.full((len(prompts), T), pad), torch.zeros(len(prompts), T, dtype=torch.long)
    where = [slice(T - len(q), T) if side == "left" else slice(0, len(q)) for q in prompts]
    for b, (q, at) in enumerate(zip(prompts, where)):
        ids[b, at], mask[b, at] = q, 1
    return ids, mask, where


def test_a_padded_batch_gives_each_row_what_it_gives_alone(exported):
    """Left or right padding: each row's logits and hidden states at its real tokens are the row's
    alone (positions from the mask; no pad in the attention or the depth step), zeros at the
    pads, the loss the rows' token mean, and cached generate each row's own tokens (a right-padded
    row continuing from its last real token)."""
    _, _, theirs = exported["value"]
    prompts = [torch.randint(0, 257, (n,)) for n in (5, 11, 8)]
    with torch.no_grad():
        alone = [theirs(input_ids=q[None], labels=q[None], output_hidden_states=True)
                 for q in prompts]
    tokens = [len(q) - 1 for q in prompts]
    mean = sum(one.loss.item() * n for one, n in zip(alone, tokens)) / sum(tokens)
    generated = [theirs.generate(q[None], max_new_tokens=6, do_sample=False, pad_token_id=7)
                 for q in prompts]
    for side in ("left", "right"):
        ids, mask, where = padded_batch(prompts, side)
        with torch.no_grad():
            out = theirs(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                         labels=ids.masked_fill(mask == 0, -100))
        for b, (one, at) in enumerate(zip(alone, where)):
            assert max_diff(out.logits[b, at], one.logits[0]) < TOL * 10, (side, b)
            for h, h_one in zip(out.hidden_states, one.hidden_states):
                assert max_diff(h[b, at], h_one[0]) < TOL * h_one.abs().max().item(), (side, b)
            assert not out.logits[b][mask[b] == 0].any()
        assert abs(out.loss.item() - mean) < TOL, side
        batch = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                pad_token_id=7)
        for b, (q, one) in enumerate(zip(prompts, generated)):
            assert torch.equal(batch[b, ids.shape[1]:], one[0, len(q):]), (side, b)


def test_the_exported_bytes_tokenizer_is_ours_and_pads_on_the_left(exported, tmp_path,
                                                                   monkeypatch):
    """A byte-level export's tokenizer.json gives our ids for any text and our text for any ids
    (invalid UTF-8 included); it pads with end-of-text on the left, so tok(batch, padding=True)
    then generate gives each row what it gives alone, in our architecture and in transformers'
    own Qwen3 class (a vanilla export), whose forward pass is exact with right padding too;
    pipeline("text-generation") prints our greedy text."""
    monkeypatch.chdir(tmp_path)
    ours, folder, _ = exported["value"]
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    text = "  First Citizen:\n\tBefore we proceed — ça va? 你好 \x00\x7f\r\n" + \
        "".join(map(chr, range(32, 600, 7)))
    assert tok(text).input_ids == BYTES.encode(text) and tok.decode(BYTES.encode(text)) == text
    noise = torch.randint(0, 257, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    assert tok.decode(noise) == BYTES.decode(noise)
    assert tok("a<|endoftext|>b").input_ids == [97, 256, 98]  # as train.py joins documents
    assert (tok.pad_token, tok.padding_side, tok.pad_token_id, tok.eos_token_id) == \
        ("<|endoftext|>", "left", 256, 256)
    prompts = ["To be", "or not to be, that", "is the q"]
    for mode in ("value", "vanilla"):
        theirs = exported[mode][2]
        for side in ("right", "left"):  # the forward pass is exact either way
            tok.padding_side = side
            batch = tok(prompts, padding=True, return_tensors="pt")
            with torch.no_grad():
                logits = theirs(**batch).logits
                for row, p, keep in zip(logits, prompts, batch.attention_mask.bool()):
                    one = theirs(**tok([p], return_tensors="pt")).logits[0]
                    assert max_diff(row[keep], one) < TOL * one.abs().max().item(), (mode, p)
        assert batch.input_ids[0, 0] == 256 and batch.attention_mask[0, 0] == 0
        out = theirs.generate(**batch, max_new_tokens=6, do_sample=False)[:, -6:]
        for row, p in zip(out, prompts):
            one = theirs.generate(**tok([p], return_tensors="pt"), max_new_tokens=6,
                                  do_sample=False)[0, -6:]
            assert torch.equal(row, one), (mode, p)
    want = ours.generate(torch.tensor([BYTES.encode("ROMEO: ")]), 12, temperature=0)[0]
    generate = transformers.pipeline("text-generation", model=str(folder), tokenizer=str(folder),
                                     trust_remote_code=True, device="cpu")
    got = generate("ROMEO: ", max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert got[0]["generated_text"] == BYTES.decode(want.tolist())


def test_hidden_states_are_qwen3s_for_vanilla_weights(exported):
    """output_hidden_states is the tuple transformers' Qwen3 returns for the same weights (the
    embeddings, each layer's output, the last after the final norm); a looped model gives one per
    effective layer; a baseline (no single residual stream) is refused."""
    vanilla, _, qwen3 = exported["vanilla"]
    remote = exported["value"][2]
    assert type(qwen3).__name__ == "Qwen3ForCausalLM"

    def ours(model):
        m = type(remote)(type(remote.config)(model_config=asdict(model.config))).eval()
        m.gpt.load_state_dict(model.state_dict())
        return m
    idx = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        want = qwen3(input_ids=idx, output_hidden_states=True).hidden_states
        got = ours(vanilla)(input_ids=idx, output_hidden_states=True)
        assert len(got.hidden_states) == len(want) == SIZE["n_layer"] + 1
        for i, (a, b) in enumerate(zip(got.hidden_states, want)):
            assert max_diff(a, b) < 1e-4 * b.abs().max().item(), f"hidden state {i}"
        assert remote(input_ids=idx).hidden_states is None  # only when asked
        looped = ours(tiny_model(**{**SIZE, **MODES["looped"]}))
        assert len(looped(input_ids=idx, output_hidden_states=True).hidden_states) == 2 * 3 + 1
        with pytest.raises(ValueError, match="plain residual stream"):
            ours(tiny_model(**{**SIZE, **MODES["mhc"]}))(input_ids=idx, output_hidden_states=True)


def test_trainer_with_gradient_checkpointing_and_accumulation_gets_the_mean_gradient(
        tmp_path, monkeypatch):
    """transformers' Trainer, gradient_checkpointing=True and two micro-batches a step: every block
    is recomputed in the backward pass (counted), and the gradient it steps on is a plain backward
    of the whole batch's mean loss without checkpointing: the depth step's gradient to earlier
    layers survives (a reentrant checkpoint drops it), and Trainer divides by the accumulation
    steps (the model must not claim to scale by num_items_in_batch)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    _, folder = export(tmp_path, "value")
    idx = torch.randint(0, 257, (4, 16))
    model = load(folder)
    model(input_ids=idx, labels=idx).loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    calls, seen = [], {}
    # a pre-hook: the recomputation stops once it has what backward needs, before the block ends
    model.gpt.layers[0].input_layernorm.register_forward_pre_hook(lambda *a: calls.append(1))

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.update((name, p.grad.clone()) for name, p in model.named_parameters())
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, max_grad_norm=0,
                             report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True,
                             gradient_checkpointing=True)
    rows = [{"input_ids": row, "labels": row} for row in idx]  # a list is a Dataset
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[Grads()]).train()
    assert model.is_gradient_checkpointing and len(calls) == 4, calls  # 2 forwards, 2 recomputed
    assert seen.keys() == want.keys()
    for name, g in want.items():
        assert max_diff(seen[name], g) <= 1e-5 * g.abs().max().item(), \
            f"{name}: Trainer's gradient is {(seen[name].norm() / g.norm()).item():.3f} x the " \
            f"mean loss's"
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing and "forward" not in vars(model.gpt.layers[0])


def test_peft_lora_needs_no_target_modules(tmp_path):
    """get_peft_model(model, LoraConfig(r=...)): LoRA on every layer's q_proj and v_proj (Qwen3's
    defaults), the base model's logits at init, and only LoRA trains."""
    peft = pytest.importorskip("peft")
    _, folder = export(tmp_path, "value")
    model = load(folder)
    idx = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        want = model(input_ids=idx).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8))
    wrapped = sorted(name.split(".")[-1] for name, m in lora.named_modules()
                     if isinstance(m, peft.tuners.lora.LoraLayer))
    assert wrapped == sorted(["q_proj", "v_proj"] * SIZE["n_layer"]), wrapped
    with torch.no_grad():
        assert torch.equal(lora(input_ids=idx).logits, want)  # LoRA's B starts at zero
    lora(input_ids=idx, labels=idx).loss.backward()
    trained = {name for name, p in lora.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in name for name in trained)


def test_lm_eval_hf_backend_scores_as_our_model(tmp_path, monkeypatch):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` on the local task of
    docs/eval_tasks, in padded batches of 4: each log-likelihood is our model's on the request
    alone (bytes: the context's ids, then the continuation's)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    ours, folder = export(tmp_path, "value", BYTES, block_size=512, init_std=0.05)
    monkeypatch.chdir(ROOT / "docs" / "eval_tasks")  # lm-eval reads the data_files from here
    task = "shakespeare_last_word"
    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32",
        tasks=[task], task_manager=TaskManager(include_path=".", include_defaults=False),
        limit=6, batch_size=4, device="cpu", log_samples=True)
    requests = [(args, resp[0][0]) for s in out["samples"][task]
                for args, resp in zip(s["arguments"], s["resps"])]
    assert len(requests) == 4 * 6
    for (context, continuation), theirs in requests:
        ctx, cont = BYTES.encode(context), BYTES.encode(continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = ours(ids[:, :-1])[0][0, -len(cont):].log_softmax(-1)
        mine = logp.gather(-1, ids[0, -len(cont):, None]).sum().item()
        assert abs(mine - theirs) < 1e-4, (context[-30:], continuation, mine, theirs)


CLEAN_MACHINE = """
import importlib.util, sys, torch
from transformers import AutoModelForCausalLM
assert not any(importlib.util.find_spec(m) for m in ("lab", "baselines", "model", "checkpoint"))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True,
                                             dtype=torch.bfloat16).eval()
idx = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save({"logits": model(input_ids=idx).logits, "dtype": str(model.lm_head.weight.dtype),
                "tokens": model.generate(idx[:, :7], max_new_tokens=12, do_sample=False,
                                         eos_token_id=None)}, sys.argv[3])
"""


def test_the_folder_runs_without_this_repository(tmp_path):
    """torch and transformers alone, from a folder that neither holds this repository nor has it
    on sys.path: a looped bf16 export loaded in bf16 (as docs/pretrained.md loads the released
    model) gives our logits and our greedy tokens."""
    ours, folder = export(tmp_path, "looped", dtype=torch.bfloat16)
    idx = torch.randint(0, 257, (2, 20))
    torch.save(idx, tmp_path / "idx.pt")
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CLEAN_MACHINE, str(folder), "idx.pt", "out.pt"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["dtype"] == "torch.bfloat16"
    with torch.no_grad():
        assert torch.equal(got["logits"], ours(idx)[0])
    assert torch.equal(got["tokens"], ours.generate(idx[:, :7], 12, temperature=0))
