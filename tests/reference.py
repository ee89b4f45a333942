"""The naive reference, written from the paper's equations (section 2; the modes of Tables 5 and 6)
and from each variant's own (LIMe, Keyless Attention, the baselines of Table 1) as Python loops over
rows, layers, positions and heads, run in float64: what test_model.py checks every variant against.
It shares only the parameter tensors with the model, never its code.

Forks register here (docs/forking.md): a new row's weights in REFERENCE_MODES, a model that is not
GPT's layers with a row's weights in MODEL_REFERENCES, a source rule's config keys in SOURCE_CASES
and the rule itself in reference_sources."""
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


def value_residual_ref(qbar, cand_k, params, layers):  # ResFormer: lambda_2 each source, lambda_1 own
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
# (qbar, cand_k, the block's depth_params, layers), layers being what the candidates read, restated
# here (reference_sources), the sources then the layer e itself: a per-layer parameter is looked up
# by the layer a candidate reads, never by its slot (docs/forking.md).

# The variants whose model is not GPT's layers with a row's weights (LIMe, Keyless Attention, the
# baselines): name -> a naive reference (model, idx) -> logits, below.
MODEL_REFERENCES = {}

# The source rules the contract runs (test_model.py, with depth_mode=value), as the config
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


def reference_forward(model: GPT, idx, k_norm_after_rope=None, weights=None, hidden=False):
    """Logits from loops over rows, layers, positions and heads, from the paper's section 2 and the
    Qwen3 block alone. It shares only the parameter tensors with the model (so gradients can be
    compared). k_norm_after_rope: the order of k_norm and RoPE (default: the model's config).
    weights: a dict that receives each depth weight vector, {(layer, row, position, KV head): alpha}.
    hidden: a rule of the hidden state's (docs/forking.md): a learned row's reference also gets the
    block's input at the position, after input_layernorm (n_embd,)."""
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
            params = (blk.self_attn.depth_params, src + [e]) if learned else ()
            h = rms(x, blk.input_layernorm.weight, c.norm_eps)                      # (T, n_embd)
            K, V = k, v
            if src:
                rule, mixes = spec
                K, V = [[None] * c.n_kv_head for _ in row], [[None] * c.n_kv_head for _ in row]
                for t in range(len(row)):
                    for j in range(c.n_kv_head):
                        cand_k = [stored[s][0][t][j] for s in src] + [k[t][j]]
                        cand_v = [stored[s][1][t][j] for s in src] + [v[t][j]]
                        qbar = sum(q[t][j * g + i] for i in range(g)) / g  # heads of KV head j
                        alpha = rule(qbar, cand_k, *params, *[h[t]] * hidden)
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
        assert gdiff < 1e-10, (f"grad of {n} differs from the reference by {gdiff:.3e}, where the "
                               f"logits agree: the code cuts a path the reference differentiates "
                               f"(an input .detach()ed, or computed under torch.no_grad)?")


# ----------------------------------------------------------------------------- the variants' own models
# LIMe (a learned router over every head of every earlier layer), Keyless Attention (no keys: the
# query routed against the values) and the hidden-state baselines of Table 1: each model, written
# from its equations, in MODEL_REFERENCES.

