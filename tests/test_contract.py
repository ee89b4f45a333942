"""The contract every variant the repository builds must pass, one parametrized test per clause:
a naive loop reference it matches (at T = C too), cached decoding equal to the full forward,
causality, the sequences of a batch kept apart, vanilla's KV cache, every added parameter
registered, trained and saved, exact round trips through a train.py checkpoint and a Hugging Face
export (whose logits in transformers are ours), and one graph under torch.compile.

VARIANTS is derived from model.DEPTH_MODES, reference.SOURCE_CASES and baselines.BASELINES (by
helpers.contract_variants, which tests/parallel_driver.py trains too), and REFERENCES from the
naive reference's registries (tests/reference.py: REFERENCE_MODES, MODEL_REFERENCES), so a new row,
source rule or baseline is held to the contract with no edit here; docs/forking.md's examples are
registered at test time and run through every clause (test_the_forking_examples_pass_...)."""
import copy
import importlib
import itertools
import math
import re
import textwrap
from dataclasses import asdict, replace

import pytest
import torch

from conftest import added_parameters, tiny_config, tiny_variant
import export
from model import DEPTH_MODES, KVCache
import model as model_py
from support import checkpoint, hf, run_dir
from support.cost import depth_cost
from support.depth_weights import capture
from support.variants import build_model
from support.tokenizer import tokenizer_record
from helpers import ROOT, contract_variants
from reference import (MODEL_REFERENCES, REFERENCE_MODES, SOURCE_CASES, assert_matches_reference,
                       reference_forward)
import reference

# The files that register a reference in MODEL_REFERENCES (LIMe's, the baselines'), imported for it.
for path in sorted((ROOT / "tests").glob("test_*.py")):
    if path.name != "test_contract.py" and "\nMODEL_REFERENCES" in path.read_text():
        importlib.import_module(path.stem)

VARIANTS = contract_variants(SOURCE_CASES)
# variant -> its naive reference (model, idx) -> logits, each written from its own equations
REFERENCES = {**{name: reference_forward for name, keys in VARIANTS.items()
                 if keys.get("residual") is None and keys["depth_mode"] in REFERENCE_MODES},
              **MODEL_REFERENCES}
# (clause, variant) -> the reason that variant is exempt from that clause (reported as a skip).
EXEMPT = {("test_contract_kv_cache_is_vanillas", name): "a keyless model caches V alone, half of "
          "vanilla's bytes (tests/test_keyless.py asserts that)" for name in ("keyless", "keyless+value")}


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
    """At T = C first, the most candidates of a layer: weights laid out (B, n_kv_head, T, C) keep
    the shape of candidates before positions there, and only the values tell (depth_mix names the
    layout at any other T)."""
    model = build(variant)
    C = max((len(src) + 1 for src in model.depth_sources if src), default=None)
    if C is not None:
        try:
            assert_matches_reference(model, REFERENCES[variant], idx_shape=(2, C))
        except AssertionError as e:
            raise AssertionError(f"{variant} at T = C = {C}: {e}; depth weights laid out "
                                 f"(B, n_kv_head, T, C), not candidates before positions?") from e
    assert_matches_reference(model, REFERENCES[variant], idx_shape=(2, 6))


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
def test_contract_keeps_the_sequences_of_a_batch_apart(variant):
    """Changing one sequence of a batch moves no other sequence's logits."""
    model = build(variant)
    idx = torch.randint(0, 257, (3, 8))
    changed = idx.clone()
    changed[1] = torch.randint(0, 257, (8,))
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    diff = (a[[0, 2]] - b[[0, 2]]).abs().max().item()
    assert diff < 1e-12, (f"{variant}: changing sequence 1 of a batch moved the others' logits by "
                          f"{diff:.3e}: the rule mixes the batch (a mean or a norm over dim 0?)")
    assert (a[1] - b[1]).abs().max() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_registers_trains_and_saves_every_added_parameter(variant):
    """No tensor that requires grad reaches the loss from outside parameters() (a module-level
    nn.Parameter would be neither trained, saved nor exported), and every parameter the variant
    adds to vanilla gets a nonzero gradient and is in the state dict (the round-trip clause then
    restores and exports each, by name)."""
    model = build(variant)
    idx = torch.randint(0, 257, (2, 6))
    loss = model(idx, idx)[1]
    ours = {id(p) for p in model.parameters()}
    strays = [tuple(leaf.shape) for leaf in grad_leaves(loss) if id(leaf) not in ours]
    assert not strays, (f"{variant}: tensors that require grad reach the loss from outside "
                        f"model.parameters(), of shapes {strays}: a module-level nn.Parameter? It "
                        f"is neither trained, saved nor exported; make it a module's "
                        f"(DepthMode.params, docs/forking.md)")
    loss.backward()
    saved = model.state_dict()
    for name in added_parameters(model):
        grad = model.get_parameter(name).grad
        assert name in saved, f"{variant}: the parameter {name} is not in the state dict"
        assert grad is not None and grad.abs().max() > 0, f"{variant}: {name} gets no gradient"


