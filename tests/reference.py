"""The naive reference, written from the paper's equations (section 2; the modes of Tables 5 and 6)
as Python loops over rows, layers, positions and heads, run in float64: what test_model.py and the
variants' tests (tests/test_contract.py, tests/test_lime.py, tests/test_baselines.py,
tests/test_keyless.py, tests/test_hf.py) check the model against. It shares only the parameter
tensors with the model, never its code.

Forks register here (docs/forking.md): a new row's weights in REFERENCE_MODES, a model that is not
GPT's layers with a row's weights in MODEL_REFERENCES (from its own test file, as LIMe's and the
baselines' are), a source rule's config keys in SOURCE_CASES and the rule itself in
reference_sources. It is not a test module: test files import it (`from reference import ...`),
never one another."""
import math

import torch
import torch.nn.functional as F

from baselines import DEPTH_MODES  # model.DEPTH_MODES with the rows baselines.py adds
from model import GPT

# ----------------------------------------------------------------------------- naive reference

# What each depth mode does, written from the paper, not from model.DEPTH_MODES: the weights of the
# C candidates at one position and KV head, from qbar and the candidates' keys (D-vectors), and
# which of K and V the mix replaces. docs/forking.md adds a row here for a new mode.


def softmax_ref(qbar, cand_k):  # section 2.1: a softmax over depth of <qbar, K_c> / sqrt(D)
    scores = torch.stack([(qbar * kk).sum() / math.sqrt(len(qbar)) for kk in cand_k])
    return list(torch.softmax(scores, 0))


def uniform_ref(qbar, cand_k):  # Uniform Mix (Table 5)
    return [1.0 / len(cand_k)] * len(cand_k)


def value_residual_ref(qbar, cand_k, params, e):  # ResFormer: lambda_2 per source, lambda_1 own
    return [params.lambdas[0]] * (len(cand_k) - 1) + [params.lambdas[1]]


REFERENCE_MODES = {"vanilla": None, "value": (softmax_ref, "v"), "uniform": (uniform_ref, "v"),
                   "key": (softmax_ref, "k"), "kv": (softmax_ref, "kv"),
                   # value residual learning (ResFormer, baselines.py): V_0 and V_l, 1/2 each
                   "resformer": (uniform_ref, "v"), "resformer_learned": (value_residual_ref, "v")}
# The rows whose sources at depth_stride=None are not the paper's default (half the depth):
# ResFormer reads layer 0 alone.
ROW_SOURCES = {"lime": lambda c, e: list(range(e)),  # LIMe: every earlier layer
               "resformer": lambda c, e: [0] if e else [],
               "resformer_learned": lambda c, e: [0] if e else []}
# A learned row's (DepthMode.params) weights also read its parameters: the reference is called
# (qbar, cand_k, the block's depth_params, effective layer e), as the row's weights are.

# The variants whose model is not GPT's layers with a row's weights (LIMe, the baselines): name ->
# a naive reference (model, idx) -> logits, registered next to it (tests/test_lime.py,
# tests/test_baselines.py). tests/test_contract.py reads it with REFERENCE_MODES.
MODEL_REFERENCES = {}

