"""The battery that makes model.py trustworthy, and the one contract every variant the repository
builds passes: every row of DEPTH_MODES, a looped model, value with every source rule of
SOURCE_CASES, the hidden-state baselines and Keyless Attention (VARIANTS), each against a naive
reference written from its equations (tests/reference.py), one parametrized test per clause.
A fork's row, model or source rule registers in tests/reference.py and is held to every clause with
no edit here (docs/forking.md); its examples run through the whole contract below, and one-line
bugs a fork plants fail the clause that names them. Then what only the paper's rows have: the
decode kernel, the attention calls, generation, the source rule's worked counts, the paper's
costs, clear errors."""
import contextlib
import itertools
import math
import re
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import baselines
import model as model_py
import reference
import train
from baselines import DEPTH_MODELS, build_model
from bench_cache import depth_cost
from checkpoint import load_model
from conftest import added_parameters, tiny_config, tiny_model, tiny_variant
from helpers import ROOT, contract_variants
from model import (DEPTH_MODES, GPT, KVCache, ModelConfig, apply_rope, depth_mix, depth_mix_one,
                   rope_tables, uniform_weights)
from outputs import save_checkpoint
from reference import (MODEL_REFERENCES, REFERENCE_MODES, SOURCE_CASES, assert_matches_reference,
                       reference_forward)
from tokenizer import tokenizer_record
from train import capture_depth_weights as capture

pytestmark = pytest.mark.fast

VARIANTS = contract_variants(SOURCE_CASES)
# variant -> its naive reference (model, idx) -> logits, each written from its own equations
REFERENCES = {**{name: reference_forward for name, keys in VARIANTS.items()
                 if keys.get("residual") is None and keys.get("attention") is None
                 and keys["depth_mode"] in REFERENCE_MODES}, **MODEL_REFERENCES}
# (clause, variant) -> the reason that variant is exempt from that clause (reported as a skip)
EXEMPT = {("test_contract_kv_cache_is_vanillas", name): "a keyless model caches V alone, half of "
          "vanilla's bytes (tests/test_baselines.py asserts that)" for name in ("keyless",
                                                                                "keyless+value")}
# The paper's rows at more shapes than the contract's one: MHA, GQA, MQA; strides (every layer,
# the first only); a recent window; loops; no q/k-norm with tied embeddings; k_norm after RoPE (the
# released model's order). The reference and cache clauses run them too.
MODES = list(REFERENCE_MODES)
MIXING = [m for m in MODES if REFERENCE_MODES[m]]
SHAPES = {**{f"{m}-kv{kv}": dict(depth_mode=m, n_kv_head=kv) for m in MODES for kv in (4, 1)},
          **{f"{m}-stride{s}": dict(depth_mode=m, depth_stride=s) for m in MIXING for s in (1, 9)},
          **{f"{m}-window": dict(depth_mode=m, depth_stride=3, depth_recent_window=2, n_layer=5)
             for m in MIXING},
          **{f"{m}-looped": dict(depth_mode=m, n_layer=2, n_loops=2, depth_stride=None)
             for m in MODES},
          "value-tied": dict(depth_mode="value", qk_norm=False, tie_embeddings=True),
          **{f"{m}-k_norm_after_rope": dict(depth_mode=m, k_norm_after_rope=True) for m in MODES},
          "kv-looped3": dict(depth_mode="kv", n_loops=3, n_layer=2),
          "value-window-mqa": dict(depth_mode="value", depth_stride=1, depth_recent_window=1,
                                   n_kv_head=1)}


@pytest.fixture(autouse=True)
def exemptions(request):
    variant = getattr(request.node, "callspec", None) and request.node.callspec.params.get("variant")
    if (request.node.originalname, variant) in EXEMPT:
        pytest.skip(EXEMPT[request.node.originalname, variant])


def build(variant, dtype=torch.float64, **overrides):
    """The variant as a tiny model whose every parameter is off its init (conftest.tiny_variant),
    checked as it is made (held_by_the_model)."""
    keys = {**(VARIANTS.get(variant) or SHAPES[variant]), **overrides}
    return held_by_the_model(tiny_variant(dtype=dtype, vocab_size=257, **keys).eval(), variant)


def fresh(variant, **overrides):
    """The variant as it initialises itself at seed 0 (float32), checked as it is made."""
    torch.manual_seed(0)
    keys = {**VARIANTS[variant], **overrides}
    return held_by_the_model(build_model(asdict(tiny_config(vocab_size=257, **keys))).eval(),
                             variant)


def held_by_the_model(model, variant):
    """The model, once what would fail later under another name is named: modules or tensors in a
    plain list, dict or attribute (parameters(), state_dict() and .to() never see them: a dtype
    crash first), and a row's weights that refuse qbar and keys of n_kv_head heads."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            held = (value.values() if isinstance(value, dict) else
                    value if isinstance(value, (list, tuple)) else [value])
            assert attr.startswith("_") or not any(isinstance(v, (nn.Module, torch.Tensor))
                                                   for v in held), (
                f"{variant}: {name or 'the model'}.{attr} holds modules or tensors in a plain "
                f"{type(value).__name__}, which parameters(), state_dict() and .to() never see "
                f"(neither trained, saved nor cast): nn.ModuleList, nn.Parameter, register_buffer")
    c = model.config
    try:
        row_weights(model, c.n_kv_head)
    except Exception as err:
        try:
            only_mha = c.n_head != c.n_kv_head and bool(row_weights(model, c.n_head))
        except Exception:
            only_mha = False
        raise AssertionError(
            f"{variant}: a row's weights raise {type(err).__name__} ({err}) on qbar and keys of "
            f"(B, n_kv_head = {c.n_kv_head}, T, D)" + (
                f", not with n_head = {c.n_head} heads: a shape of n_head where qbar has one head "
                f"per KV group, valid only when n_head == n_kv_head" if only_mha else "")) from err
    return model


def row_weights(model, heads, dtype=None):
    """{e: layer e's depth weights from random qbar and keys (2, heads, T, D)}, T above every C,
    at each layer with sources whose attention runs Attention.forward (a model of its own, LIMe's
    or Keyless's: its reference and the bf16 run check it)."""
    g, out, T = torch.Generator().manual_seed(0), {}, model.config.n_eff_layer + 1
    for e, src in enumerate(model.depth_sources):
        at = model.layers[e % model.config.n_layer].self_attn
        if not src or not hasattr(at, "mode") or type(at).forward is not model_py.Attention.forward:
            continue
        qbar, *keys = (torch.randn(2, heads, T, at.head_dim, generator=g).to(
            dtype or model.lm_head.weight.dtype) for _ in range(len(src) + 2))
        out[e] = at.mode.weights(qbar, keys, *(() if at.depth_params is None else
                                                (at.depth_params, e)))
    return out


def reference_of(variant):
    return REFERENCES.get(variant) or (reference_forward if variant in SHAPES else None)


# ----------------------------------------------------------------------------- the contract

@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_has_a_naive_reference(variant):
    assert variant in REFERENCES, (f"{variant} has no naive loop reference: write one from its "
                                   f"equations and register it in tests/reference.py "
                                   f"(docs/forking.md)")


@pytest.mark.parametrize("variant", [*VARIANTS, *SHAPES])
def test_contract_matches_its_naive_reference(variant):
    """Logits and every gradient, float64, at T = C first (the most candidates of a layer: weights
    laid out (B, n_kv_head, T, C) keep the shape of candidates before positions there, and only
    the values tell; the failure names that layout only where it is what differs) and at another
    length."""
    model, ref = build(variant), reference_of(variant)
    if ref is None:
        pytest.fail(f"{variant} has no naive reference (test_contract_has_a_naive_reference)")
    C = max((len(src) + 1 for src in model.depth_sources if src), default=None)
    if C is not None:
        try:
            assert_matches_reference(model, ref, idx_shape=(2, C))
        except AssertionError as e:
            layout = any(a.shape[2] != len(model.depth_sources[e]) + 1 for e, a in
                         row_weights(model, model.config.n_kv_head).items())
            raise AssertionError(f"{variant} at T = C = {C}: {e}" + (
                "; its depth weights are laid out (B, n_kv_head, T, C), not candidates before "
                "positions" if layout else "")) from e
    assert_matches_reference(model, ref, idx_shape=(2, 6))


@pytest.mark.parametrize("variant", [*VARIANTS, *SHAPES])
def test_contract_cached_decoding_equals_the_full_forward(variant):
    """A prefill then single tokens, uneven chunks, and every token alone, against the full forward
    at every position (float64: a real bug cannot hide in rounding), into a cache with room to
    spare (unused slots must not leak in)."""
    model = build(variant)
    idx = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        full, _ = model(idx)
        for chunks in [(5, 1, 1, 1, 1, 1, 1, 1), (3, 1, 4, 2, 1, 1), (1,) * 12]:
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
    """A train.py checkpoint (outputs.save_checkpoint, as train.py writes it) and its export
    (lab/export.py) load to the same logits bit for bit; transformers, loaded from another
    folder, runs the export to ours: exactly (our code travels in the folder), or within float32
    rounding for a vanilla export, which transformers runs as its own Qwen3."""
    from transformers import AutoModelForCausalLM
    from lab import export, hf
    model = build(variant, torch.float32)
    idx = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        want = model(idx)[0]
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                     **tokenizer_record("bytes"), "step": 3}, run / "ckpt.pt")
    loaded = load_model(run).model
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
            f"share the module, not a Parameter between modules (docs/forking.md)")
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