def grad_leaves(loss):
    """The tensors autograd accumulates a gradient into for the loss: the leaves that require it."""
    seen, todo, leaves = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # an AccumulateGrad node
            leaves.append(node.variable)
        todo.extend(n for n, _ in node.next_functions)
    return leaves


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
    """A train.py checkpoint (run_dir.save_checkpoint, as train.py writes it) and its export
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
    run_dir.save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                             **tokenizer_record("bytes"), "step": 3}, run / "ckpt.pt")
    loaded = checkpoint.load_model(run).model
    export.main([str(run), str(tmp_path / "hf")])
    exported = hf.from_pretrained(tmp_path / "hf").eval()
    monkeypatch.chdir(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    state, tied = model.state_dict(), hf.shared_names(model)
    runs = [("checkpoint", loaded), ("export", exported)]
    runs += [("transformers", theirs.gpt)] if hasattr(theirs, "gpt") else []  # not a Qwen3 folder
    for name, m in runs:
        assert hf.shared_names(m) == tied, (
            f"{name}: the tensors {variant} shares come back as {hf.shared_names(m)}, not {tied}: "
            f"share the module (DepthMode.shared), not a Parameter between modules")
        theirs_state = m.state_dict()
        assert theirs_state.keys() == state.keys(), f"{name}: {theirs_state.keys() ^ state.keys()}"
        assert all(torch.equal(theirs_state[k], t) for k, t in state.items()), name
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_a_learned_row_starts_as_its_base(variant):
    """A learned row (DepthMode.params) declares its base (starts_as), and a freshly built model,
    its parameters as the row initialises them, equals the base with the same backbone exactly:
    logits and depth weights. The reference cannot tell (tiny_variant moves every parameter off
    its init, and a scale missing from the code is missing from its reference too)."""
    keys = VARIANTS[variant]
    row = DEPTH_MODES[keys["depth_mode"]]
    torch.manual_seed(0)
    model = build_model(tiny_config(vocab_size=257, **keys)).eval()
    if not added_parameters(model) or row.params is None:
        return  # no learned row
    assert row.starts_as in DEPTH_MODES and row.starts_as != keys["depth_mode"], (
        f"{variant}: a learned row declares its base, another row it equals at init: "
        f"DepthMode(starts_as=...), got {row.starts_as!r}")
    base = build_model(tiny_config(vocab_size=257, **{**keys, "depth_mode": row.starts_as}))
    missing = base.eval().load_state_dict(model.state_dict(), strict=False).missing_keys
    assert not missing and base.depth_sources == model.depth_sources, missing
    idx = torch.randint(0, 257, (2, 7))
    with torch.no_grad(), capture(model) as ours, capture(base) as theirs:
        diff = (model(idx)[0] - base(idx)[0]).abs().max().item()
    weights = [e for e in ours if not torch.equal(ours[e][1], theirs[e][1])]
    assert diff == 0 and not weights and ours.keys() == theirs.keys(), (
        f"{variant} does not start as its base {row.starts_as}: logits differ by {diff:.3e}, depth "
        f"weights at layers {weights}: its parameters' init (zeros where the base has none; a "
        f"layer re-drawn by GPT._init_weights), or a term missing from both the code and its "
        f"reference (a 1 / sqrt(D))?")


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_runs_looped(variant):
    """Its source rule, unlooped and looped 2 and 3 times, gives the sources the reference restates
    in effective layers (reference_sources), and the looped model matches its naive reference: a
    rule counted in blocks (e % n_layer) is right unlooped only."""
    keys = VARIANTS[variant]
    if keys.get("residual") is not None or not DEPTH_MODES[keys["depth_mode"]].mixes:
        return  # one pass over the layers (a baseline), or no sources
    for loops in (1, 2, 3):
        model = tiny_variant(dtype=torch.float64, vocab_size=257, **{**keys, "n_loops": loops})
        c = model.config
        want = [reference.reference_sources(c, e) for e in range(c.n_eff_layer)]
        assert model.depth_sources == want, (
            f"{variant} with n_loops={loops}: sources {model.depth_sources}, the rule in effective "
            f"layers gives {want}: counted in blocks (e % n_layer), not effective layers?")
        if loops > 1:
            assert_matches_reference(model.eval(), REFERENCES[variant], idx_shape=(1, 4))


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_depth_weights_are_float32_under_bf16(variant):
    """Under bf16 autocast (CUDA training) the depth weights stay float32 (depth_mix refuses
    narrower ones: bf16 weights sum to 1 +- 3e-3), and the logits are finite."""
    model = build(variant, torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), capture(model) as alphas:
        logits = model(torch.randint(0, 257, (2, 6)))[0]
    narrow = {e: a.dtype for e, (_, a) in alphas.items() if a.dtype.itemsize < 4}
    assert not narrow and torch.isfinite(logits).all(), f"{variant}: depth weights in {narrow}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_declares_its_optimizer_groups(variant):
    """Prints the group train.py's optimizer puts each parameter the variant adds in, and refuses
    weight decay on a 1-D parameter (a bias, a gain, a scalar) unless its module says it is meant
    (`decays_vectors = True`)."""
    import train
    from support.run_config import DEFAULTS
    model = build(variant, torch.float32)
    optimizer = train.make_optimizer(model, DEFAULTS, "cpu")
    group = {id(p): (i, g) for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    for name in added_parameters(model):
        i, g = group[id(model.get_parameter(name))]
        print(f"{variant}: {name} {tuple(model.get_parameter(name).shape)} -> group {i} "
              f"(weight_decay {g['weight_decay']}, lr x {optimizer.lr_mults[i]})")
    for name, p in model.named_parameters():
        i, g = group[id(p)]
        owners = [model.get_submodule(".".join(name.split(".")[:n]))
                  for n in range(name.count(".") + 1)]
        meant = any(getattr(m, "decays_vectors", False) for m in owners)
        assert p.dim() >= 2 or g["weight_decay"] == 0 or meant, (
            f"{variant}: weight decay {g['weight_decay']} on the 1-D parameter {name} "
            f"{tuple(p.shape)} (group {i}, its module's optimizer_group): biases, gains and "
            f"scalars take none; drop weight_decay from the group, or set decays_vectors = True "
            f"on the module if it is meant")


CLAUSES = [test_contract_has_a_naive_reference, test_contract_matches_its_naive_reference,
           test_contract_cached_decoding_equals_the_full_forward, test_contract_is_causal,
           test_contract_keeps_the_sequences_of_a_batch_apart,
           test_contract_registers_trains_and_saves_every_added_parameter,
           test_contract_kv_cache_is_vanillas,
           test_contract_round_trips_through_a_checkpoint_and_an_export,
           test_contract_compiles_in_one_graph, test_contract_a_learned_row_starts_as_its_base,
           test_contract_runs_looped, test_contract_depth_weights_are_float32_under_bf16,
           test_contract_declares_its_optimizer_groups]


def test_every_clause_and_exemption_is_listed():
    """The forking example runs CLAUSES, so every test_contract_* is one; an exemption names a
    clause and a variant, and says why."""
    names = {clause.__name__ for clause in CLAUSES}
    assert {name for name in globals() if name.startswith("test_contract_")} == names
    for (clause, variant), why in EXEMPT.items():
        assert clause in names and variant in VARIANTS and why, (clause, variant)


# ----------------------------------------------------------------------------- the forking examples

def code_blocks(text, fence):
    """The bodies of the ```python blocks whose first line is `# <fence>`."""
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(f"# {fence}")]


