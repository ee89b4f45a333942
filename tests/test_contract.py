"""The contract every variant the repository builds must pass, one parametrized test per clause:
a naive loop reference it matches, cached decoding equal to the full forward, causality, vanilla's
KV cache, exact round trips through a train.py checkpoint and a Hugging Face export (whose logits
in transformers are ours), and one graph under torch.compile.

VARIANTS is derived from model.DEPTH_MODES and baselines.BASELINES, so a new row of the table or a
new baseline is held to the contract with no edit here; docs/forking.md's example is registered at
test time and run through every clause (test_the_forking_example_passes_the_whole_contract)."""
import itertools
import re
from dataclasses import asdict

import pytest
import torch

from baselines import BASELINES
from conftest import tiny_variant
import export
from model import DEPTH_MODES, KVCache
import model as model_py
from support import checkpoint, hf
from support.tokenizer import tokenizer_record
from helpers import ROOT
from test_baselines import REFERENCES as BASELINE_REFERENCES
from test_baselines import reference_forward as baseline_reference
from test_lime import lime_reference
from test_model import REFERENCE_MODES, assert_matches_reference, reference_forward
import test_model

# The variant's keys beyond conftest.tiny_config's: LIMe reads every earlier layer, as published;
# AttnRes takes a snapshot at every layer, so caching exercises its snapshots.
SHAPES = {"lime": dict(depth_stride=None), "attnres": dict(attnres_block_size=2)}
VARIANTS = {**{mode: dict(depth_mode=mode) for mode in DEPTH_MODES},
            "looped": dict(depth_mode="value", n_layer=2, n_loops=2, depth_stride=None),
            **{name: dict(depth_mode="vanilla", residual=name) for name in BASELINES}}
VARIANTS = {name: {**keys, **SHAPES.get(name, {})} for name, keys in VARIANTS.items()}
# variant -> its naive reference (model, idx) -> logits, each written from its own equations
REFERENCES = {**{mode: reference_forward for mode in REFERENCE_MODES}, "looped": reference_forward,
              "lime": lime_reference, **{name: baseline_reference for name in BASELINE_REFERENCES}}
# (clause, variant) -> the reason that variant is exempt from that clause (reported as a skip).
# None is: every variant passes every clause.
EXEMPT = {}


@pytest.fixture(autouse=True)
def exemptions(request):
    variant = getattr(request.node, "callspec",
                      None) and request.node.callspec.params.get("variant")
    if (request.node.originalname, variant) in EXEMPT:
        pytest.skip(EXEMPT[request.node.originalname, variant])


def build(variant, dtype=torch.float64):
    """The variant as a tiny model whose every parameter is off its init (conftest.tiny_variant)."""
    return tiny_variant(dtype=dtype, vocab_size=257, **VARIANTS[variant]).eval()


# ----------------------------------------------------------------------------- the clauses

@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_has_a_naive_reference(variant):
    assert variant in REFERENCES, (f"{variant} has no naive loop reference: write one from its "
                                   f"equations and add it to REFERENCES (docs/forking.md)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_matches_its_naive_reference(variant):
    assert_matches_reference(build(variant), REFERENCES[variant], idx_shape=(2, 6))


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_cached_decoding_equals_the_full_forward(variant):
    """A prefill then single tokens, and uneven chunks, against the full forward at every position
    (float64: a real bug cannot hide in rounding), into a cache with room to spare."""
    model = build(variant)
    idx = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        full, _ = model(idx)
        for chunks in [(5, 1, 1, 1, 1, 1, 1, 1), (3, 1, 4, 2, 1, 1)]:
            cache = model.new_cache(2, 14)
            ends = itertools.accumulate(chunks)
            cached = torch.cat([model(idx[:, end - n:end], cache=cache)[0]
                                for n, end in zip(chunks, ends)], 1)
            diff = (cached - full).abs().max().item()
            assert cache.pos == 12 and diff < 1e-10, f"{chunks}: cached logits differ by {diff:.3e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_is_causal(variant):
    """Changing a later token changes no earlier logit, and does change the later ones."""
    model = build(variant)
    idx = torch.randint(0, 257, (2, 12))
    changed = idx.clone()
    changed[:, 6:] = torch.randint(0, 257, (2, 6))
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    assert (a[:, :6] - b[:, :6]).abs().max().item() == 0.0, "earlier logits moved"
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_kv_cache_is_vanillas(variant):
    """The same object and the same bytes as vanilla's with the same loops: no persistent state."""
    model = build(variant, torch.float32)
    loops = model.config.n_loops
    vanilla = tiny_variant(vocab_size=257, depth_mode="vanilla", n_layer=model.config.n_layer,
                           n_loops=loops)
    caches = [m.new_cache(2, 10) for m in (vanilla, model)]
    with torch.no_grad():
        for m, cache in zip((vanilla, model), caches):
            m(torch.randint(0, 257, (2, 10)), cache=cache)
    c = model.config
    assert all(type(cache) is KVCache for cache in caches)
    assert caches[0].nbytes == caches[1].nbytes == 2 * c.n_eff_layer * c.n_kv_head * c.head_dim * 4 * 2 * 10
    assert caches[0].k.shape == caches[1].k.shape


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_round_trips_through_a_checkpoint_and_an_export(variant, tmp_path, monkeypatch):
    """A train.py checkpoint (checkpoint.save_checkpoint, as train.py writes it) and its export
    (`export.py`) load to the same logits bit for bit; transformers, loaded from another
    folder, runs the export to ours: exactly (our code travels in the folder), or within float32
    rounding for a vanilla export, which transformers runs as its own Qwen3."""
    from transformers import AutoModelForCausalLM
    model = build(variant, torch.float32)
    idx = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        want = model(idx)[0]
    run = tmp_path / "run"
    run.mkdir()
    checkpoint.save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                                **tokenizer_record("bytes"), "step": 3}, run / "ckpt.pt")
    loaded = checkpoint.load_model(run).model
    export.main([str(run), str(tmp_path / "hf")])
    exported = hf.from_pretrained(tmp_path / "hf").eval()
    monkeypatch.chdir(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], want) and type(loaded) is type(model)
        assert torch.equal(exported(idx)[0], want) and type(exported) is type(model)
        got = theirs(input_ids=idx).logits
    diff = (got - want).abs().max().item()
    if "auto_map" in (tmp_path / "hf" / "config.json").read_text():
        assert diff == 0.0, f"transformers runs our code to other logits ({diff:.3e})"
    else:
        assert diff < 1e-5, f"transformers' Qwen3 differs from ours by {diff:.3e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_compiles_in_one_graph(variant):
    """torch.compile(fullgraph=True) traces a training forward without a graph break, to eager's
    loss (the eager backend: the tracing is what is checked, not inductor's kernels)."""
    model = build(variant, torch.float32)
    torch._dynamo.reset()  # every variant is a new graph of GPT.forward: no recompile limit
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    idx = torch.randint(0, 257, (2, 8))
    with torch.no_grad():
        assert torch.equal(compiled(idx, idx)[1], model(idx, idx)[1])