def lime_reference(model, idx):
    """Logits with loops over rows, layers, positions and heads: at layer e >= 1, head r of the new
    key (value) is sum over candidates c and their heads r' of W_e[r, c R + r'] times the raw key
    (value) projection k_{c,t,r'}; then k_norm and RoPE; every layer's record is its raw k, v."""
    c = model.config
    L, R = c.n_eff_layer, c.n_kv_head
    stride = c.depth_stride if c.depth_stride is not None else 1  # LIMe: every earlier layer
    rows = []
    for row in idx:
        x, raw = model.embed_tokens.weight[row], {}  # raw: effective layer -> its (k, v) (T, R, D)
        for e in range(L):
            blk = model.layers[e % c.n_layer]
            q, k, v = ref_projections(blk, c, x)
            raw[e], src = (k, v), ref_sources(e, stride, c.depth_recent_window)
            if src:
                W, cands = blk.self_attn.lime_router[str(e)], [raw[s] for s in src] + [(k, v)]
                k, v = (torch.stack([torch.stack([
                    sum(W[r, ci * R + r2] * cands[ci][kv][t, r2] for ci in range(len(cands))
                        for r2 in range(R)) for r in range(R)]) for t in range(len(row))])
                    for kv in (0, 1))
            q, K, V = ref_positioned(blk.self_attn, c, q, k, v, c.k_norm_after_rope)
            x = x + ref_attention(blk.self_attn, c, q, K, V)
            x = x + ref_mlp(blk, c, x)
        rows.append(rms(x, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T)
    return torch.stack(rows)


MODEL_REFERENCES["lime"] = lime_reference


def keyless_reference(model, idx):
    """Logits with loops over rows, layers, positions and heads. Query head h at position t:
    q'_t = RoPE_t(q_norm(q_t R_h)), scored against the routing view of each value of its KV group,
    RoPE_s(k_norm(v_s)), reading the raw v_s: s_ts = q'_t . view_s / sqrt(D). With a depth mode,
    qbar' (the group's mean q') weighs the routing views of the sources' stored values and of its
    own value at position t (each view made by the layer that stored the value); the mix replaces
    the value, and the view attention scores against is the mixed value's."""
    c = model.config
    spec, g, D, theta = (REFERENCE_MODES[c.depth_mode], c.n_head // c.n_kv_head, c.head_dim,
                         c.rope_theta)

    def norm(x, module):
        return rms(x, module.weight, c.norm_eps) if c.qk_norm else x

    def view(at, u, t):  # the routing view of value u at position t, by layer `at`'s k_norm
        if c.k_norm_after_rope:
            return norm(rope(u, t, theta), at.k_norm)
        return rope(norm(u, at.k_norm), t, theta)

    rows = []
    for row in idx:
        x, T = model.embed_tokens.weight[row], len(row)
        stored = {}  # effective layer -> (views, values): lists over positions, then KV heads
        for e in range(c.n_eff_layer):
            blk = model.layers[e % c.n_layer]
            at = blk.self_attn
            h = rms(x, blk.input_layernorm.weight, c.norm_eps)
            q = (h @ at.q_proj.weight.T).view(T, c.n_head, D)
            v = (h @ at.v_proj.weight.T).view(T, c.n_kv_head, D)
            qs = [[rope(norm(q[t, i] @ at.routing[i], at.q_norm), t, theta)
                   for i in range(c.n_head)] for t in range(T)]
            V = [[v[t, j] for j in range(c.n_kv_head)] for t in range(T)]
            src = reference_sources(c, e) if spec else []
            for t in range(T):
                for j in range(c.n_kv_head):
                    if src:
                        qbar = sum(qs[t][j * g + i] for i in range(g)) / g
                        cand_k = [stored[s][0][t][j] for s in src] + [view(at, v[t, j], t)]
                        cand_v = [stored[s][1][t][j] for s in src] + [v[t, j]]
                        V[t][j] = sum(a * u for a, u in zip(spec[0](qbar, cand_k), cand_v))
            K = [[view(at, V[t][j], t) for j in range(c.n_kv_head)] for t in range(T)]
            stored[e] = (K, V)
            x = x + ref_attention(at, c, qs, K, V)
            x = x + ref_mlp(blk, c, x)
        rows.append(rms(x, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T)
    return torch.stack(rows)


MODEL_REFERENCES["keyless"] = MODEL_REFERENCES["keyless+value"] = keyless_reference


def attend(blk, c, x):
    """The block's vanilla attention sublayer at its input x (T, n_embd): norm, project, RoPE,
    attend."""
    q, k, v = ref_positioned(blk.self_attn, c, *ref_projections(blk, c, x), c.k_norm_after_rope)
    return ref_attention(blk.self_attn, c, q, k, v)


def ref_denseformer(model, x):
    """y_d = sum_k alpha_{d-1}[k] * H[s + k * dilation] (s = d % dilation) if d % period == 0, else
    b_d."""
    c, dwa = model.config, model.densetransformer_dwa
    history, y = [x], x
    for i, blk in enumerate(model.layers):
        h = y + attend(blk, c, y)
        b = h + ref_mlp(blk, c, h)
        history.append(b)
        d = i + 1
        if d % c.denseformer_dwa_period:
            y = b
            continue
        alpha, s = dwa.alphas[i], d % c.denseformer_dwa_dilation
        y = torch.stack([sum(alpha[k] * history[s + k * c.denseformer_dwa_dilation][t]
                             for k in range(len(alpha))) for t in range(x.shape[0])])
    return y


def ref_attnres(model, x):
    c = model.config

    def aggregate(agg, snapshots, p):
        w = agg.pseudo_query * agg.norm.weight
        out = []
        for t in range(x.shape[0]):
            cands = [s[t] for s in snapshots] + [p[t]]
            logits = [(s @ w) / torch.sqrt((s * s).mean() + c.norm_eps) for s in cands]
            logits[-1] = logits[-1] + agg.recency_bias
            a = torch.softmax(torch.stack(logits), 0)
            out.append(sum(a[k] * s for k, s in enumerate(cands)))
        return torch.stack(out)

    snapshots, p, n = [x], x, 0
    for blk in model.layers:
        h = aggregate(blk.attnres_attn_aggregator, snapshots, p)
        p = p + attend(blk, c, h)
        h = aggregate(blk.attnres_mlp_aggregator, snapshots, p)
        p = p + ref_mlp(blk, c, h)
        n += 2
        if n >= c.attnres_block_size:
            snapshots.append(p)
            n = 0
    return aggregate(model.attnres_final_aggregator, snapshots, p)


def ref_mhc(model, x):
    c = model.config
    n, T, floor = c.mhc_num_streams, x.shape[0], 1e-12

    def connector(con, X, f):  # X: (T, n, D)
        reads, posts, mats = [], [], []
        for t in range(T):
            z = rms(X[t].reshape(-1), con.mhc_input_norm.weight, c.norm_eps)
            d = con.mhc_dynamic_projection.weight @ z                       # (n + n + n*n,)
            h_pre = torch.sigmoid(con.alpha_pre * d[:n] + con.pre_logits)
            posts.append(2 * torch.sigmoid(con.alpha_post * d[n:2 * n] + con.post_logits))
            L = con.alpha_res * d[2 * n:].view(n, n) + con.residual_logits
            M = torch.exp(L - L.max()).clamp_min(floor)
            for _ in range(c.mhc_sinkhorn_iters):
                M = M / M.sum(1, keepdim=True).clamp_min(floor)   # rows
                M = M / M.sum(0, keepdim=True).clamp_min(floor)   # columns
            mats.append(M)
            reads.append(sum(h_pre[j] * X[t, j] for j in range(n)))
        u = f(torch.stack(reads))
        return torch.stack([torch.stack([sum(mats[t][i, j] * X[t, j]
                                             for j in range(n)) + posts[t][i] * u[t]
                                         for i in range(n)]) for t in range(T)])

    X = torch.stack([x] * n, 1)
    for blk in model.layers:
        X = connector(blk.attn_residual_connector, X, lambda h: attend(blk, c, h))
        X = connector(blk.mlp_residual_connector, X, lambda h: ref_mlp(blk, c, h))
    r = torch.softmax(model.residual_stream_projector.reduce_logits, 0)
    return sum(r[j] * X[:, j] for j in range(n))


BASELINE_REFERENCES = {"denseformer": ref_denseformer, "attnres": ref_attnres, "mhc": ref_mhc}


def baseline_reference(model, idx):
    c = model.config
    rows = [BASELINE_REFERENCES[c.residual](model, model.embed_tokens.weight[idx[b]])
            for b in range(idx.shape[0])]
    return torch.stack([rms(h, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T
                        for h in rows])


MODEL_REFERENCES.update(dict.fromkeys(BASELINE_REFERENCES, baseline_reference))