def example(heading):
    """docs/forking.md's section `## <heading>`: its model.py block and its tests/reference.py
    block."""
    doc = (ROOT / "docs" / "forking.md").read_text()
    text = doc[doc.index(f"\n## {heading}"):]
    text = text[:text.find("\n## ", 1) % (len(text) + 1)]
    (model_part,), (reference_part,) = (code_blocks(text, "model.py"),
                                        code_blocks(text, "tests/reference.py"))
    return model_part, reference_part


def export_fork(monkeypatch, fork):
    """Exports write `fork` as their model.py: the fork's file, as a fork exports it."""
    write = hf.write_remote_code
    monkeypatch.setattr(hf, "write_remote_code",
                        lambda folder: (write(folder), (folder / "model.py").write_text(fork)))


def row_example(heading, monkeypatch):
    """A new row as a fork writes it: the row in model.py right after DEPTH_MODES (and in the
    exported model.py), its reference in tests/reference.py. Yields the name it adds to the
    table."""
    model_part, reference_part = example(heading)
    before = set(DEPTH_MODES)
    exec(model_part, dict(vars(model_py)))
    exec(reference_part, dict(vars(reference)))
    (name,) = set(DEPTH_MODES) - before
    source = (ROOT / "model.py").read_text()
    table_end = source.index("\n}\n", source.index("DEPTH_MODES = {")) + 3
    export_fork(monkeypatch, source[:table_end] + "\n" + model_part + source[table_end:])
    monkeypatch.setitem(VARIANTS, name, dict(depth_mode=name))
    monkeypatch.setitem(REFERENCES, name, reference_forward)
    yield name
    DEPTH_MODES.pop(name)
    REFERENCE_MODES.pop(name)


