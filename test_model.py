"""The battery that makes model.py trustworthy: a naive reference straight from the paper's equations, cached
decoding against the full forward, causality, parity across modes, the source rule, the paper's costs."""
import math

import pytest
import torch

from conftest import tiny_config, tiny_model
from model import DEPTH_MODES, GPT, KVCache, ModelConfig, apply_rope, depth_cost, depth_mix, rope_tables

DEPTH_ONLY = [m for m in DEPTH_MODES if m != "vanilla"]
LIME = dict(depth_mode="lime", depth_stride=None)  # LIMe as published: every earlier layer (tiny_config's stride 2 off)


# ----------------------------------------------------------------------------- naive reference

def reference_forward(model: GPT, idx, k_norm_after_rope=None):
    """Logits computed with loops over rows, layers, positions and heads, from the paper's section 2 (and the Qwen3 block) alone.
    It shares only the parameter tensors with the model (so gradients can be compared). k_norm_after_rope: the
    order of k_norm and RoPE (default: the model's config), so a caller can state the order independently."""
    c = model.config
    if k_norm_after_rope is None:
        k_norm_after_rope = c.k_norm_after_rope
    H, Hkv, D = c.n_head, c.n_kv_head, c.head_dim
    g, L, lime = H // Hkv, c.n_layer * c.n_loops, c.depth_mode == "lime"
    stride = c.depth_stride if c.depth_stride is not None else (1 if lime else max(1, L // 2))  # LIMe: all layers

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.norm_eps) * w

    def rope(x, t):  # rotate the pairs (i, i + D/2) by t * theta^(-2i/D)
        i = torch.arange(D // 2, dtype=torch.float64)
        ang = (t * c.rope_theta ** (-2 * i / D)).to(x.dtype)
        x1, x2 = x[: D // 2], x[D // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])

    rows = []
    for b in range(idx.shape[0]):
        T = idx.shape[1]
        x = model.embed_tokens.weight[idx[b]]                              # (T, n_embd)
        stored = {}  # effective layer -> (K, V): lists over positions of lists over KV heads (LIMe: raw, (T, Hkv, D))
        for e in range(L):
            blk = model.layers[e % c.n_layer]
            at = blk.self_attn
            h = rms(x, blk.input_layernorm.weight)
            q = (h @ at.q_proj.weight.T).view(T, H, D)
            k = (h @ at.k_proj.weight.T).view(T, Hkv, D)
            v = (h @ at.v_proj.weight.T).view(T, Hkv, D)
            src = [] if (c.depth_mode == "vanilla" or e == 0) else sorted(
                {j for j in range(e) if j % stride == 0} | set(range(max(0, e - c.depth_recent_window), e)))
            raw = (k, v)
            if lime and src:  # LIMe: head r mixes every (candidate layer, head) with W[r, column], then k_norm, RoPE
                W, cands = at.lime_router[str(e)], [stored[s] for s in src] + [raw]
                k, v = (torch.stack([torch.stack([sum(W[r, ci * Hkv + r2] * cands[ci][kv][t, r2]
                                                      for ci in range(len(cands)) for r2 in range(Hkv))
                                                  for r in range(Hkv)]) for t in range(T)]) for kv in (0, 1))
            if c.qk_norm:
                q = rms(q, at.q_norm.weight)
            kn = (lambda x: rms(x, at.k_norm.weight)) if c.qk_norm else (lambda x: x)
            q = [[rope(q[t, i], t) for i in range(H)] for t in range(T)]
            if k_norm_after_rope:  # the authors' released Depth-Attention model
                k = [[kn(rope(k[t, j], t)) for j in range(Hkv)] for t in range(T)]
            else:                  # Qwen3: both norms before RoPE
                k = [[rope(kn(k[t, j]), t) for j in range(Hkv)] for t in range(T)]
            v = [[v[t, j] for j in range(Hkv)] for t in range(T)]
            K, V = [], []  # lime: k and v as they are (mixed above; the loop's modes leave them alone)
            for t in range(T):
                Kt, Vt = [], []
                for j in range(Hkv):
                    cand_k = [stored[s][0][t][j] for s in src] + [k[t][j]]
                    cand_v = [stored[s][1][t][j] for s in src] + [v[t][j]]
                    qbar = sum(q[t][j * g + i] for i in range(g)) / g
                    if c.depth_mode == "uniform":
                        alpha = [1.0 / len(cand_k)] * len(cand_k)
                    else:
                        s = torch.stack([(qbar * kk).sum() / math.sqrt(D) for kk in cand_k])
                        alpha = list(torch.softmax(s, 0))
                    mk = sum(a * kk for a, kk in zip(alpha, cand_k))
                    mv = sum(a * vv for a, vv in zip(alpha, cand_v))
                    Kt.append(mk if c.depth_mode in ("key", "kv") else k[t][j])
                    Vt.append(mv if c.depth_mode in ("value", "uniform", "kv") else v[t][j])
                K.append(Kt)
                V.append(Vt)
            stored[e] = raw if lime else (K, V)
            Kmat = [torch.stack([K[u][j] for u in range(T)]) for j in range(Hkv)]  # per KV head: (T, D)
            Vmat = [torch.stack([V[u][j] for u in range(T)]) for j in range(Hkv)]
            out = []
            for t in range(T):  # query head i reads KV head i // g over positions 0..t
                heads = [torch.softmax(Kmat[i // g][: t + 1] @ q[t][i] / math.sqrt(D), 0) @ Vmat[i // g][: t + 1]
                         for i in range(H)]
                out.append(torch.cat(heads))
            x = x + torch.stack(out) @ at.o_proj.weight.T
            h = rms(x, blk.post_attention_layernorm.weight)
            mlp = blk.mlp
            x = x + (torch.nn.functional.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        rows.append(rms(x, model.norm.weight) @ model.lm_head.weight.T)
    return torch.stack(rows)


REFERENCE_CASES = (
    [dict(depth_mode=m, n_kv_head=kv) for m in DEPTH_MODES for kv in (4, 2, 1)]       # MHA, GQA, MQA
    + [dict(depth_mode=m, depth_stride=s) for m in DEPTH_ONLY for s in (1, 4, 9)]   # full / first-layer-only
    + [dict(depth_mode=m, depth_stride=3, depth_recent_window=2, n_layer=5) for m in DEPTH_ONLY]
    + [dict(depth_mode=m, n_layer=2, n_loops=2, depth_stride=None) for m in DEPTH_MODES]
    + [dict(depth_mode="value", qk_norm=False, tie_embeddings=True)]
    + [dict(depth_mode=m, k_norm_after_rope=True) for m in DEPTH_MODES]                 # the released model's order
    + [dict(depth_mode="value", k_norm_after_rope=True, n_layer=2, n_loops=2, n_kv_head=1)]
    + [dict(LIME, n_kv_head=kv) for kv in (4, 2, 1)] + [dict(LIME, qk_norm=False, tie_embeddings=True)]
    + [dict(LIME, n_layer=2, n_loops=3, k_norm_after_rope=True)]
)


@pytest.mark.parametrize("overrides", REFERENCE_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_matches_naive_reference_logits_and_gradients(overrides):
    model = tiny_model(dtype=torch.float64, **overrides)
    idx = torch.randint(0, model.config.vocab_size, (2, 7))
    targets = torch.randint(0, model.config.vocab_size, (2, 7))
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = reference_forward(model, idx)
    torch.nn.functional.cross_entropy(ref.view(-1, ref.size(-1)), targets.view(-1)).backward()
    diff = (logits - ref).abs().max().item()
    assert diff < 1e-10, f"logits differ from the reference by {diff:.3e}"
    for n, p in model.named_parameters():
        gdiff = (grads[n] - p.grad).abs().max().item()
        assert gdiff < 1e-10, f"grad of {n} differs from the reference by {gdiff:.3e}"


def test_k_norm_order_matters():
    """The two orders differ only through k_norm's weight (RoPE keeps the RMS): with trained-like weights the
    difference is large, so loading the released model in the wrong order cannot pass the reference test."""
    idx = torch.randint(0, 50, (2, 9))
    before = tiny_model(dtype=torch.float64)
    after = tiny_model(dtype=torch.float64, k_norm_after_rope=True)
    after.load_state_dict(before.state_dict())
    diff = (before(idx)[0] - after(idx)[0]).abs().max().item()
    assert diff > 1e-2, f"k_norm before and after RoPE give nearly the same logits ({diff:.3e})"
    wrong = (reference_forward(after, idx, k_norm_after_rope=False) - after(idx)[0]).abs().max().item()
    assert wrong > 1e-2, f"the reference cannot tell the orders apart ({wrong:.3e})"


def test_depth_modes_change_the_output():
    """The reference tests would pass trivially if the depth step did nothing: check that it does."""
    idx = torch.randint(0, 50, (2, 9))
    base, _ = tiny_model(depth_mode="vanilla")(idx)
    for mode in DEPTH_ONLY:
        out, _ = tiny_model(depth_mode=mode)(idx)
        assert (out - base).abs().max() > 1e-2, f"{mode} gives the same logits as vanilla"


# ----------------------------------------------------------------------------- cache parity and causality

CACHE_CASES = [dict(depth_mode=m) for m in DEPTH_MODES] + [
    dict(depth_mode="value", n_loops=2, depth_stride=None), dict(depth_mode="kv", n_loops=3, n_layer=2),
    dict(depth_mode="value", depth_stride=1, depth_recent_window=1, n_kv_head=1),
    dict(depth_mode="value", k_norm_after_rope=True), dict(LIME, n_layer=2, n_loops=2, n_kv_head=1),
    dict(LIME, k_norm_after_rope=True)]


@pytest.mark.parametrize("overrides", CACHE_CASES, ids=str)
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), (3, 3, 3, 3, 2), (1,) * 14], ids=["prefill+tokens", "chunks", "tokens"])
def test_cached_decoding_equals_full_forward(overrides, chunks):
    model = tiny_model(dtype=torch.float64, **overrides).eval()  # float64: a real bug cannot hide in rounding
    T = sum(chunks)
    idx = torch.randint(0, 50, (3, T))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(3, T + 2)  # a cache longer than the sequence: unused slots must not leak in
        parts, start = [], 0
        for n in chunks:
            parts.append(model(idx[:, start:start + n], cache=cache)[0])
            start += n
    diff = (torch.cat(parts, 1) - full).abs().max().item()
    assert cache.pos == T
    assert diff < 1e-10, f"cached logits differ from the full forward by {diff:.3e}"


@pytest.mark.parametrize("mode", DEPTH_MODES)
def test_cache_holds_exactly_the_records(mode):
    """The V slot holds the mixed value (K slot the mixed key in key/kv); the other slot the raw one."""
    model = tiny_model(depth_mode=mode).eval()
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
            mixed_k = mode in ("key", "kv", "lime") and e > 0
            mixed_v = mode in ("value", "uniform", "kv", "lime") and e > 0
            assert torch.allclose(cache.k[e], k, atol=1e-6) != mixed_k, f"layer {e} K slot in mode {mode}"
            assert torch.allclose(cache.v[e], v, atol=1e-6) != mixed_v, f"layer {e} V slot in mode {mode}"
    for hk in hooks:
        hk.remove()


@pytest.mark.parametrize("overrides", [dict(depth_mode=m) for m in DEPTH_MODES] + [dict(n_loops=2, depth_stride=3), LIME],
                         ids=str)
def test_causality(overrides):
    model = tiny_model(**overrides).eval()
    idx = torch.randint(0, 50, (2, 12))
    changed = idx.clone()
    t = 5
    changed[:, t + 1:] = torch.randint(0, 50, (2, 12 - t - 1))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    diff = (a[:, : t + 1] - b[:, : t + 1]).abs().max().item()
    assert diff == 0.0, f"logits at positions <= {t} moved by {diff:.3e} when later tokens changed"
    assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 0


@pytest.mark.parametrize("mode", [m for m in DEPTH_ONLY if m != "lime"])
@pytest.mark.parametrize("n_kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_decode_kernel_equals_the_per_candidate_passes(mode, n_kv):
    """A decode step mixes with one SDPA call over the candidates (depth_mix_one); longer chunks and the
    weights readout with one pass per candidate. Both compute the same mix."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v, *src = (torch.randn(3, n_kv, 1, 8, generator=g, dtype=torch.float64) for _ in range(6))
    fused = depth_mix(q, k, v, src[:2], src[2:], mode, with_alpha=False)
    passes = depth_mix(q, k, v, src[:2], src[2:], mode, with_alpha=True)
    assert (fused[2] is None) == (mode != "uniform") and passes[2].shape == (3, n_kv, 1, 3)
    for a, b in zip(fused[:2], passes[:2]):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("overrides", [dict(depth_mode="vanilla"), dict(depth_mode="value"), dict(depth_mode="kv"),
                                       dict(n_loops=2, depth_stride=3), LIME], ids=str)
def test_attention_takes_no_mask_in_training_prefill_and_decode(overrides):
    """Every scaled_dot_product_attention call of a training forward, a prefill into an empty cache and a decode
    step is is_causal or unmasked (what FlashAttention serves on a GPU); only a chunk continuing a filled cache
    passes a mask, the lower-right causal bias (no materialised T x S tensor)."""
    from torch.nn.attention.bias import CausalBias
    from torch.overrides import TorchFunctionMode
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:  # (query length, key length, attn_mask, is_causal)
                calls.append((args[0].shape[-2], args[1].shape[-2], kwargs.get("attn_mask"), kwargs.get("is_causal")))
            return func(*args, **kwargs)

    model = tiny_model(**overrides)
    idx = torch.randint(0, 50, (2, 9))
    with Record():
        model(idx, targets=idx)[1].backward()
        cache = model.new_cache(2, 9)
        with torch.no_grad():
            for chunk in (idx[:, :5], idx[:, 5:6]):  # prefill into the empty cache, then a decode step
                model(chunk, cache=cache)
    n_layers = model.config.n_eff_layer
    sequence = [c for c in calls if c[0] == c[1]]  # attention over positions (the depth step has no mask either)
    assert len(sequence) >= 2 * n_layers and all(c[3] for c in sequence if c[0] > 1)
    assert all(c[2] is None for c in calls), [c for c in calls if c[2] is not None][:1]
    calls.clear()
    with Record(), torch.no_grad():
        model(idx[:, 6:9], cache=cache)  # a chunk of 3 continuing 6 cached positions
    masks = [c[2] for c in calls if c[2] is not None]
    assert len(masks) == n_layers and all(isinstance(m, CausalBias) for m in masks)


def test_compiles_in_one_graph_at_changing_lengths():
    """A training forward compiled with fullgraph at one length, then at others (torch.compile turns the length
    symbolic): the attention path keeps is_causal a literal bool, so no graph break, and the losses are eager's."""
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
    firsts = {model.generate(prompt, 1, temperature=2.0, top_k=3, generator=gen)[0, -1].item() for _ in range(40)}
    assert firsts <= set(top.tolist()) and len(firsts) > 1


# ----------------------------------------------------------------------------- parity across modes

def test_same_parameter_count_and_cache_bytes_for_every_mode():
    """Every mode has vanilla's weights; lime adds its routers (counted in tests/test_lime.py)."""
    counts, sizes = set(), set()
    for mode in DEPTH_MODES:
        model = tiny_model(depth_mode=mode)
        counts.add(model.num_params() - sum(p.numel() for p in model.lime_routers()))
        cache = model.new_cache(2, 16)
        model(torch.randint(0, 50, (2, 16)), cache=cache)
        sizes.add((cache.nbytes, cache.bytes_per_token))
    c = tiny_config()
    assert counts == {GPT(c).num_params()}
    assert sizes == {(2 * c.n_layer * c.n_kv_head * c.head_dim * 4 * 2 * 16, 2 * c.n_layer * c.n_kv_head * c.head_dim * 4)}
    looped = tiny_model(n_loops=3).new_cache(1, 5)
    assert looped.nbytes == 2 * 3 * c.n_layer * c.n_kv_head * c.head_dim * 4 * 5


def test_num_params_counts_tied_weights_once():
    c = tiny_config()
    untied, tied = GPT(c).num_params(), GPT(tiny_config(tie_embeddings=True)).num_params()
    assert untied - tied == c.vocab_size * c.n_embd


@pytest.mark.parametrize("mode", [m for m in DEPTH_ONLY if m != "lime"])  # lime's weights are parameters
def test_depth_weights_readout(mode):
    model = tiny_model(depth_mode=mode, n_layer=5, depth_stride=2)
    idx = torch.randint(0, 50, (2, 6))
    with model.capture_depth_weights() as alphas:
        model(idx)
    assert model._alpha_sink is None
    assert sorted(alphas) == [1, 2, 3, 4]
    for e, (src, a) in alphas.items():
        assert src == model.config.sources(e) and a.shape == (2, 2, 6, len(src) + 1)
        assert torch.allclose(a.sum(-1), torch.ones(()))
        if mode == "uniform":
            assert torch.equal(a, torch.full_like(a, 1.0 / (len(src) + 1)))
        else:
            assert a.std() > 1e-3, "depth weights of a random model should not be uniform"
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
    assert [cw.sources(e) for e in range(8)] == [[], [0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 3, 4], [0, 4, 5], [0, 4, 5, 6]]
    assert ModelConfig(n_layer=5, depth_stride=1).sources(4) == [0, 1, 2, 3]
    assert ModelConfig(n_layer=5, depth_stride=9).sources(4) == [0]
    looped = ModelConfig(n_layer=2, n_loops=3)  # effective depth 6, default stride 3
    assert [looped.sources(e) for e in range(6)] == [[], [0], [0], [0], [0, 3], [0, 3]]
    assert ModelConfig(depth_mode="vanilla").sources(5) == []
    assert ModelConfig(n_layer=6, depth_mode="lime").sources(5) == [0, 1, 2, 3, 4]  # LIMe: every earlier layer
    assert ModelConfig(n_layer=6, depth_mode="lime", depth_stride=3).sources(5) == [0, 3]


def test_analytic_cost_reproduces_table_2():
    paper_3b = ModelConfig(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32, n_kv_head=8,
                           head_dim=64, depth_stride=24)
    cost = depth_cost(paper_3b, bytes_per_element=2)
    assert cost["candidates"] == 117
    assert cost["flops_per_token"] == 4 * 512 * 117 and f"{cost['flops_per_token']:.2e}" == "2.40e+05"
    assert cost["io_bytes_per_token"] == 2 * (2 * 117 + 48) * 512 and round(cost["io_bytes_per_token"] / 1024) == 282
    assert cost["extra_persistent_bytes"] == cost["extra_params"] == 0
    assert depth_cost(ModelConfig(depth_mode="vanilla"))["flops_per_token"] == 0
    lime = depth_cost(ModelConfig(**{**vars(paper_3b), "depth_mode": "lime", "depth_stride": None}))
    R, C = 8, 48 * 49 // 2 - 1  # LIMe's row: every output head mixes all 8 heads of each earlier layer, K and V
    assert lime == {"candidates": C, "flops_per_token": 4 * R * 512 * C, "io_bytes_per_token": 2 * (2 * C + 2 * 48) * 512,
                    "extra_persistent_bytes": 0, "extra_params": R * R * C}
    assert lime["extra_params"] == 75_200 and f"{lime['flops_per_token']:.2e}" == "1.93e+07"


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("overrides, fragment", [
    (dict(n_head=6, n_kv_head=4), "multiple of n_kv_head"),
    (dict(depth_stride=0), "depth_stride must be an integer >= 1"),
    (dict(depth_mode="values"), "choose one of vanilla, uniform, key, kv, value"),
    (dict(depth_recent_window=-1), "depth_recent_window"),
    (dict(n_loops=0), "n_loops must be a positive integer"),
    (dict(head_dim=7), "head_dim must be even"),
])
def test_bad_configs_raise_clear_errors(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        tiny_config(**overrides)


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