CLAUSES = [test_contract_has_a_naive_reference, test_contract_matches_its_naive_reference,
           test_contract_cached_decoding_equals_the_full_forward, test_contract_is_causal,
           test_contract_kv_cache_is_vanillas,
           test_contract_round_trips_through_a_checkpoint_and_an_export,
           test_contract_compiles_in_one_graph]


def test_every_clause_and_exemption_is_listed():
    """The forking example runs CLAUSES, so every test_contract_* is one; an exemption names a
    clause and a variant, and says why."""
    names = {clause.__name__ for clause in CLAUSES}
    assert {name for name in globals() if name.startswith("test_contract_")} == names
    for (clause, variant), why in EXEMPT.items():
        assert clause in names and variant in VARIANTS and why, (clause, variant)


# ----------------------------------------------------------------------------- the forking example

def code_blocks(text, fence):
    """The bodies of the ```python blocks whose first line is `# <fence>`."""
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(f"# {fence}")]


@pytest.fixture
def forking_example(monkeypatch):
    """docs/forking.md's new mode, registered as a fork would write it: its row in model.py right
    after DEPTH_MODES (and in the exported model.py), its reference in test_model.py. The name it
    adds to the table."""
    doc = (ROOT / "docs" / "forking.md").read_text()
    (model_part,), (reference_part,) = code_blocks(doc, "model.py"), code_blocks(doc,
                                                                                 "test_model.py")
    before = set(DEPTH_MODES)
    exec(model_part, dict(vars(model_py)))
    exec(reference_part, dict(vars(test_model)))
    (name,) = set(DEPTH_MODES) - before
    source = (ROOT / "model.py").read_text()
    table_end = source.index("\n}\n", source.index("DEPTH_MODES = {")) + 3
    fork = source[:table_end] + "\n" + model_part + source[table_end:]
    write = hf.write_remote_code
    monkeypatch.setattr(hf, "write_remote_code",
                        lambda folder: (write(folder), (folder / "model.py").write_text(fork)))
    monkeypatch.setitem(VARIANTS, name, dict(depth_mode=name))
    monkeypatch.setitem(REFERENCES, name, reference_forward)
    yield name
    DEPTH_MODES.pop(name)
    REFERENCE_MODES.pop(name)


def test_the_forking_example_passes_the_whole_contract(forking_example, tmp_path, monkeypatch):
    for clause in CLAUSES:
        kwargs = {"tmp_path": tmp_path / clause.__name__, "monkeypatch": monkeypatch}
        kwargs["tmp_path"].mkdir()
        clause(forking_example, **{k: v for k, v in kwargs.items()
                                   if k in clause.__code__.co_varnames[:clause.__code__.co_argcount]})


def test_the_contract_catches_a_decode_kernel_on_the_example(forking_example):
    """The fork's bug this contract exists for: the soft decode kernel taken by a hard mode. Forced
    on (a row may not ask for it), cached decoding departs from the full forward."""
    object.__setattr__(DEPTH_MODES[forking_example], "decode_kernel", True)
    with pytest.raises(AssertionError, match="cached logits differ"):
        test_contract_cached_decoding_equals_the_full_forward(forking_example)