@pytest.fixture
def forking_example(monkeypatch):
    yield from row_example("The example: hard top-1 over depth", monkeypatch)


@pytest.fixture
def learned_example(monkeypatch):
    yield from row_example("A learned rule: a temperature per layer", monkeypatch)


@pytest.fixture
def shared_example(monkeypatch):
    yield from row_example("Parameters shared by every layer", monkeypatch)


@pytest.fixture
def source_example(monkeypatch):
    """A new source rule as a fork writes it: ModelConfig.sources replaced in model.py (and in the
    exported model.py), reference_sources in tests/reference.py with the keys that select the
    rule in SOURCE_CASES. The contract's name for it."""
    model_part, reference_part = example("A source rule")
    method = model_part.split("\n", 1)[1]  # under the fence line, indented as in the class
    space = dict(vars(model_py))
    exec(textwrap.dedent(method), space)
    monkeypatch.setattr(model_py.ModelConfig, "sources", space["sources"])
    before, space = set(SOURCE_CASES), dict(vars(reference))
    exec(reference_part, space)
    monkeypatch.setattr(reference, "reference_sources", space["reference_sources"])
    (rule,) = set(SOURCE_CASES) - before
    source = (ROOT / "model.py").read_text()
    start = source.index("    def sources(self, e: int)")
    export_fork(monkeypatch, source[:start] + method.rstrip() + source[source.index("\n\n\n",
                                                                                   start):])
    name = f"value+{rule}"
    monkeypatch.setitem(VARIANTS, name, dict(depth_mode="value", **SOURCE_CASES[rule]))
    monkeypatch.setitem(REFERENCES, name, reference_forward)
    yield name
    SOURCE_CASES.pop(rule)


def run_every_clause(variant, tmp_path, monkeypatch):
    for clause in CLAUSES:
        kwargs = {"tmp_path": tmp_path / clause.__name__, "monkeypatch": monkeypatch}
        kwargs["tmp_path"].mkdir()
        clause(variant, **{k: v for k, v in kwargs.items()
                           if k in clause.__code__.co_varnames[:clause.__code__.co_argcount]})


def test_the_forking_example_passes_the_whole_contract(forking_example, tmp_path, monkeypatch):
    run_every_clause(forking_example, tmp_path, monkeypatch)