# The source rules the contract runs (tests/test_contract.py, with depth_mode=value), as the config
# keys that select each; reference_sources restates the rule. A fork's rule adds its keys here.
SOURCE_CASES = {"every-layer": dict(depth_stride=1),
                "window": dict(depth_stride=3, depth_recent_window=1, n_layer=5)}


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, t, theta):  # rotate the pairs (i, i + D/2) of x (D,) by the angle t * theta^(-2i/D)
    D = len(x)
    ang = (t * theta ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)).to(x.dtype)
    x1, x2 = x[: D // 2], x[D // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])


def ref_sources(e, stride, window):  # section 2.3: every stride-th earlier layer, the window
    return [] if e == 0 else sorted({j for j in range(e) if j % stride == 0}
                                    | set(range(max(0, e - window), e)))


def reference_sources(c, e):  # S(e) of config c; the default stride is half the depth
    if c.depth_stride is None and c.depth_mode in ROW_SOURCES:
        return ROW_SOURCES[c.depth_mode](c, e)
    stride = c.depth_stride if c.depth_stride is not None else max(1, c.n_eff_layer // 2)
    return ref_sources(e, stride, c.depth_recent_window)


def ref_projections(blk, c, x):
    """The raw q (T, H, D), k and v (T, Hkv, D) of a block's attention at its input x (T, n_embd)."""
    h, at, T = rms(x, blk.input_layernorm.weight, c.norm_eps), blk.self_attn, len(x)
    return ((h @ at.q_proj.weight.T).view(T, c.n_head, c.head_dim),
            (h @ at.k_proj.weight.T).view(T, c.n_kv_head, c.head_dim),
            (h @ at.v_proj.weight.T).view(T, c.n_kv_head, c.head_dim))


def ref_positioned(at, c, q, k, v, k_norm_after_rope):
    """q/k-norm and RoPE at each position t: q, k, v as lists over positions of lists over heads."""
    def norm(x, which):
        return rms(x, getattr(at, which).weight, c.norm_eps) if c.qk_norm else x
    T, theta = len(q), c.rope_theta
    qs = [[rope(norm(q[t, i], "q_norm"), t, theta) for i in range(c.n_head)] for t in range(T)]
    if k_norm_after_rope:  # the authors' released Depth-Attention model
        ks = [[norm(rope(k[t, j], t, theta), "k_norm") for j in range(c.n_kv_head)] for t in range(T)]
    else:                  # Qwen3: both norms before RoPE
        ks = [[rope(norm(k[t, j], "k_norm"), t, theta) for j in range(c.n_kv_head)] for t in range(T)]
    return qs, ks, [[v[t, j] for j in range(c.n_kv_head)] for t in range(T)]


def ref_attention(at, c, q, K, V):
    """Causal attention, query head i reading KV head i // g over positions 0..t, then o_proj."""
    g, T = c.n_head // c.n_kv_head, len(q)
    Ks = [torch.stack([K[u][j] for u in range(T)]) for j in range(c.n_kv_head)]   # (T, D) per head
    Vs = [torch.stack([V[u][j] for u in range(T)]) for j in range(c.n_kv_head)]
    out = [torch.cat([torch.softmax(Ks[i // g][: t + 1] @ q[t][i] / math.sqrt(c.head_dim), 0)
                      @ Vs[i // g][: t + 1] for i in range(c.n_head)]) for t in range(T)]
    return torch.stack(out) @ at.o_proj.weight.T


def ref_mlp(blk, c, x):
    h, mlp = rms(x, blk.post_attention_layernorm.weight, c.norm_eps), blk.mlp
    return (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def reference_forward(model: GPT, idx, k_norm_after_rope=None, weights=None):
    """Logits from loops over rows, layers, positions and heads, from the paper's section 2 and the
    Qwen3 block alone. It shares only the parameter tensors with the model (so gradients can be
    compared). k_norm_after_rope: the order of k_norm and RoPE (default: the model's config).
    weights: a dict that receives each depth weight vector, {(layer, row, position, KV head): alpha}."""
    c = model.config
    after = c.k_norm_after_rope if k_norm_after_rope is None else k_norm_after_rope
    spec, L, g = REFERENCE_MODES[c.depth_mode], c.n_eff_layer, c.n_head // c.n_kv_head
    learned = DEPTH_MODES[c.depth_mode].params is not None
    rows = []
    for b, row in enumerate(idx):
        x = model.embed_tokens.weight[row]                                        # (T, n_embd)
        stored = {}  # effective layer -> (K, V): lists over positions of lists over KV heads
        for e in range(L):
            blk = model.layers[e % c.n_layer]
            q, k, v = ref_positioned(blk.self_attn, c, *ref_projections(blk, c, x), after)
            src = reference_sources(c, e) if spec else []
            params = (blk.self_attn.depth_params, e) if learned else ()
            K, V = k, v
            if src:
                rule, mixes = spec
                K, V = [[None] * c.n_kv_head for _ in row], [[None] * c.n_kv_head for _ in row]
                for t in range(len(row)):
                    for j in range(c.n_kv_head):
                        cand_k = [stored[s][0][t][j] for s in src] + [k[t][j]]
                        cand_v = [stored[s][1][t][j] for s in src] + [v[t][j]]
                        qbar = sum(q[t][j * g + i] for i in range(g)) / g  # heads of KV head j
                        alpha = rule(qbar, cand_k, *params)
                        # a row may weigh K and V apart: a pair (K's weights, V's)
                        alpha_k, alpha = alpha if isinstance(alpha, tuple) else (alpha, alpha)
                        if weights is not None:
                            weights[e, b, t, j] = torch.tensor([float(torch.as_tensor(a).detach())
                                                                for a in alpha])
                        mk = sum(a * kk for a, kk in zip(alpha_k, cand_k))
                        mv = sum(a * vv for a, vv in zip(alpha, cand_v))
                        K[t][j] = mk if "k" in mixes else k[t][j]
                        V[t][j] = mv if "v" in mixes else v[t][j]
            stored[e] = (K, V)
            x = x + ref_attention(blk.self_attn, c, q, K, V)
            x = x + ref_mlp(blk, c, x)
        rows.append(rms(x, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T)
    return torch.stack(rows)


def assert_matches_reference(model, reference, idx_shape=(2, 7)):
    """The model's logits and every gradient against the reference's, below 1e-10 (float64)."""
    idx = torch.randint(0, model.config.vocab_size, idx_shape)
    targets = torch.randint(0, model.config.vocab_size, idx_shape)
    model.zero_grad()  # a second call on the same model starts from no gradient too
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = reference(model, idx)
    F.cross_entropy(ref.flatten(0, 1), targets.view(-1)).backward()
    diff = (logits - ref).abs().max().item()
    assert diff < 1e-10, f"logits differ from the reference by {diff:.3e}"
    for n, g in grads.items():
        gdiff = (g - model.get_parameter(n).grad).abs().max().item()
        assert gdiff < 1e-10, f"grad of {n} differs from the reference by {gdiff:.3e}"