RELOADED = {}  # variant -> (its logits, its checkpoint's and its export's in a fresh process)
BUILT_IN = set(VARIANTS)  # reloaded together, by one process (a fork's: None until reloaded)
FORKED = {}  # a fork's code, by the module it goes in ("model", "baselines"): what a fresh
# process runs before it loads (the fork's files, as the fixtures below register them)
RELOAD = """
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, {root!r})
import baselines
import model
from checkpoint import load_model
from lab.hf import from_pretrained

for module, code in {forked!r}.items():
    exec(code, vars(model if module == "model" else baselines))
torch.set_num_threads({threads})
runs, logits = Path(sys.argv[1]), {{}}
for run in sys.argv[2:]:  # a variant that fails is its own case's failure, not every one's
    try:
        idx = torch.load(runs / run / "idx.pt")
        with torch.no_grad():
            logits[run] = [m(idx)[0] for m in (load_model(runs / run).model,
                                               from_pretrained(runs / run / "hf").eval())]
    except Exception:
        logits[run] = traceback.format_exc()
torch.save(logits, runs / "logits.pt")
"""


def reload_in_a_fresh_process(variants, folder):
    """{variant: (its logits, [its checkpoint's, its export's])}: each trained two steps by
    train.py's optimizer, saved as train.py saves and exported (lab/export.py) here, then all
    reloaded by one new interpreter with an empty environment."""
    from lab.export import save_pretrained
    want = {}
    for i, variant in enumerate(variants):
        model, idx = build(variant, torch.float32), torch.randint(0, 257, (2, 9))
        optimizer = train.make_optimizer(model, DEFAULTS, "cpu")
        for _ in range(2):
            model(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            want[variant] = model(idx)[0]
        (folder / str(i)).mkdir()
        torch.save(idx, folder / str(i) / "idx.pt")
        save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                         **tokenizer_record("bytes"), "step": 2}, folder / str(i) / "ckpt.pt")
        save_pretrained(model, folder / str(i) / "hf", None)
    code = RELOAD.format(root=str(ROOT), forked=FORKED, threads=torch.get_num_threads())
    proc = subprocess.run([sys.executable, "-c", code, str(folder), *map(str, range(len(variants)))],
                          env={}, cwd=folder, capture_output=True, text=True)
    assert proc.returncode == 0, f"the fresh process failed:\n{proc.stderr[-3000:]}"
    got = torch.load(folder / "logits.pt")
    return {variant: (want[variant], got[str(i)]) for i, variant in enumerate(variants)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_is_the_same_model_in_a_fresh_process(variant, tmp_path):
    """Trained two steps, saved as train.py saves it and exported (lab/export.py), it loads in a
    new interpreter with an empty environment to the same logits, bit for bit, from either: a
    setting read from anything but the config (an environment variable, a global set at run
    time) rebuilds otherwise. One process reloads every variant of the repository."""
    if variant in BUILT_IN and variant not in RELOADED:
        RELOADED.update(reload_in_a_fresh_process(sorted(BUILT_IN - RELOADED.keys()), tmp_path))
    elif variant in RELOADED and RELOADED[variant] is None:  # a fork's (fork): one process for
        RELOADED.update(reload_in_a_fresh_process(  # every fork registered beside it
            [v for v, r in RELOADED.items() if r is None], tmp_path))
    want, got = (RELOADED[variant] if variant in RELOADED else  # else made in the test alone
                 reload_in_a_fresh_process([variant], tmp_path)[variant])
    assert not isinstance(got, str), f"{variant} does not reload in a fresh process:\n{got[-3000:]}"
    for name, logits in zip(("checkpoint", "export"), got):
        diff = (logits - want).abs().max().item()
        assert diff == 0, (f"{variant}: its {name}, reloaded in a fresh process with an empty "
                           f"environment, gives logits {diff:.3e} off: a setting read from "
                           f"outside the config (os.environ, a global set at run time)?")


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_compiles_in_one_graph(variant):
    """torch.compile(fullgraph=True) traces a training forward without a graph break, to eager's
    loss, and Depth-Attention's own row at a second length too (the length turns symbolic;
    is_causal stays a literal) (the eager backend: the tracing is what is checked, not inductor's
    kernels)."""
    model = build(variant, torch.float32)
    torch._dynamo.reset()  # every variant is a new graph of GPT.forward: no recompile limit
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    idx = torch.randint(0, 257, (2, 8))
    with torch.no_grad():  # a second length (a symbolic one) for Depth-Attention's own row
        for T in (8, 6) if variant == "value" else (8,):
            assert torch.equal(compiled(idx[:, :T], idx[:, :T])[1], model(idx[:, :T], idx[:, :T])[1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_a_learned_row_starts_as_its_base(variant):
    """A learned row (DepthMode.params) declares its base (starts_as) and is paired with it by the
    seed: built at one seed, its backbone is its base's tensor for tensor and the generator is
    left where the base leaves it (Attention.__init__ builds a row's parameters on a fork of it),
    and two builds are equal in every tensor (a generator of the row's own, seeded by the time,
    is neither reproducible from --seed nor the same on every rank). Fresh, it equals its base
    exactly: logits and depth weights. The reference cannot tell (tiny_variant moves every
    parameter off its init, and a scale missing from the code is missing from its reference)."""
    row = DEPTH_MODES[VARIANTS[variant]["depth_mode"]]
    model, generator = fresh(variant), torch.get_rng_state()
    if not added_parameters(model) or row.params is None:
        return  # no learned row
    assert row.starts_as in DEPTH_MODES and row.starts_as != VARIANTS[variant]["depth_mode"], (
        f"{variant}: a learned row declares its base, another row it equals at init: "
        f"DepthMode(starts_as=...), got {row.starts_as!r}")
    state, again = model.state_dict(), fresh(variant).state_dict()
    differ = [n for n, t in state.items() if not torch.equal(t, again[n])]
    assert not differ, (f"{variant}: two builds at one seed differ in {differ[:3]}: the row draws "
                        f"its init from a generator of its own (seeded by the time?), which "
                        f"--seed does not reproduce and each rank draws differently; draw from "
                        f"torch's (Attention.__init__ forks it for the row)")
    base = fresh(variant, depth_mode=row.starts_as)
    unpaired = [n for n, t in base.state_dict().items()
                if n not in state or not torch.equal(t, state[n])]
    after = torch.get_rng_state()
    assert not unpaired, (
        f"{variant} is not paired with its base {row.starts_as} by the seed: {unpaired[:3]} "
        f"differ: building the row drew from the generator that draws the backbone "
        f"(Attention.__init__ builds DepthMode.params on a fork of it; parameters made or drawn "
        f"elsewhere are not)")
    idx = torch.randint(0, 257, (2, 7))
    with torch.no_grad(), capture(model) as ours, capture(base) as theirs:
        diff = (model(idx)[0] - base(idx)[0]).abs().max().item()
    weights = [e for e in ours if not torch.equal(ours[e][1], theirs[e][1])]
    dtypes = ({a.dtype for _, a in ours.values()}, {a.dtype for _, a in theirs.values()})
    assert diff == 0 and not weights and ours.keys() == theirs.keys(), (
        f"{variant} does not start as its base {row.starts_as}: logits differ by {diff:.3e}, depth "
        f"weights at layers {weights}: " + (
            f"its depth weights are {dtypes[0]}, its base's {dtypes[1]}: compute them in "
            f"fp32_or_wider's dtype" if dtypes[0] != dtypes[1] else
            "its parameters' init (zeros where the base has none; a layer re-drawn by "
            "GPT._init_weights), or a term missing from both the code and its reference "
            "(a 1 / sqrt(D))?"))
    assert torch.equal(generator, after), (
        f"{variant}: building it leaves the generator elsewhere than its base does: the row "
        f"draws from it outside DepthMode.params (after the backbone?), so what draws next is "
        f"not paired")


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_a_learned_row_learns(variant):
    """Every parameter the variant adds to attention (a learned row's depth_params, LIMe's routers)
    is trainable (a buffer, or requires_grad=False, never trains; a learned row adds one), the
    loss's gradient reaches one of them at least from their init (a gate's first layer follows
    once its zeroed last one moves), and a few Adam steps of them alone (the backbone
    frozen) move every one of them and the depth weights (the logits, where the variant records
    none): a row that cannot leave its base by gradient fails here, by name. A row's weights stay
    finite with its parameters at zero."""
    row = DEPTH_MODES[VARIANTS[variant]["depth_mode"]]
    model = fresh(variant)
    rows = [m.depth_params for m in model.modules()
            if isinstance(getattr(m, "depth_params", None), nn.Module)]
    buffers = [n for r in rows for n, b in r.named_buffers() if b.is_floating_point()]
    added = [n for n in added_parameters(model) if ".self_attn." in n]
    frozen = [n for n in added if not model.get_parameter(n).requires_grad]
    names = [n for n in added if n not in frozen]
    assert not buffers and not frozen and (names or not (rows or row.starts_as)), (
        f"{variant}: the learned row adds no trainable parameter, " + (
            f"its {buffers[:2]} are buffers: register them as nn.Parameter" if buffers else
            f"{frozen[:2]} have requires_grad=False" if frozen else "none at all") +
        "; nothing the optimizer sees can move it from its base")
    if not names:
        return
    params = [model.get_parameter(n) for n in names]
    idx = torch.randint(0, 257, (2, 8))
    model(idx, idx)[1].backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in params), (
        f"{variant}: no gradient reaches {names[:3]} from the loss at initialisation, so training "
        f"never moves them from their base: every layer of the row zeroed, or its input detached?")
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    before = [p.detach().clone() for p in params]
    with torch.no_grad(), capture(model) as start:
        logits = model(idx)[0]
    optimizer = torch.optim.Adam(params, lr=1e-2)  # no decay: a parameter moves by its gradient
    for _ in range(3):
        optimizer.zero_grad()
        model(idx, idx)[1].backward()
        optimizer.step()
    still = [n for n, p, b in zip(names, params, before) if torch.equal(p, b)]
    with torch.no_grad(), capture(model) as end:
        moved = not torch.equal(logits, model(idx)[0])
    moved = any(not torch.equal(start[e][1], end[e][1]) for e in start) if start else moved
    assert not still and moved, (f"{variant}: 3 Adam steps of its own parameters left "
                                 f"{still[:3] or 'its depth weights'} where they started")
    with torch.no_grad(), capture(model) as alphas:
        for p in (p for r in rows for p in r.parameters()):
            p.zero_()
        finite = torch.isfinite(model(idx)[0]).all()
    assert finite and all(torch.isfinite(a).all() for _, a in alphas.values()), (
        f"{variant}: with its parameters at zero the depth weights are not finite: a temperature "
        f"that nothing keeps positive? (exp of a parameter, as docs/forking.md's tempered)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_meets_every_source_rule(variant):
    """Its source rule, unlooped and looped 2 and 3 times, is the one the reference restates in
    effective layers (reference_sources), and the looped model matches its naive reference: a
    rule counted in blocks (e % n_layer) is right unlooped only. A row (not only value) runs so at
    every source case of SOURCE_CASES too, looped twice (whose first n_layer effective layers are
    the unlooped model's): a row that finds its candidates' layers itself (range(0, e, stride))
    rather than from config.sources(e) departs from its reference there."""
    keys = VARIANTS[variant]
    if keys.get("residual") is not None or not DEPTH_MODES[keys["depth_mode"]].mixes:
        return  # one pass over the layers (a baseline), or no sources
    cases = [("its own sources", {}, (1, 2, 3))]
    if variant == keys["depth_mode"]:  # a row's own variant; value+<rule> counts the rule's sources
        cases += [(f"SOURCE_CASES[{name!r}]", case, (2,)) for name, case in SOURCE_CASES.items()
                  if {**keys, **case} not in VARIANTS.values()]  # else a variant of its own
    for case, extra, each in cases:
        for loops in each:
            model = tiny_variant(dtype=torch.float64, vocab_size=257,
                                 **{**keys, **extra, "n_loops": loops})
            c = model.config
            want = [reference.reference_sources(c, e) for e in range(c.n_eff_layer)]
            assert model.depth_sources == want, (
                f"{variant} with n_loops={loops}: sources {model.depth_sources}, the rule in "
                f"effective layers gives {want}: counted in blocks (e % n_layer), not effective "
                f"layers?")
            if loops == 1:
                continue
            try:
                assert_matches_reference(model.eval(), REFERENCES[variant], idx_shape=(1, 4))
            except Exception as err:
                raise AssertionError(
                    f"{variant} at {case}, n_loops={loops}: {type(err).__name__}: {err}" + (
                        "; does the row find its candidates' layers itself (range(0, e, "
                        "stride)) rather than from config.sources(e)?" if extra else "")) from err


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_weighs_a_candidate_by_the_layer_it_reads(variant):
    """Dropping the first source of a layer with two or more leaves the other candidates' weights
    in the same proportions: a candidate's weight follows the layer it reads (a learned row's
    per-layer parameter looked up by config.sources(e) + [e]), never its slot, whose layer changes
    from one depth to the next. (Rows whose weights are meant to read the whole set, a
    temperature of the number of candidates say, are exempt by name: EXEMPT.)"""
    def weighed(**sources):  # the model, its depth weights, its layers with two sources or more
        model = build(variant, **sources)
        with torch.no_grad(), capture(model) as alphas:
            model(idx)
        return model, alphas, [e for e, (src, _) in alphas.items() if len(src) >= 2]
    idx, sources = torch.randint(0, 257, (2, 6)), {}
    model, alphas, several = weighed()
    if alphas and not several:  # one source a layer (ResFormer's rows): every earlier layer's
        sources = SOURCE_CASES["every-layer"]
        model, alphas, several = weighed(**sources)
    if not several:
        return  # no depth weights of a row (LIMe, the hidden-state baselines)
    e, rule = several[-1], ModelConfig.sources
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelConfig, "sources", lambda c, j: rule(c, j)[1:] if j == e else rule(c, j))
        fewer = build(variant, **sources)
        fewer.load_state_dict(model.state_dict())
        with torch.no_grad(), capture(fewer) as rest:
            fewer(idx)
    a, b = alphas[e][1][:, :, 1:], rest[e][1]
    diff = (b * a.sum(2, keepdim=True) - a * b.sum(2, keepdim=True)).abs().max().item()
    assert diff < 1e-9, (
        f"{variant}: without source {alphas[e][0][0]} of layer {e}, the other candidates' weights "
        f"change proportions ({diff:.3e}): a per-layer parameter looked up by the candidate's slot, "
        f"not the layer it reads (config.sources(e) + [e])? A rule meant to read the whole set "
        f"takes an EXEMPT entry")


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_depth_weights_are_candidates_first_in_float32(variant):
    """Every layer's depth weights, from bf16 inputs (what CUDA's autocast gives them), are
    (B, n_kv_head, C, T), candidates before positions, in float32, no narrower (bf16 weights sum
    to 1 +- 3e-3; the paper's are float32) and no wider (float64 costs twice and departs from its
    base at init); under bf16 autocast the logits are finite."""
    model = build(variant, torch.float32)
    for e, alpha in row_weights(model, model.config.n_kv_head, torch.bfloat16).items():
        want = (2, model.config.n_kv_head, len(model.depth_sources[e]) + 1,
                model.config.n_eff_layer + 1)
        assert alpha.shape == want, (f"{variant}: layer {e}'s depth weights are "
                                     f"{tuple(alpha.shape)}, want (B, n_kv_head, C, T) = {want}: "
                                     f"candidates before positions")
        assert alpha.dtype == torch.float32, (
            f"{variant}: layer {e}'s depth weights in {alpha.dtype}; compute them in float32 "
            f"(fp32_or_wider)" + (", no wider: float64 costs twice the bytes and departs from "
                                  "its base at init" if alpha.dtype.itemsize > 4 else ""))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), capture(model) as alphas:
        logits = model(torch.randint(0, 257, (2, 6)))[0]
    narrow = {e: a.dtype for e, (_, a) in alphas.items() if a.dtype.itemsize < 4}
    assert not narrow and torch.isfinite(logits).all(), f"{variant}: depth weights in {narrow}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_contract_declares_its_optimizer_groups(variant):
    """Prints the group train.py's optimizer puts each parameter the variant adds in, and refuses
    weight decay on a 1-D parameter (a bias, a gain, a scalar) unless its module says it is meant
    (`decays_vectors = True`)."""
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


DEFAULTS = {k: key.default for k, key in train.KEYS.items()}  # train.py's optimizer keys
CLAUSES = [test_contract_has_a_naive_reference, test_contract_matches_its_naive_reference,
           test_contract_cached_decoding_equals_the_full_forward, test_contract_is_causal,
           test_contract_keeps_the_sequences_of_a_batch_apart,
           test_contract_registers_trains_and_saves_every_added_parameter,
           test_contract_kv_cache_is_vanillas,
           test_contract_round_trips_through_a_checkpoint_and_an_export,
           test_contract_is_the_same_model_in_a_fresh_process,
           test_contract_compiles_in_one_graph, test_contract_a_learned_row_starts_as_its_base,
           test_contract_a_learned_row_learns, test_contract_meets_every_source_rule,
           test_contract_weighs_a_candidate_by_the_layer_it_reads,
           test_contract_depth_weights_are_candidates_first_in_float32,
           test_contract_declares_its_optimizer_groups]


def test_every_clause_and_exemption_is_listed():
    """The forking examples run CLAUSES, so every test_contract_* is one; an exemption names a
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
    """docs/forking.md's section `## <heading>`: {file: the body of its block for that file} for
    model.py, baselines.py and tests/reference.py."""
    doc = (ROOT / "docs" / "forking.md").read_text()
    text = doc[doc.index(f"\n## {heading}"):]
    text = text[:text.find("\n## ", 1) % (len(text) + 1)]
    return {name: blocks[0] for name in ("model.py", "baselines.py", "tests/reference.py")
            if (blocks := code_blocks(text, name))}


def export_fork(monkeypatch, **forks):
    """Exports write the fork's files ({module name: its text}) in place of ours, their imports of
    one another made relative as lab/export.py makes ours."""
    from lab import export
    write = export.write_remote_code

    def write_fork(folder):
        write(folder)
        for name, text in forks.items():
            (folder / f"{name}.py").write_text(re.sub(r"^( *)from (model|baselines) import ",
                                                      r"\1from .\2 import ", text, flags=re.M))
    monkeypatch.setattr(export, "write_remote_code", write_fork)


TABLES = (DEPTH_MODES, DEPTH_MODELS, REFERENCE_MODES, MODEL_REFERENCES, SOURCE_CASES)


def fork(monkeypatch, blocks) -> str:
    """A fork's blocks ({file: code}, as example gives them) registered as a fork writes them: the
    model.py block right after DEPTH_MODES, the baselines.py block after DEPTH_MODELS (so in an
    export and a fresh process too: FORKED), the reference in tests/reference.py; what they add
    is undone at the test's end. The variant of the row it adds (its name)."""
    before = [set(table) for table in TABLES]
    for file, module, table, end in (("model", model_py, "DEPTH_MODES = {", "\n}\n"),
                                     ("baselines", baselines, "DEPTH_MODELS = ", "\n")):
        if code := blocks.get(f"{file}.py"):
            space = vars(module)
            ours = dict(space)
            exec(code, space)  # in the module itself, as in the fork's file (torch.compile reads it)
            for key in [k for k in space if k not in ours or space[k] is not ours[k]]:
                forked = space.pop(key)
                space.update({key: ours[key]} if key in ours else {})
                monkeypatch.setattr(module, key, forked, raising=False)  # undone at the end
            monkeypatch.setitem(FORKED, file, FORKED.get(file, "") + code)
            source = Path(module.__file__).read_text()
            at = source.index(end, source.index(table)) + len(end)
            export_fork(monkeypatch, **{file: source[:at] + "\n" + FORKED[file] + source[at:]})
    exec(blocks["tests/reference.py"], dict(vars(reference)))
    for table, keys in zip(TABLES, before):
        for key in set(table) - keys:  # undone by monkeypatch
            monkeypatch.setitem(table, key, table.pop(key))
    (name,) = set(DEPTH_MODES) - before[0]
    monkeypatch.setitem(VARIANTS, name, dict(depth_mode=name))
    monkeypatch.setitem(REFERENCES, name, MODEL_REFERENCES.get(name, reference_forward))
    monkeypatch.setitem(RELOADED, name, None)  # reloaded with the forks registered beside it
    return name


TOP1, TEMPERED, GATED, HIDDEN = ("The example: hard top-1 over depth",
                                 "A learned rule: a temperature per layer",
                                 "What a row sees: a rule of the token's own features",
                                 "A rule of the hidden state")


@pytest.fixture
def forking_example(monkeypatch):
    return fork(monkeypatch, example(TOP1))


@pytest.fixture
def source_example(monkeypatch):
    """A new source rule as a fork writes it: ModelConfig.sources replaced in model.py (and in the
    exported model.py), reference_sources in tests/reference.py with the keys that select the
    rule in SOURCE_CASES. The contract's name for it."""
    blocks = example("A source rule")
    method = blocks["model.py"].split("\n", 1)[1]  # under the fence line, indented as in the class
    space = dict(vars(model_py))
    exec(textwrap.dedent(method), space)
    monkeypatch.setattr(model_py.ModelConfig, "sources", space["sources"])
    monkeypatch.setitem(FORKED, "model", textwrap.dedent(method) + "ModelConfig.sources = sources\n")
    before, space = set(SOURCE_CASES), dict(vars(reference))
    exec(blocks["tests/reference.py"], space)
    monkeypatch.setattr(reference, "reference_sources", space["reference_sources"])
    (rule,) = set(SOURCE_CASES) - before
    monkeypatch.setitem(SOURCE_CASES, rule, SOURCE_CASES.pop(rule))
    source = (ROOT / "model.py").read_text()
    start = source.index("    def sources(self, e: int)")
    export_fork(monkeypatch, model=source[:start] + method.rstrip() +
                source[source.index("\n\n\n", start):])
    name = f"value+{rule}"
    monkeypatch.setitem(VARIANTS, name, dict(depth_mode="value", **SOURCE_CASES[rule]))
    monkeypatch.setitem(REFERENCES, name, reference_forward)
    monkeypatch.setitem(RELOADED, name, None)
    return name


def call(clause, variant, tmp_path, monkeypatch):
    """A clause of the contract on the variant, given what it takes of tmp_path and monkeypatch."""
    kwargs = {"tmp_path": tmp_path / clause.__name__, "monkeypatch": monkeypatch}
    kwargs["tmp_path"].mkdir()
    clause(variant, **{k: v for k, v in kwargs.items()
                       if k in clause.__code__.co_varnames[:clause.__code__.co_argcount]})


def run_every_clause(variant, tmp_path, monkeypatch):
    for clause in CLAUSES:
        call(clause, variant, tmp_path, monkeypatch)


def test_the_guides_rows_pass_the_whole_contract(tmp_path, monkeypatch):
    """docs/forking.md's rows, registered together as a fork writes them (one fresh process
    reloads them all): top-1, the temperature, the gate of the token's own features and the gate of
    the hidden state, each through every clause (so the gates start paired with value at one seed
    and learn); then what the page says of the temperature and of the hidden state's gate."""
    rows = [fork(monkeypatch, example(heading)) for heading in (TOP1, TEMPERED, GATED, HIDDEN)]
    for row in rows:
        (tmp_path / row).mkdir()
        run_every_clause(row, tmp_path / row, monkeypatch)
    _, tempered, _, hidden = rows
    # the temperature: its parameter in the model and in the no-decay group (one number per
    # block), its weights read out as any row's, its parameters counted by depth_cost
    model = tiny_variant(depth_mode=tempered)
    names = added_parameters(model)
    assert names and all(".self_attn.depth_params." in n for n in names), names
    groups = train.make_optimizer(model, DEFAULTS, "cpu").param_groups
    assert {id(model.get_parameter(n)) for n in names} <= {id(p) for p in groups[1]["params"]}
    with capture(model) as alphas:
        model(torch.randint(0, 50, (2, 7)))
    assert sorted(alphas) == [e for e, src in enumerate(model.depth_sources) if src]
    assert depth_cost(model.config)["extra_params"] == sum(
        model.get_parameter(n).numel() for n in names)
    # the hidden state's gate: its own model class, and weights that move with the layer's input
    model = build(hidden)
    assert type(model) is DEPTH_MODELS[hidden] and type(model) is not model_py.GPT
    at, g = model.layers[1].self_attn, torch.Generator().manual_seed(0)
    qbar, k0, k1 = (torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    h = torch.randn(2, 1, 3, model.config.n_embd, generator=g, dtype=torch.float64)
    a, b = (at.mode.weights(qbar, [k0, k1], at.depth_params, 1, x) for x in h)
    assert (a - b).abs().max() > 1e-3


def test_a_rows_features_are_the_ones_rope_keeps():
    """What the guide says a row sees: qbar after RoPE, turned with the position, so a Linear of
    one token's qbar differs from position to position, and the norm of each rotated pair (the
    gated example's features) does not."""
    qbar = torch.randn(2, 2, 1, 8, dtype=torch.float64).expand(2, 2, 6, 8)  # one token, 6 places
    cos, sin = rope_tables(tiny_config(), 0, 6, "cpu", torch.float64)
    rotated = apply_rope(qbar, cos, sin)
    pairs = rotated.unflatten(-1, (2, -1)).norm(dim=-2)                       # (B, n_kv, T, D/2)
    linear = rotated @ torch.randn(8, 3, dtype=torch.float64)
    assert (pairs - pairs[:, :, :1]).abs().max() < 1e-12
    assert (linear - linear[:, :, :1]).abs().max() > 1e-2


# a fork's sharing by hand, the wrong way: one Parameter in every block's own module
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
    shared between modules (a module held by every block stays one), and the round trip names
    it."""
    planted = plant(model_py.softmax_weights, ref=biased_ref)  # the row itself: below
    exec(SHARED_PARAMETER, dict(vars(model_py)))
    export_fork(monkeypatch, model=(ROOT / "model.py").read_text() + SHARED_PARAMETER)
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
    the row starts as value, and learns (its first layer's gradient comes once the last moves).
    Re-drawn (as GPT.__init__ once re-drew every Linear), it does not start so, and the clause
    names it."""
    planted = plant(shifted_weights, dict(params=ZeroInitMLP, starts_as="value"))
    test_contract_a_learned_row_starts_as_its_base(planted)
    test_contract_a_learned_row_learns(planted)
    init = model_py.GPT.__init__

    def redraw_the_rows(self, config):
        init(self, config)
        for attention in self.modules():
            if isinstance(getattr(attention, "depth_params", None), nn.Module):
                attention.depth_params.apply(self._init_weights)
    monkeypatch.setattr(model_py.GPT, "__init__", redraw_the_rows)
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


def biased_ref(qbar, cand_k, params, layers):
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

    def ref(qbar, cand_k, params, layers):
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
        test_contract_meets_every_source_rule("value+every-layer")


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
    with pytest.raises(AssertionError, match="in torch.bfloat16; compute them in float32"):
        test_contract_depth_weights_are_candidates_first_in_float32(planted)


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

    with pytest.raises(AssertionError, match="candidates before positions"):
        test_contract_depth_weights_are_candidates_first_in_float32(plant(weights))
    with pytest.raises(AssertionError, match="(?s)T = C = 2.*candidates before positions"):
        test_contract_matches_its_naive_reference(plant(weights, n_layer=2, depth_stride=1))


def test_the_contract_names_a_rule_that_mixes_the_batch(plant):
    def weights(qbar, keys):  # centred over the batch: each sequence's weights read the others
        return model_py.softmax_weights(qbar - qbar.mean(0, keepdim=True), keys)

    with pytest.raises(AssertionError, match="mixes the batch"):
        test_contract_keeps_the_sequences_of_a_batch_apart(plant(weights))


# A forker's mistakes in a copy of the guide's rows, each of which passed the contract or failed it
# under another name (a crash, the init or the layout blamed): the edits that plant it in the row
# (and in its reference, where the forker got both wrong alike), what else it needs, and the
# clauses that now name it.
ZEROED, BONUS = "nn.init.zeros_(self.bonus.weight)", "gate.bonus(pairs)"
LINEAR = "self.bonus = nn.Linear(config.head_dim // 2, config.n_eff_layer, bias=False)"
MISTAKES = {
    "a buffer, not a Parameter": dict(
        row=[(ZEROED, 'del self.bonus.weight; self.bonus.register_buffer("weight", torch.zeros('
                      'config.n_eff_layer, config.head_dim // 2))')],
        named={test_contract_a_learned_row_learns: "are buffers: register them as nn.Parameter"}),
    "both layers of a two-layer gate zeroed": dict(
        row=[(ZEROED, ZEROED + "\n        self.hidden = nn.Linear(config.head_dim // 2, "
                               "config.head_dim // 2)\n        nn.init.zeros_(self.hidden.weight),"
                               " nn.init.zeros_(self.hidden.bias)"),
             (BONUS, "gate.bonus(gate.hidden(pairs).relu())")],
        reference=[("gate.bonus.weight @ pairs",
                    "gate.bonus.weight @ (gate.hidden.weight @ pairs + gate.hidden.bias).relu()")],
        named={test_contract_a_learned_row_learns: "no gradient reaches .* at initialisation"}),
    "its Linear drawn from the backbone's generator (model.py before the fork)": dict(
        setup=lambda patch: patch.setattr(torch.random, "fork_rng",
                                          lambda *a, **k: contextlib.nullcontext()),
        named={test_contract_a_learned_row_starts_as_its_base: "not paired with its base value"}),
    "a generator of its own, seeded by the time": dict(
        row=[(ZEROED, "nn.init.normal_(self.bonus.weight, generator=torch.Generator()"
                      ".manual_seed(__import__('time').time_ns()))")],
        named={test_contract_a_learned_row_starts_as_its_base: "two builds at one seed differ"}),
    "a setting read from the environment": dict(
        setup=lambda patch: patch.setenv("GATE_SCALE", "3"),
        row=[("+ bonus).softmax(2)",
              "+ bonus * float(__import__('os').environ.get('GATE_SCALE', '1'))).softmax(2)")],
        named={test_contract_is_the_same_model_in_a_fresh_process: "fresh process.*os.environ"}),
    "the bonus looked up by slot, in the code and its reference alike": dict(
        row=[("gate.layers[e]", "list(range(len(keys)))")],
        reference=[("zip(cand_k, layers)", "zip(cand_k, range(len(cand_k)))")],
        named={test_contract_weighs_a_candidate_by_the_layer_it_reads: "by the candidate's slot"}),
    "its sources recomputed as range(0, e, stride)": dict(
        row=[("config.sources(e) + [e]", "list(range(0, e, config.stride)) + [e]")],
        named={test_contract_meets_every_source_rule: r"window.*range\(0, e, stride\)"}),
    "a temperature that nothing keeps positive": dict(
        example=TEMPERED, row=[("torch.zeros(())", "torch.ones(())"),
                               ("params.log_tau.exp()", "params.log_tau")],
        reference=[("params.log_tau.exp()", "params.log_tau")],
        named={test_contract_a_learned_row_learns: "not finite: a temperature that nothing"}),
    "modules in a Python list": dict(
        row=[(LINEAR, LINEAR.replace("= nn.Linear", "= [nn.Linear") + "]"),
             ("self.bonus.weight", "self.bonus[0].weight"), (BONUS, "gate.bonus[0](pairs)")],
        reference=[("gate.bonus.weight", "gate.bonus[0].weight")],
        named={test_contract_matches_its_naive_reference: "bonus holds modules or tensors in a "
                                                          "plain list"}),
    "a shape of n_head, valid only as many KV heads": dict(
        row=[(ZEROED, ZEROED + "\n        self.gain = nn.Parameter(torch.ones(config.n_head, 1, "
                               "1))"), ("+ bonus)", "+ bonus * gate.gain)")],
        named={test_contract_matches_its_naive_reference: "a shape of n_head where qbar has one "
                                                          "head per KV group"}),
    "float64 weights, for safety": dict(
        row=[(".softmax(2)", ".double().softmax(2)")],
        named={test_contract_depth_weights_are_candidates_first_in_float32: "in torch.float64; "
               "compute them in float32 .*no wider",
               test_contract_a_learned_row_starts_as_its_base: "depth weights are {torch.float64}"}),
    "a detached input": dict(
        row=[("fp32_or_wider(qbar).unflatten", "fp32_or_wider(qbar.detach()).unflatten")],
        named={test_contract_matches_its_naive_reference: r"(?s)^(?!.*laid out).*logits agree.*"
                                                          r"detach"}),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_the_contract_names_a_forkers_mistake(mistake, tmp_path, monkeypatch):
    """The mistake planted in a copy of the guide's row (the gated example, unless it is another
    row's): each clause that names it fails, with its name."""
    plant = MISTAKES[mistake]
    plant.get("setup", lambda patch: None)(monkeypatch)
    blocks = example(plant.get("example", GATED))
    for file, edits in (("model.py", plant.get("row", ())),
                        ("tests/reference.py", plant.get("reference", ()))):
        for old, new in edits:
            assert old in blocks[file], f"the guide's row no longer has {old!r}"
            blocks[file] = blocks[file].replace(old, new)
    variant = fork(monkeypatch, blocks)
    for clause, words in plant["named"].items():
        with pytest.raises(AssertionError, match=words):
            call(clause, variant, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- a seam

def test_a_rule_of_the_layer_and_the_depth_needs_no_module(plant):
    """DepthMode.params may hand the weights any value, here the config: the sources' share grows
    with e / n_eff_layer. No parameter is added; the rule runs looped and cached like any row's."""
    def weights(qbar, keys, config, e):
        share = e / config.n_eff_layer
        w = qbar.new_tensor([share] * (len(keys) - 1) + [1.0], dtype=torch.float64)
        B, n_kv, T, _ = qbar.shape
        return (w / w.sum()).to(model_py.fp32_or_wider(qbar).dtype).view(1, 1, -1, 1).expand(
            B, n_kv, len(keys), T)

    def ref(qbar, cand_k, config, layers):
        w = [layers[-1] / config.n_eff_layer] * (len(cand_k) - 1) + [1.0]
        return [x / sum(w) for x in w]

    planted = plant(weights, dict(params=lambda config, layer: config), ref)
    assert not added_parameters(build(planted))
    for clause in (test_contract_matches_its_naive_reference, test_contract_meets_every_source_rule,
                   test_contract_cached_decoding_equals_the_full_forward,
                   test_contract_depth_weights_are_candidates_first_in_float32):
        clause(planted)




# ----------------------------------------------------------------------------- the paper's rows

def test_k_norm_order_matters():
    """The two orders differ only through k_norm's weight (RoPE keeps the RMS): with trained-like
    weights the difference is large, so the released model in the wrong order cannot pass."""
    idx = torch.randint(0, 50, (2, 9))
    before = tiny_model(dtype=torch.float64)
    after = tiny_model(dtype=torch.float64, k_norm_after_rope=True)
    after.load_state_dict(before.state_dict())
    diff = (before(idx)[0] - after(idx)[0]).abs().max().item()
    assert diff > 1e-2, f"k_norm before and after RoPE give nearly the same logits ({diff:.3e})"
    wrong = (reference_forward(after, idx, k_norm_after_rope=False) - after(idx)[0]).abs().max()
    assert wrong > 1e-2, f"the reference cannot tell the orders apart ({wrong:.3e})"


@pytest.mark.parametrize("mode", [m for m in DEPTH_MODES if DEPTH_MODES[m].mixes])
def test_depth_modes_change_the_output(mode):
    """The reference tests would pass trivially if the depth step did nothing: check it does."""
    idx = torch.randint(0, 50, (2, 9))
    base, _ = tiny_model(depth_mode="vanilla")(idx)
    out, _ = tiny_model(depth_mode=mode)(idx)
    assert (out - base).abs().max() > 1e-2, f"{mode} gives the same logits as vanilla"


@pytest.mark.parametrize("mode", DEPTH_MODES)
def test_cache_holds_exactly_the_records(mode):
    """Each slot holds the mixed K or V where the mode's row mixes it, the raw one elsewhere."""
    model = tiny_model(depth_mode=mode).eval()
    row = DEPTH_MODES[mode]
    idx = torch.randint(0, 50, (2, 6))
    raw = {}  # layer -> its attention input, to recompute the raw k and v
    hooks = [blk.self_attn.register_forward_pre_hook(
        lambda mod, args, i=i: raw.__setitem__(i, args[0])) for i, blk in enumerate(model.layers)]
    cache = model.new_cache(2, 6)
    cos, sin = rope_tables(model.config, 0, 6, "cpu", torch.float32)
    with torch.no_grad():
        model(idx, cache=cache)
        for e, blk in enumerate(model.layers):
            at, h = blk.self_attn, raw[e]
            k = apply_rope(at.k_norm(at.k_proj(h).view(2, 6, 2, 8)).transpose(1, 2), cos, sin)
            v = at.v_proj(h).view(2, 6, 2, 8).transpose(1, 2)
            mixed_k, mixed_v = row.mixes_k and e > 0, row.mixes_v and e > 0
            assert torch.allclose(cache.k[e], k, atol=1e-6) != mixed_k, f"layer {e} K slot, {mode}"
            assert torch.allclose(cache.v[e], v, atol=1e-6) != mixed_v, f"layer {e} V slot, {mode}"
    for hk in hooks:
        hk.remove()


@pytest.mark.parametrize("mode", [m for m in DEPTH_MODES if DEPTH_MODES[m].decode_kernel])
@pytest.mark.parametrize("n_kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_decode_kernel_equals_the_per_candidate_passes(mode, n_kv):
    """A decode step of a row that opts in mixes with one SDPA call over the candidates
    (depth_mix_one); the plain path with one pass per candidate. Both compute the same mix."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v, *src = (torch.randn(3, n_kv, 1, 8, generator=g, dtype=torch.float64) for _ in range(6))
    fused = depth_mix_one(q, k, v, src[:2], src[2:], DEPTH_MODES[mode])
    passes = depth_mix(q, k, v, src[:2], src[2:], DEPTH_MODES[mode])
    assert len(fused) == 2 and passes[2].shape == (3, n_kv, 3, 1)
    for a, b in zip(fused, passes[:2]):
        assert (a - b).abs().max() < 1e-12


def test_only_the_softmax_may_opt_in_to_the_decode_kernel():
    """The kernel is softmax_weights' mix: a row with other weights that asked for it would decode
    with the softmax, silently; it is refused where the row is made."""
    from model import DepthMode, uniform_weights
    with pytest.raises(ValueError, match="decode_kernel is softmax_weights' mix"):
        DepthMode(uniform_weights, mixes_v=True, decode_kernel=True)


@pytest.mark.parametrize("overrides", [dict(depth_mode="vanilla"), dict(depth_mode="value"),
                                       dict(depth_mode="kv"), dict(n_loops=2, depth_stride=3),
                                       dict(depth_mode="lime", depth_stride=None)], ids=str)
def test_attention_takes_no_mask_in_training_prefill_and_decode(overrides):
    """Every scaled_dot_product_attention call of a training forward, a prefill into an empty cache
    and a decode step is is_causal or unmasked (what FlashAttention serves on a GPU); only a chunk
    continuing a filled cache passes a mask, the lower-right causal bias (no T x S tensor)."""
    from torch.nn.attention.bias import CausalBias
    from torch.overrides import TorchFunctionMode
    sdpa, calls = F.scaled_dot_product_attention, []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:  # (query length, key length, attn_mask, is_causal)
                calls.append((args[0].shape[-2], args[1].shape[-2], kwargs.get("attn_mask"),
                              kwargs.get("is_causal")))
            return func(*args, **kwargs)

    model = tiny_model(**overrides)
    idx = torch.randint(0, 50, (2, 9))
    with Record():
        model(idx, targets=idx)[1].backward()
        cache = model.new_cache(2, 9)
        with torch.no_grad():
            for chunk in (idx[:, :5], idx[:, 5:6]):  # a prefill into the empty cache, a decode step
                model(chunk, cache=cache)
    n_layers = model.config.n_eff_layer
    sequence = [c for c in calls if c[0] == c[1]]  # attention over positions (the depth step has
    assert len(sequence) >= 2 * n_layers and all(c[3] for c in sequence if c[0] > 1)  # no mask)
    assert all(c[2] is None for c in calls), [c for c in calls if c[2] is not None][:1]
    calls.clear()
    with Record(), torch.no_grad():
        model(idx[:, 6:9], cache=cache)  # a chunk of 3 continuing 6 cached positions
    masks = [c[2] for c in calls if c[2] is not None]
    assert len(masks) == n_layers and all(isinstance(m, CausalBias) for m in masks)


def test_generate_greedy_matches_full_forward_argmax():
    model = tiny_model(depth_mode="value").eval()
    prompt = torch.randint(0, 50, (2, 4))
    out = model.generate(prompt, 10, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    assert torch.equal(model.generate(prompt, 10, temperature=1.0, top_k=1), seq)


def test_generate_top_k_samples_only_from_the_top_k():
    model = tiny_model().eval()
    prompt = torch.randint(0, 50, (1, 3))
    with torch.no_grad():
        top = model(prompt)[0][0, -1].topk(3).indices
    gen = torch.Generator().manual_seed(0)
    firsts = {model.generate(prompt, 1, temperature=2.0, top_k=3, generator=gen)[0, -1].item()
              for _ in range(40)}
    assert firsts <= set(top.tolist()) and len(firsts) > 1


# ----------------------------------------------------------------------------- parity across modes

def test_same_parameter_count_for_every_mode():
    """Every mode has vanilla's weights; all it adds are its own (a learned row's depth_params,
    counted by depth_cost; LIMe's routers, counted in tests/test_baselines.py)."""
    vanilla = build_model(asdict(tiny_config(depth_mode="vanilla"))).num_params()
    for mode in DEPTH_MODES:
        model = tiny_model(depth_mode=mode)
        added = sum(model.get_parameter(name).numel() for name in added_parameters(model))
        assert model.num_params() - added == vanilla, f"{mode}: {model.num_params()} - {added}"
        if DEPTH_MODES[mode].params is not None:
            assert depth_cost(model.config)["extra_params"] == added, mode


def test_num_params_counts_tied_weights_once():
    c = tiny_config()
    untied, tied = GPT(c).num_params(), GPT(tiny_config(tie_embeddings=True)).num_params()
    assert untied - tied == c.vocab_size * c.n_embd


@pytest.mark.parametrize("mode", MIXING)
def test_depth_weights_readout(mode):
    model = tiny_model(depth_mode=mode, n_layer=5, depth_stride=2)
    row = DEPTH_MODES[mode]  # a learned row's weights need not sum to one (ResFormer's lambdas)
    uniform, learned = row.weights is uniform_weights, row.params is not None
    idx = torch.randint(0, 50, (2, 6))
    with capture(model) as alphas:
        model(idx)
        with torch.no_grad():  # a decode step's weights come from the plain path meanwhile
            cache = model.new_cache(2, 6)
            model(idx[:, :5], cache=cache)
            model(idx[:, 5:], cache=cache)
    assert all(m.weights_sink is None for m in model.modules() if hasattr(m, "weights_sink"))
    assert sorted(alphas) == [1, 2, 3, 4]
    for e, (src, a) in alphas.items():
        assert src == model.config.sources(e) and a.shape == (2, 2, len(src) + 1, 1)
        assert learned or torch.allclose(a.sum(2), torch.ones(()))
        if uniform:
            assert torch.equal(a, torch.full_like(a, 1.0 / (len(src) + 1)))
    with capture(model) as alphas:
        model(idx)
    want = {}
    reference_forward(model, idx, weights=want)
    for e, (src, a) in alphas.items():  # each layer's own weights, row, position and KV head
        assert a.shape == (2, 2, len(src) + 1, 6)  # (B, n_kv_head, C, T), as depth_mix computes
        for b, t, j in itertools.product(range(2), range(6), range(2)):
            assert torch.allclose(a[b, j, :, t], want[e, b, t, j].float(), atol=1e-5), (e, b, t, j)
        assert uniform or learned or a.std() > 1e-3, "a random model's weights are not uniform"
    model(idx)
    assert len(alphas) == 4, "nothing is collected outside the context"


# ----------------------------------------------------------------------------- source rule and costs

def test_source_rule_worked_counts():
    c48 = ModelConfig(n_layer=48, depth_stride=24)
    assert [c48.sources(e) for e in (1, 24, 25, 47)] == [[0], [0], [0, 24], [0, 24]]
    assert sum(len(c48.sources(e)) + 1 for e in range(1, 48)) == 117
    assert ModelConfig(n_layer=48).stride == 24  # the default is half-depth
    c4 = ModelConfig(n_layer=4, depth_stride=2)
    assert [c4.sources(e) for e in range(4)] == [[], [0], [0], [0, 2]]
    cw = ModelConfig(n_layer=8, depth_stride=4, depth_recent_window=2)
    assert [cw.sources(e) for e in range(8)] == [[], [0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 3, 4],
                                                 [0, 4, 5], [0, 4, 5, 6]]
    assert ModelConfig(n_layer=5, depth_stride=1).sources(4) == [0, 1, 2, 3]
    assert ModelConfig(n_layer=5, depth_stride=9).sources(4) == [0]
    looped = ModelConfig(n_layer=2, n_loops=3)  # effective depth 6, default stride 3
    assert [looped.sources(e) for e in range(6)] == [[], [0], [0], [0], [0, 3], [0, 3]]
    assert ModelConfig(depth_mode="vanilla").sources(5) == []


def test_analytic_cost_reproduces_table_2():
    paper_3b = ModelConfig(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32,
                           n_kv_head=8, head_dim=64, depth_stride=24)
    cost = depth_cost(paper_3b, bytes_per_element=2)
    assert cost["candidates"] == 117
    assert cost["flops_per_token"] == 4 * 512 * 117 and f"{cost['flops_per_token']:.2e}" == "2.40e+05"
    assert cost["io_bytes_per_token"] == 2 * (2 * 117 + 48) * 512
    assert round(cost["io_bytes_per_token"] / 1024) == 282
    assert cost["extra_persistent_bytes"] == cost["extra_params"] == 0
    assert depth_cost(ModelConfig(depth_mode="vanilla"))["flops_per_token"] == 0
    uniform, key, kv = (depth_cost(ModelConfig(**{**vars(paper_3b), "depth_mode": m}))
                        for m in ("uniform", "key", "kv"))
    # Uniform Mix: the mix alone, reading V; key: scores and mix read K alone; kv: both mixed
    assert (uniform["flops_per_token"], uniform["io_bytes_per_token"]) == (2 * 512 * 117, 2 * 165 * 512)
    assert (key["flops_per_token"], key["io_bytes_per_token"]) == (4 * 512 * 117, 2 * 165 * 512)
    assert (kv["flops_per_token"], kv["io_bytes_per_token"]) == (6 * 512 * 117, 2 * 330 * 512)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("overrides, fragment", [
    (dict(n_head=6, n_kv_head=4), "multiple of n_kv_head"),
    (dict(depth_stride=0), "depth_stride must be an integer >= 1"),
    (dict(depth_mode="values"), "choose one of " + ", ".join(DEPTH_MODES)),
    (dict(depth_recent_window=-1), "depth_recent_window"),
    (dict(n_loops=0), "n_loops must be a positive integer"),
    (dict(head_dim=7), "head_dim must be even"),
])
def test_bad_configs_raise_clear_errors(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        tiny_config(**overrides)


@pytest.mark.parametrize("row, fragment", [
    (dict(weights="softmax"), "weights exactly when it mixes"),
    (dict(mixes_v=True), "weights exactly when it mixes"),
    (dict(params=torch.nn.Module), "params are read by its weights")])
def test_a_row_that_describes_no_step_is_refused_where_it_is_made(row, fragment):
    from model import DepthMode, softmax_weights
    row = {k: softmax_weights if v == "softmax" else v for k, v in row.items()}
    with pytest.raises(ValueError, match=fragment):
        DepthMode(**row)


@pytest.mark.parametrize("rule, shown", [
    (lambda paper, self, e: paper(self, e) + [e] * (e > 0), r"sources\(1\) gives \[0, 1\]"),
    (lambda paper, self, e: paper(self, e) * 2, r"sources\(1\) gives \[0, 0\]"),
    (lambda paper, self, e: paper(self, e)[::-1], r"sources\(3\) gives \[2, 0\]")],
    ids=["the layer itself", "a source twice", "unsorted"])
def test_a_source_rule_that_reads_no_earlier_record_once_is_refused_by_name(monkeypatch, rule,
                                                                             shown):
    """A fork's rule naming the layer itself (a record not yet written), a source twice (two
    candidates of one record) or out of order is refused where the model is built, naming the
    rule. (Not the config: making one calls no rule, so a course copy's unwritten sources costs
    problem 1 alone.)"""
    from model import ConfigError
    paper = ModelConfig.sources
    monkeypatch.setattr(ModelConfig, "sources", lambda self, e: rule(paper, self, e))
    with pytest.raises(ConfigError, match=shown + r": earlier layers.*ModelConfig.sources"):
        tiny_model()


def test_too_long_inputs_raise_clear_errors():
    model = tiny_model()  # block_size 32
    with pytest.raises(ValueError, match="exceeds the context length"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="exceed the context length"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the context length"):
        KVCache(model.config, 1, 40)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="KV cache holds 4 tokens, 5 requested"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