def test_the_learned_example_passes_the_whole_contract(learned_example, tmp_path, monkeypatch):
    """And it is what the page says: `value` at init, its parameter in the model and its
    optimizer groups (no weight decay: one number per block), its weights read out as any row's,
    its parameters counted by depth_cost."""
    from support.depth_weights import capture
    from support.run_config import DEFAULTS
    import train
    run_every_clause(learned_example, tmp_path, monkeypatch)
    model = tiny_variant(depth_mode=learned_example)
    idx = torch.randint(0, 50, (2, 7))
    fresh = []
    for mode in (learned_example, "value"):
        torch.manual_seed(0)
        fresh.append(model_py.GPT(replace(model.config, depth_mode=mode)))
    with torch.no_grad():
        assert torch.equal(fresh[0](idx)[0], fresh[1](idx)[0]), "the row does not start as value"
    names = added_parameters(model)
    assert names and all(".self_attn.depth_params." in n for n in names), names
    groups = train.make_optimizer(model, DEFAULTS, "cpu").param_groups
    no_decay = {id(p) for p in groups[1]["params"]}
    assert all(id(model.get_parameter(n)) in no_decay for n in names)
    with capture(model) as alphas:
        model(idx)
    assert sorted(alphas) == [e for e, src in enumerate(model.depth_sources) if src]
    assert depth_cost(model.config)["extra_params"] == sum(
        model.get_parameter(n).numel() for n in names)


def test_the_shared_example_passes_the_whole_contract(shared_example, tmp_path, monkeypatch):
    """And its one vector is what the page says: held by every block, counted once, the sum of
    every layer's gradient (the blocks given copies of it instead), and a resumed run, its
    optimizer's state included, continues exactly and still shares it."""
    import io
    from support.run_config import DEFAULTS
    import train
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    run_every_clause(shared_example, tmp_path, monkeypatch)
    export = tmp_path / test_contract_round_trips_through_a_checkpoint_and_an_export.__name__
    theirs = AutoModelForCausalLM.from_pretrained(export / "hf", trust_remote_code=True)
    theirs.save_pretrained(export / "again")  # a fine-tuned model saved by transformers
    again, idx = hf.from_pretrained(export / "again"), torch.randint(0, 257, (2, 6))
    assert hf.shared_names(again) == hf.shared_names(theirs.gpt) != {}
    with torch.no_grad():
        assert torch.equal(again(idx)[0], theirs.gpt(idx)[0])
    for folder in ("hf", "again"):
        with safe_open(export / folder / "model.safetensors", "pt") as f:
            stored = [k for k in f.keys() if "depth_params" in k]
        assert stored == ["model.layers.1.self_attn.depth_params.bias"], (folder, stored)
    model = build(shared_example)
    held = [b.self_attn.depth_params for b in model.layers[1:]]
    bias = held[0].bias
    assert all(m is held[0] for m in held) and len(held) > 1, "every block holds the one module"
    assert added_parameters(model) == ["layers.1.self_attn.depth_params.bias"]
    vanilla = build_model(tiny_config(vocab_size=257, depth_mode="vanilla")).num_params()
    assert model.num_params() - vanilla == bias.numel() == depth_cost(model.config)["extra_params"]
    model(idx, idx)[1].backward()
    apart = build(shared_example)
    for block in apart.layers[2:]:  # the blocks given copies: each layer's own gradient
        block.self_attn.depth_params = copy.deepcopy(block.self_attn.depth_params)
    apart(idx, idx)[1].backward()
    grads = [b.self_attn.depth_params.bias.grad for b in apart.layers[1:]]
    assert all(g.abs().max() > 0 for g in grads), "a layer's gradient does not reach the vector"
    diff = (bias.grad - sum(grads)).abs().max().item()
    assert diff < 1e-12, f"the shared vector's gradient is not every layer's, off by {diff:.3e}"

    def run(model, optimizer, steps):  # train.py's step: AdamW on the groups make_optimizer makes
        for _ in range(steps):
            optimizer.zero_grad()
            model(idx, idx)[1].backward()
            optimizer.step()
    runs = [build(shared_example) for _ in range(2)]
    opts = [train.make_optimizer(m, DEFAULTS, "cpu") for m in runs]
    run(runs[0], opts[0], 3)
    run(runs[1], opts[1], 2)
    saved = io.BytesIO()
    torch.save({"model": runs[1].state_dict(), "optimizer": opts[1].state_dict()}, saved)
    resumed = build(shared_example)
    opt = train.make_optimizer(resumed, DEFAULTS, "cpu")
    saved.seek(0)
    ckpt = torch.load(saved)
    resumed.load_state_dict(ckpt["model"])  # as train.py resumes
    opt.load_state_dict(ckpt["optimizer"])
    run(resumed, opt, 1)
    assert hf.shared_names(resumed) == hf.shared_names(runs[0])
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), runs[0].parameters()))
    from support.errors import ConfigError
    from support.sharded import shard
    with pytest.raises(ConfigError, match="fsdp shards each block apart.*--parallel=ddp"):
        shard(resumed, bf16=False)  # refused before any process group is needed


