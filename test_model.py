"""The battery that makes model.py trustworthy: the naive reference straight from the paper's
equations (tests/reference.py) at many shapes, cached decoding against the full forward, causality,
parity across modes, the source rule, the paper's costs. tests/test_contract.py holds every variant
to one contract besides."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import added_parameters, tiny_config, tiny_model
from model import (DEPTH_MODES, GPT, KVCache, ModelConfig, apply_rope, depth_mix, depth_mix_one,
                   rope_tables, uniform_weights)
from support.cost import depth_cost
from support.depth_weights import capture
from reference import REFERENCE_MODES, assert_matches_reference, reference_forward

# ----------------------------------------------------------------------------- the naive reference
# tests/reference.py, written from the paper's equations, against the model at many shapes.

MODES = list(REFERENCE_MODES)  # the modes this reference describes; LIMe's is in tests/test_lime.py
MIXING = [m for m in MODES if REFERENCE_MODES[m]]
REFERENCE_CASES = (
    [dict(depth_mode=m, n_kv_head=kv) for m in MODES for kv in (4, 2, 1)]       # MHA, GQA, MQA
    + [dict(depth_mode=m, depth_stride=s) for m in MIXING for s in (1, 4, 9)]  # full, first only
    + [dict(depth_mode=m, depth_stride=3, depth_recent_window=2, n_layer=5) for m in MIXING]
    + [dict(depth_mode=m, n_layer=2, n_loops=2, depth_stride=None) for m in MODES]
    + [dict(depth_mode="value", qk_norm=False, tie_embeddings=True)]
    + [dict(depth_mode=m, k_norm_after_rope=True) for m in MODES]       # the released model's order
    + [dict(depth_mode="value", k_norm_after_rope=True, n_layer=2, n_loops=2, n_kv_head=1)]
)


@pytest.mark.parametrize("overrides", REFERENCE_CASES,
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_matches_naive_reference_logits_and_gradients(overrides):
    assert_matches_reference(tiny_model(dtype=torch.float64, **overrides), reference_forward)


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


# ----------------------------------------------------------------------------- the cache and kernels

CACHE_CASES = [dict(depth_mode="value", n_loops=2, depth_stride=None),
               dict(depth_mode="kv", n_loops=3, n_layer=2),
               dict(depth_mode="value", depth_stride=1, depth_recent_window=1, n_kv_head=1),
               dict(depth_mode="value", k_norm_after_rope=True)]


@pytest.mark.parametrize("overrides", CACHE_CASES, ids=str)
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), (3, 3, 3, 3, 2), (1,) * 14],
                         ids=["prefill+tokens", "chunks", "tokens"])
def test_cached_decoding_equals_full_forward(overrides, chunks):
    """Beyond the contract's one shape per variant: loops, a window with MQA, the k_norm order."""
    model = tiny_model(dtype=torch.float64, **overrides).eval()  # a bug cannot hide in rounding
    T = sum(chunks)
    idx = torch.randint(0, 50, (3, T))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(3, T + 2)  # a longer cache: unused slots must not leak in
        parts, start = [], 0
        for n in chunks:
            parts.append(model(idx[:, start:start + n], cache=cache)[0])
            start += n
    diff = (torch.cat(parts, 1) - full).abs().max().item()
    assert cache.pos == T
    assert diff < 1e-10, f"cached logits differ from the full forward by {diff:.3e}"


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


def test_compiles_in_one_graph_at_changing_lengths():
    """A training forward compiled with fullgraph at one length, then at others (torch.compile
    turns the length symbolic): is_causal stays a literal bool, so no graph break, eager's losses."""
    model = tiny_model(depth_mode="value")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    idx = torch.randint(0, 50, (2, 12))
    for T in (12, 9, 7):
        with torch.no_grad():
            assert abs(compiled(idx[:, :T], idx[:, :T])[1] - model(idx[:, :T], idx[:, :T])[1]) < 1e-6


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
    counted by depth_cost; LIMe's routers, counted in tests/test_lime.py)."""
    vanilla = GPT(tiny_config()).num_params()
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
        assert src == model.config.sources(e) and a.shape == (2, 2, 1, len(src) + 1)
        assert learned or torch.allclose(a.sum(-1), torch.ones(()))
        if uniform:
            assert torch.equal(a, torch.full_like(a, 1.0 / (len(src) + 1)))
    with capture(model) as alphas:
        model(idx)
    want = {}
    reference_forward(model, idx, weights=want)
    for e, (src, a) in alphas.items():  # each layer's own weights, row, position and KV head
        assert a.shape == (2, 2, 6, len(src) + 1)
        for b, t, j in itertools.product(range(2), range(6), range(2)):
            assert torch.allclose(a[b, j, t], want[e, b, t, j].float(), atol=1e-5), (e, b, t, j)
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
    (dict(weights="softmax"), "mixes neither K nor V"), (dict(mixes_v=True), "mixes without weights"),
    (dict(params=torch.nn.Module), "params are read by its weights")])
def test_a_row_that_describes_no_step_is_refused_where_it_is_made(row, fragment):
    from model import DepthMode, softmax_weights
    row = {k: softmax_weights if v == "softmax" else v for k, v in row.items()}
    with pytest.raises(ValueError, match=fragment):
        DepthMode(**row)


def test_a_source_at_or_after_the_layer_is_refused_by_name(monkeypatch):
    """A fork's rule that names the layer itself (or a later one) would read a record not yet
    written; the model refuses it where it is built, naming the rule. (Not the config: making one
    calls no rule, so a course copy's unwritten sources costs problem 1 alone.)"""
    from model import ConfigError
    paper = ModelConfig.sources
    monkeypatch.setattr(ModelConfig, "sources", lambda self, e: paper(self, e) + [e] * (e > 0))
    with pytest.raises(ConfigError, match=r"sources\(1\) gives \[1\].*ModelConfig.sources"):
        tiny_model()


def test_a_duplicate_or_unsorted_source_is_refused_by_name(monkeypatch):
    """Twice the same source would be two candidates of one record (and a KeyError in run_layers
    once its record is freed); the model refuses it where it is built, naming the rule."""
    from model import ConfigError
    paper = ModelConfig.sources
    for rule, shown in ((lambda self, e: paper(self, e) * 2, r"\[0, 0\]"),
                        (lambda self, e: paper(self, e)[::-1], r"\[2, 0\]")):
        monkeypatch.setattr(ModelConfig, "sources", rule)
        with pytest.raises(ConfigError, match=shown + r": each source once, ascending"):
            tiny_model()


def test_too_long_inputs_raise_clear_errors():
    model = tiny_model()  # block_size 32
    with pytest.raises(ValueError, match="exceeds the context length"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="exceeds the context length"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the context length"):
        KVCache(model.config, 1, 40)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="make a larger cache"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