# a fork's sharing by hand: one Parameter in every block's own module (not DepthMode.shared)
SHARED_PARAMETER = """
BIASES = {}  # id(config) -> the one bias of that model


class Bias(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.bias = BIASES.setdefault(id(config), nn.Parameter(torch.zeros(config.n_eff_layer)))


def biased_weights(qbar, keys, params, e):
    scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
    bias = params.bias[:len(keys)].view(1, 1, -1, 1)
    return (fp32_or_wider(scores) / math.sqrt(qbar.shape[-1]) + bias).softmax(2)


DEPTH_MODES["planted"] = DepthMode(biased_weights, mixes_v=True, params=Bias, starts_as="value")
"""


def test_the_contract_names_a_parameter_shared_between_modules(plant, tmp_path, monkeypatch):
    """Loading by assignment gives each name its own tensor: transformers unties a Parameter
    shared between modules (a module shared by DepthMode.shared stays one), and the round trip
    names it."""
    planted = plant(model_py.softmax_weights, ref=biased_ref)  # the row itself: below
    exec(SHARED_PARAMETER, dict(vars(model_py)))
    export_fork(monkeypatch, (ROOT / "model.py").read_text() + SHARED_PARAMETER)
    with pytest.raises(AssertionError, match="transformers: the tensors planted shares.*module"):
        test_contract_round_trips_through_a_checkpoint_and_an_export(planted, tmp_path, monkeypatch)


def test_the_source_example_passes_the_whole_contract(source_example, tmp_path, monkeypatch):
    """And its rule is the one that runs: the model's sources are the page's, not the paper's."""
    run_every_clause(source_example, tmp_path, monkeypatch)
    model = build(source_example)
    c = model.config
    assert model.depth_sources == [reference.reference_sources(c, e) for e in range(c.n_eff_layer)]
    assert model.depth_sources != [reference.ref_sources(e, c.stride, c.depth_recent_window)
                                   for e in range(c.n_eff_layer)], "the paper's rule ran"


def test_the_contract_catches_a_decode_kernel_on_the_example(forking_example):
    """The fork's bug this contract exists for: the soft decode kernel taken by a hard mode. Forced
    on (a row may not ask for it), cached decoding departs from the full forward."""
    object.__setattr__(DEPTH_MODES[forking_example], "decode_kernel", True)
    with pytest.raises(AssertionError, match="cached logits differ"):
        test_contract_cached_decoding_equals_the_full_forward(forking_example)


# ----------------------------------------------------------------------------- planted bugs
# Each a one-line bug of a fork that every other clause lets through, and the clause that names it.

@pytest.fixture
def plant(monkeypatch):
    """plant(weights, row=None, ref=softmax_ref, **keys): a row `planted` with these weights,
    mixing V (row: more DepthMode fields, a learned row's params and starts_as), whose reference
    is ref (the paper's softmax); the variant's name."""
    def plant(weights, row=None, ref=reference.softmax_ref, **keys):
        monkeypatch.setitem(DEPTH_MODES, "planted",
                            model_py.DepthMode(weights, **{"mixes_v": True, **(row or {})}))
        monkeypatch.setitem(REFERENCE_MODES, "planted", (ref, "kv" if row and row.get("mixes_k")
                                                         else "v"))
        monkeypatch.setitem(VARIANTS, "planted", dict(depth_mode="planted", **keys))
        monkeypatch.setitem(REFERENCES, "planted", reference_forward)
        return "planted"
    return plant


class ZeroInitMLP(torch.nn.Module):
    """A learned shift of qbar, an MLP whose last layer starts at zero: the row starts as value."""
    def __init__(self, config, layer):
        super().__init__()
        self.hidden = torch.nn.Linear(config.head_dim, config.head_dim)
        self.out = torch.nn.Linear(config.head_dim, config.head_dim)
        torch.nn.init.zeros_(self.out.weight), torch.nn.init.zeros_(self.out.bias)
        self.optimizer_group = {"weight_decay": 0.0}


def shifted_weights(qbar, keys, params, e):
    return model_py.softmax_weights(qbar + params.out(params.hidden(qbar).relu()), keys)


def test_a_rows_init_is_its_own_and_the_contract_names_a_layer_re_drawn(plant, monkeypatch):
    """GPT._init_weights re-draws every Linear but a row's: the MLP's zeroed layer stays zero and
    the row starts as value. Re-drawn (as GPT.__init__ did: self.apply(self._init_weights)), it
    does not, and the clause names it."""
    planted = plant(shifted_weights, dict(params=ZeroInitMLP, starts_as="value"))
    test_contract_a_learned_row_starts_as_its_base(planted)
    init = model_py.GPT.__init__

    def redraw_every_linear(self, config):
        init(self, config)
        self.apply(self._init_weights)
    monkeypatch.setattr(model_py.GPT, "__init__", redraw_every_linear)
    with pytest.raises(AssertionError, match="does not start as its base value.*re-drawn"):
        test_contract_a_learned_row_starts_as_its_base(planted)


class ScoreBias(torch.nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.arange(float(config.n_eff_layer)))  # zeros: value


def biased_weights(qbar, keys, params, e):  # a learned bonus per candidate on the paper's scores
    scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)  # (B, n_kv, C, T)
    bias = params.bias[:len(keys)].view(1, 1, -1, 1)
    return (model_py.fp32_or_wider(scores) / math.sqrt(qbar.shape[-1]) + bias).softmax(2)


def biased_ref(qbar, cand_k, params, e):
    return list(torch.softmax(torch.stack([(qbar * kk).sum() / math.sqrt(len(qbar)) + b for kk, b
                                           in zip(cand_k, params.bias)]), 0))


def test_the_contract_names_a_learned_row_not_started_as_its_base(plant):
    """arange where zeros were meant: code and reference agree, the row is not value at init."""
    planted = plant(biased_weights, dict(params=ScoreBias, starts_as="value"), biased_ref)
    test_contract_matches_its_naive_reference(planted)
    with pytest.raises(AssertionError, match="does not start as its base value"):
        test_contract_a_learned_row_starts_as_its_base(planted)
    planted = plant(biased_weights, dict(params=ScoreBias, starts_as="planted"), biased_ref)
    with pytest.raises(AssertionError, match="declares its base, another row"):  # itself: no check
        test_contract_a_learned_row_starts_as_its_base(planted)


def test_the_contract_names_a_scale_missing_from_the_code_and_its_reference(plant, monkeypatch):
    """The guide's `tempered` without 1 / sqrt(D), in its code and in its reference alike."""
    class Temperature(torch.nn.Module):
        def __init__(self, config, layer):
            super().__init__()
            self.log_tau = torch.nn.Parameter(torch.zeros(()))

    def weights(qbar, keys, params, e):
        scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
        return (model_py.fp32_or_wider(scores) / params.log_tau.exp()).softmax(2)

    def ref(qbar, cand_k, params, e):
        return list(torch.softmax(torch.stack([(qbar * kk).sum() / params.log_tau.exp()
                                               for kk in cand_k]), 0))

    planted = plant(weights, dict(params=Temperature, starts_as="value"), ref)
    test_contract_matches_its_naive_reference(planted)
    with pytest.raises(AssertionError, match="does not start as.*1 / sqrt"):
        test_contract_a_learned_row_starts_as_its_base(planted)


def test_the_contract_names_a_rule_counted_in_blocks(monkeypatch):
    """A fork's source rule over range(e % n_layer): right unlooped, wrong looped."""
    def sources(self, e):
        if not DEPTH_MODES[self.depth_mode].mixes or e == 0:
            return []
        return [j for j in range(e % self.n_layer) if j % self.stride == 0]
    monkeypatch.setattr(model_py.ModelConfig, "sources", sources)
    test_contract_matches_its_naive_reference("value+every-layer")
    with pytest.raises(AssertionError, match="n_loops=2.*counted in blocks"):
        test_contract_runs_looped("value+every-layer")


def test_the_contract_names_weight_decay_on_a_bias(plant):
    class Bias(torch.nn.Module):
        def __init__(self, config, layer):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(config.n_eff_layer))
            self.optimizer_group = {"weight_decay": 0.1}  # meant for a matrix

    planted = plant(biased_weights, dict(params=Bias, starts_as="value"), biased_ref)
    test_contract_a_learned_row_starts_as_its_base(planted)
    with pytest.raises(AssertionError, match="weight decay 0.1 on the 1-D parameter"):
        test_contract_declares_its_optimizer_groups(planted)
    Bias.decays_vectors = True  # declared: meant
    test_contract_declares_its_optimizer_groups(planted)


def test_the_contract_names_a_depth_softmax_in_bf16(plant):
    def weights(qbar, keys):  # no fp32_or_wider: under bf16 autocast the softmax runs in bf16
        scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)
        return (scores / math.sqrt(qbar.shape[-1])).softmax(2)

    planted = plant(weights)
    test_contract_matches_its_naive_reference(planted)  # float64: right
    with pytest.raises(ValueError, match="depth weights in torch.bfloat16; compute them in float32"):
        test_contract_depth_weights_are_float32_under_bf16(planted)


def test_the_contract_names_a_module_level_parameter(plant):
    temperature = torch.nn.Parameter(torch.ones((), dtype=torch.float64))  # in no module

    def weights(qbar, keys):
        return model_py.softmax_weights(qbar * temperature, keys)

    test_contract_matches_its_naive_reference(plant(weights))  # at 1, the values are right
    with pytest.raises(AssertionError, match="module-level nn.Parameter"):
        test_contract_registers_trains_and_saves_every_added_parameter("planted")


def test_the_contract_names_weights_laid_out_positions_first(plant):
    def weights(qbar, keys):
        return model_py.softmax_weights(qbar, keys).transpose(2, 3)  # (B, n_kv_head, T, C)

    with pytest.raises(ValueError, match="candidates before positions"):  # some layer's C != T
        test_contract_matches_its_naive_reference(plant(weights))
    with pytest.raises(AssertionError, match="(?s)T = C = 2.*candidates before positions"):
        test_contract_matches_its_naive_reference(plant(weights, n_layer=2, depth_stride=1))


def test_the_contract_names_a_rule_that_mixes_the_batch(plant):
    def weights(qbar, keys):  # centred over the batch: each sequence's weights read the others
        return model_py.softmax_weights(qbar - qbar.mean(0, keepdim=True), keys)

    with pytest.raises(AssertionError, match="mixes the batch"):
        test_contract_keeps_the_sequences_of_a_batch_apart(plant(weights))


# ----------------------------------------------------------------------------- seams

def test_a_rule_of_the_layer_and_the_depth_needs_no_module(plant):
    """DepthMode.params may hand the weights any value, here the config: the sources' share grows
    with e / n_eff_layer. No parameter is added; the rule runs looped and cached like any row's."""
    def weights(qbar, keys, config, e):
        share = e / config.n_eff_layer
        w = qbar.new_tensor([share] * (len(keys) - 1) + [1.0], dtype=torch.float64)
        B, n_kv, T, _ = qbar.shape
        return (w / w.sum()).to(model_py.fp32_or_wider(qbar).dtype).view(1, 1, -1, 1).expand(
            B, n_kv, len(keys), T)

    def ref(qbar, cand_k, config, e):
        w = [e / config.n_eff_layer] * (len(cand_k) - 1) + [1.0]
        return [x / sum(w) for x in w]

    planted = plant(weights, dict(params=lambda config, layer: config), ref)
    assert not added_parameters(build(planted))
    for clause in (test_contract_matches_its_naive_reference, test_contract_runs_looped,
                   test_contract_cached_decoding_equals_the_full_forward,
                   test_contract_depth_weights_are_float32_under_bf16):
        clause(planted)


def test_a_row_may_weigh_k_and_v_apart(plant):
    """weights may return a pair, (K's weights, V's): here the paper's softmax for K and Uniform
    Mix for V, in the reference too; the same pair swapped is another model, which it tells."""
    def weights(qbar, keys):
        return model_py.softmax_weights(qbar, keys), model_py.uniform_weights(qbar, keys)

    def ref(qbar, cand_k):
        return reference.softmax_ref(qbar, cand_k), reference.uniform_ref(qbar, cand_k)

    planted = plant(weights, dict(mixes_k=True), ref)
    for clause in (test_contract_matches_its_naive_reference, test_contract_runs_looped,
                   test_contract_cached_decoding_equals_the_full_forward):
        clause(planted)
    REFERENCE_MODES["planted"] = (lambda qbar, cand_k: ref(qbar, cand_k)[::-1], "kv")
    with pytest.raises(AssertionError, match="differ from the reference"):
        test_contract_matches_its_naive_reference(planted)
