"""
What the paper compares Depth-Attention with, on model.py's decoder.

The three hidden-state baselines (paper section 3.1, Table 1; their costs in section 3.2, Tables
2-4) mix *hidden states* across depth, outside attention, where Depth-Attention mixes values
inside it:

    DenseFormer     after every block, a learned weighted average of the embedding and all earlier
                    block outputs (the DenseFormer paper's depth-weighted average, DWA)
    Block AttnRes   before every sublayer, a softmax over depth of a learned pseudo-query against
                    snapshots of the residual stream taken every few sublayers (Attention Residuals)
    mHC             n parallel residual streams, read, written and mixed by maps computed from the
                    token's streams, the mixing doubly stochastic by Sinkhorn iterations (mHC)

Each is a GPT with the same blocks, attention, KV cache and weights that overrides one method,
`run_layers`, which carries the residual stream through the layers. All three use vanilla attention
and mix only states of the *same* token, so a cached decode step rebuilds them for the new token
alone and the KV cache stays vanilla's. While a prompt runs they hold a transient per-token state:
the whole history (DenseFormer), the block snapshots (AttnRes), n streams (mHC).

LIMe (Layer-Integrated Memory, depth_mode="lime"), the closest prior method, mixes K and V across
depth inside attention like Depth-Attention, but with a static learned router: a GPT whose blocks
are built with LIMeAttention, and a row of model.DEPTH_MODES added here.

Value residual learning (ResFormer, depth_mode="resformer" and "resformer_learned"), the reader's
first question about Depth-Attention, is two rows of the table on GPT's own layers: every layer mixes
its value with layer 0's, half and half or by two learned numbers per block.

Module and parameter names follow the authors' released checkpoints (theirs are ours with a
`model.` prefix, lab/hf.py). Their switches are BaselineConfig's, and `build_model` builds the model
a flat dict of keys names (checkpoint.build_model imports this file only for one of these models):

    model = build_model(dict(residual="mhc", depth_mode="vanilla", n_layer=12))
"""
import functools
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn

from model import (DEFAULT_STRIDES, DEPTH_MODES, GPT, Attention, ConfigError, DepthMode, KVCache,
                   ModelConfig, RMSNorm, causal_attention, fp32_or_wider, need, rope_tables,
                   uniform_weights)


@dataclass
class BaselineConfig(ModelConfig):
    residual: str = "add"  # add (the plain stream) or a baseline of Table 1, with depth_mode=vanilla
    attention: str = "standard"  # or keyless: q R . v, a V-only cache (Keyless Attention)
    denseformer_dwa_dilation: int = 1  # DenseFormer: every k-th earlier output (authors: 1)
    denseformer_dwa_period: int = 1  # DenseFormer: after every p-th block (authors: 1)
    attnres_block_size: int = 12  # AttnRes: sublayers per snapshot, 2 a layer (authors: 12)
    attnres_recency_bias_init: float = 3.0  # AttnRes: the stream's initial logit bonus (authors: 3)
    mhc_num_streams: int = 4  # mHC: parallel residual streams n (authors: 4)
    mhc_alpha_init: float = 0.01  # mHC: initial gain of the dynamic maps (authors: 0.01)
    mhc_sinkhorn_iters: int = 20  # mHC: Sinkhorn row/column rounds (authors: 20)

    def __post_init__(self):
        super().__post_init__()
        for name in ("denseformer_dwa_dilation", "denseformer_dwa_period", "attnres_block_size",
                     "mhc_num_streams", "mhc_sinkhorn_iters"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1,
                 f"BaselineConfig: {name} must be a positive integer, got {value!r}")
        need(self.residual in BASELINES or self.residual == "add", f"BaselineConfig: unknown "
             f"residual {self.residual!r}; choose one of add, {', '.join(BASELINES)}")
        if self.residual != "add":  # the paper compares each with vanilla attention, one change
            need(self.depth_mode == "vanilla" and self.n_loops == 1, f"BaselineConfig: residual="
                 f"{self.residual} is a baseline with vanilla attention and one pass; use "
                 f"--depth_mode=vanilla --n_loops=1 with it")
        need(self.attention in ATTENTIONS, f"BaselineConfig: unknown attention "
             f"{self.attention!r}; choose one of {', '.join(ATTENTIONS)}")
        if self.attention == "keyless":  # its depth step mixes values; there is no key to mix
            need(not DEPTH_MODES[self.depth_mode].mixes_k and self.residual == "add",
                 "BaselineConfig: attention=keyless has no keys to mix and runs on the plain "
                 "stream; use --depth_mode=value, uniform or vanilla with --residual=add")
        need(self.mhc_num_streams >= 2,
             f"BaselineConfig: mhc_num_streams must be at least 2, got {self.mhc_num_streams}")


# ----------------------------------------------------------------------------- DenseFormer

class DepthWeightedAverage(nn.Module):
    """DenseFormer's DWA: one weight vector per block over the history [x0, b_1, ..., b_L] of the
    embedding and every block's raw output. After block i (depth d = i + 1), if d % period == 0:
        y = sum_k alphas[i][k] * history[s + k * dilation],   s = d % dilation, the last being b_d
    else y = b_d. The weights are plain (no softmax), zeros with a final 1: y = b_d, the vanilla
    model, at init. Blocks skipped by the period keep an empty vector, as in the authors' files."""

    def __init__(self, n_layer: int, dilation: int, period: int):
        super().__init__()
        self.dilation, self.period = dilation, period
        self.alphas = nn.ParameterList()
        for i in range(n_layer):
            d = i + 1
            alpha = torch.zeros(d // dilation + 1 if d % period == 0 else 0)
            if alpha.numel():
                alpha[-1] = 1.0
            self.alphas.append(nn.Parameter(alpha, requires_grad=alpha.numel() > 0))

    def forward(self, history, i):
        d = i + 1
        if d % self.period:
            return history[-1]
        picks = history[d % self.dilation::self.dilation]  # len(alphas[i]) entries, ending at b_d
        return sum(a * h for a, h in zip(self.alphas[i].to(history[-1].dtype), picks))


class DenseFormer(GPT):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.densetransformer_dwa = DepthWeightedAverage(
            config.n_layer, config.denseformer_dwa_dilation, config.denseformer_dwa_period)

    def run_layers(self, x, cos, sin, cache):
        history = [x]  # x0, b_1, ..., b_i: (L + 1) hidden states per token by the end
        for i, block in enumerate(self.layers):
            b, _ = block(x, cos, sin, [], [], cache, i)
            history.append(b)
            x = self.densetransformer_dwa(history, i)
        return x


# ----------------------------------------------------------------------------- Block AttnRes

class AttnResAggregator(nn.Module):
    """The input of one sublayer (or of the final norm): a softmax over depth, per token, of the
    completed block snapshots s_0 .. s_m and the running stream p:
        w   = pseudo_query * norm.weight                           (D,)
        l_k = (s_k . w) / rms(s_k),   l_p = (p . w) / rms(p) + recency_bias
        out = sum_k a_k s_k + a_p p,  a = softmax(l) in float32
    pseudo_query starts at 0 and recency_bias at 3.0, so p gets most of the weight at init (~95%
    beside one snapshot). rms(s) = sqrt(mean(s^2) + eps), the RMSNorm denominator; the norm's
    weight is folded into w."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.pseudo_query = nn.Parameter(torch.zeros(config.n_embd))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.recency_bias = nn.Parameter(torch.tensor(config.attnres_recency_bias_init))

    def forward(self, blocks, p):
        candidates = blocks + [p]
        w = self.pseudo_query * self.norm.weight                                  # (D,)
        logits = [fp32_or_wider(torch.linalg.vecdot(s, w.to(s.dtype)))
                  * torch.rsqrt(fp32_or_wider(s).pow(2).mean(-1) + self.norm.eps)
                  for s in candidates]
        logits[-1] = logits[-1] + self.recency_bias
        a = torch.stack(logits, -1).softmax(-1).to(p.dtype)                       # (B, T, m + 2)
        return sum(a[..., k, None] * s for k, s in enumerate(candidates))


class BlockAttnRes(GPT):
    """Each sublayer reads an aggregate of the snapshots and the stream instead of the stream,
    and adds its output to the stream as usual. After every attnres_block_size sublayers (checked
    at the end of a layer) a snapshot of the stream joins the snapshots; the embedding is the
    first one."""
    recomputed = ("attend", "feed_forward", "attnres_attn_aggregator", "attnres_mlp_aggregator")

    def __init__(self, config: ModelConfig):
        super().__init__(config)  # the backbone first, so a seed gives it vanilla's weights
        for block in self.layers:
            block.attnres_attn_aggregator = AttnResAggregator(config)
            block.attnres_mlp_aggregator = AttnResAggregator(config)
        self.attnres_final_aggregator = AttnResAggregator(config)

    def run_layers(self, x, cos, sin, cache):
        blocks, p, n = [x], x, 0  # snapshots (B, T, D), the stream, sublayers since a snapshot
        for i, block in enumerate(self.layers):
            h = block.attnres_attn_aggregator(blocks, p)
            p = p + block.attend(h, cos, sin, [], [], cache, i)[0]
            p = p + block.feed_forward(block.attnres_mlp_aggregator(blocks, p))
            n += 2
            if n >= self.config.attnres_block_size:
                blocks, n = blocks + [p], 0
        return self.attnres_final_aggregator(blocks, p)


# ----------------------------------------------------------------------------- mHC

MHC_SELF_SHARE = 0.99  # the mixing matrix's diagonal at init: each stream keeps 99% of itself
SINKHORN_FLOOR = 1e-12  # keeps entries and sums positive through the normalisations


def sinkhorn(logits, iters: int):
    """A doubly stochastic matrix from logits (..., n, n): exp, then `iters` rounds of row then
    column normalisation, in float32 or wider."""
    m = fp32_or_wider(logits)
    m = (m - m.amax((-1, -2), keepdim=True)).exp().clamp_min(SINKHORN_FLOOR)
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True).clamp_min(SINKHORN_FLOOR)
        m = m / m.sum(-2, keepdim=True).clamp_min(SINKHORN_FLOOR)
    return m


class MHCConnector(nn.Module):
    """Wraps one sublayer f (attention or MLP) of the n-stream residual X (B, T, n, D):
        z = RMSNorm(X flattened to n*D);  [d_pre, d_post, d_res] = z @ W    (n, n, n*n per token)
        h_pre = sigmoid(alpha_pre * d_pre + pre_logits)          read weights      (B, T, n)
        h_post = 2 sigmoid(alpha_post * d_post + post_logits)    write weights     (B, T, n)
        H_res = sinkhorn(alpha_res * d_res + residual_logits)    stream mixing     (B, T, n, n)
        X' = H_res X + h_post f(sum_j h_pre_j X_j)
    At init h_pre = 1/n (the read is the mean stream), h_post = 1, H_res is nearly the identity."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n, D = config.mhc_num_streams, config.n_embd
        self.n, self.iters = n, config.mhc_sinkhorn_iters
        self.pre_logits = nn.Parameter(torch.full((n,), -math.log(n - 1)))     # logit(1/n)
        self.post_logits = nn.Parameter(torch.zeros(n))
        off = (1 - MHC_SELF_SHARE) / (n - 1)
        self.residual_logits = nn.Parameter(
            torch.full((n, n), off).fill_diagonal_(MHC_SELF_SHARE).log())
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            setattr(self, name, nn.Parameter(torch.tensor(config.mhc_alpha_init)))
        self.mhc_input_norm = RMSNorm(n * D, config.norm_eps)
        self.mhc_dynamic_projection = nn.Linear(n * D, n * n + 2 * n, bias=False)

    def forward(self, X, f):
        B, T, n, D = X.shape
        z = self.mhc_input_norm(X.reshape(B, T, n * D))
        d = fp32_or_wider(self.mhc_dynamic_projection(z))                       # (B, T, n*n + 2n)
        d_pre, d_post, d_res = d.split([n, n, n * n], -1)
        h_pre = torch.sigmoid(self.alpha_pre * d_pre + self.pre_logits).to(X.dtype)   # (B, T, n)
        h_post = (2 * torch.sigmoid(self.alpha_post * d_post + self.post_logits)).to(X.dtype)
        H_res = sinkhorn(self.alpha_res * d_res.view(B, T, n, n) + self.residual_logits,
                         self.iters).to(X.dtype)                                 # (B, T, n, n)
        u = f(torch.einsum("btn,btnd->btd", h_pre, X))                           # (B, T, D)
        return torch.einsum("btij,btjd->btid", H_res, X) + h_post[..., None] * u[:, :, None]


class StreamReduce(nn.Module):
    """The final hidden state: a softmax-weighted sum of the streams (at init: the mean)."""

    def __init__(self, n: int):
        super().__init__()
        self.reduce_logits = nn.Parameter(torch.zeros(n))

    def forward(self, X):
        weights = fp32_or_wider(self.reduce_logits).softmax(0).to(X.dtype)
        return torch.einsum("n,btnd->btd", weights, X)


class MHC(GPT):
    # The connectors (the n streams and Sinkhorn) stay outside what is recomputed: a recomputed
    # connector calls its sublayer through FSDP's hooks again inside the backward pass, which gave
    # wrong gradients (tests/test_parallel.py).
    recomputed = ("attend", "feed_forward")

    def __init__(self, config: ModelConfig):
        super().__init__(config)  # the backbone first, so a seed gives it vanilla's weights
        for block in self.layers:
            block.attn_residual_connector = MHCConnector(config)
            block.mlp_residual_connector = MHCConnector(config)
            for connector in (block.attn_residual_connector, block.mlp_residual_connector):
                connector.apply(self._init_weights)  # its projection: normal(0, init_std)
        self.residual_stream_projector = StreamReduce(config.mhc_num_streams)

    def run_layers(self, x, cos, sin, cache):
        n = self.config.mhc_num_streams
        X = x.unsqueeze(2).expand(-1, -1, n, -1)  # (B, T, n, D): the embedding n times
        for i, block in enumerate(self.layers):
            X = block.attn_residual_connector(
                X, lambda h: block.attend(h, cos, sin, [], [], cache, i)[0])
            X = block.mlp_residual_connector(X, block.feed_forward)
        return self.residual_stream_projector(X)


# ----------------------------------------------------------------------------- LIMe

def lime_mix(router, ks, vs):
    """LIMe's step at layer l, every position at once (Layer-Integrated Memory: "You Do Not Fully
    Utilize Transformer's Representation Capacity", arXiv 2502.09245, and its released code).

    ks, vs: lists over the candidates, the sources S(l) ascending then layer l itself, each
    (B, T, R, D) with R = n_kv_head: the raw key and value projections, before k_norm, RoPE and
    any mixing. Router W: (R, C * R), C = len(ks); column c * R + r' is head r' of candidate c:

      kt_{t,r} = sum_{c, r'} W[r, c R + r'] k_{c,t,r'},   vt_{t,r} = the same sum over v

    one static weight per (head, candidate head), shared by K and V, raw (no softmax). Summed one
    candidate at a time, each product reading a record in place: backward keeps the records, never
    a stacked copy of every earlier layer per layer, which would grow with depth squared (LIMe's
    code concatenates its buffer at every layer). Returns kt, vt: (B, T, R, D).
    """
    R = router.shape[0]
    w = router.view(R, len(ks), R).unbind(1)                 # C blocks W[:, cR:(c+1)R], (R, R)

    def routed(xs):  # an expanded (not reshaped) W keeps matmul from saving a copy of x
        return sum(torch.matmul(wc.expand(*x.shape[:-2], R, R), x) for wc, x in zip(w, xs))

    return routed(ks), routed(vs)


def init_lime_router(w):
    """LIMe's init (their code): uniform in +-sqrt(3 / fan_in), fan_in = C * R, so each head starts
    as a unit-variance random mix of every candidate head, plus itself: the layer's own block (the
    last R columns) is the identity. Not vanilla at init: the other blocks are random."""
    R, fan_in = w.shape
    bound = math.sqrt(3 / fan_in)
    with torch.no_grad():
        w.uniform_(-bound, bound)
        w[:, -R:] = torch.eye(R, dtype=w.dtype, device=w.device)


# The routers' optimizer group (train.make_optimizer), as in LIMe's code: no weight decay and
# lime_router_lr_mult times the others' learning rate; the tag keeps LIMe checkpoints' layout.
LIME_ROUTER_GROUP = {"weight_decay": 0.0, "lr_mult": "lime_router_lr_mult", "lime_routers": True}


class LIMeAttention(Attention):
    """LIMe's attention: the router mixes the raw projections of the candidates, then k_norm and
    RoPE act on the mixed key as on any key attention reads, and the mixture is what goes into the
    cache. The record later layers mix is the raw projections."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        # a router per effective layer e this block runs at (none at e = 0), keyed by e; filled by
        # init_lime_router after the backbone
        R = config.n_kv_head
        self.lime_router = nn.ParameterDict({
            str(e): nn.Parameter(torch.empty(R, (len(config.sources(e)) + 1) * R))
            for e in range(layer, config.n_eff_layer, config.n_layer) if e > 0})
        self.lime_router.optimizer_group = LIME_ROUTER_GROUP

    def forward(self, x, cos, sin, src_k, src_v, cache, e):
        q, k, v = self.project(x)                                          # (B, T, heads, D)
        record = (k, v)  # what later layers mix: the raw projections
        if src_k:
            k, v = lime_mix(self.lime_router[str(e)], src_k + [k], src_v + [v])
        return self.store_and_attend(*self.rotate(q, k, v, cos, sin), cache, e)[0], record


class LIMe(GPT):
    attention_type = LIMeAttention

    def __init__(self, config: ModelConfig):
        super().__init__(config)  # the backbone first, so a seed gives it vanilla's weights
        for w in self.lime_routers():
            init_lime_router(w)

    def lime_routers(self) -> list:
        """The router matrices (their optimizer group: LIME_ROUTER_GROUP)."""
        return [p for name, p in self.named_parameters() if ".lime_router." in name]


def lime_cost(config: ModelConfig, bytes_per_element: int = 2) -> dict:
    """LIMe's terms for bench_cache.depth_cost: no scores, K and V mixed, but every output head reads all
    R = n_kv_head heads of a candidate layer: FLOPs 4 R d_kv C; I/O bytes (2C + 2L) d_kv (read each
    candidate's raw K and V once, write the mixed K and V); its router adds R^2 C parameters. With
    the default sources (every earlier layer) C = L (L + 1) / 2 - 1. C counts layers, not heads."""
    L, R = config.n_eff_layer, config.n_kv_head
    d_kv = R * config.head_dim
    C = sum(len(config.sources(e)) + 1 for e in range(1, L))
    return {"candidates": C, "flops_per_token": 4 * R * d_kv * C,
            "io_bytes_per_token": bytes_per_element * (2 * C + (2 * L if C else 0)) * d_kv,
            "extra_persistent_bytes": 0, "extra_params": R * R * C}


def router_weights(qbar, keys):
    """LIMe's depth weights are not a function of the query: they are its router, a parameter."""
    raise ValueError("depth_mode=lime runs on LIMeAttention: build it with baselines.build_model")


# The row LIMe adds to the table: its router mixes K and V, every earlier layer by default (a
# LIMe config with depth_stride=None, a checkpoint's too, means stride 1), at its own cost.
DEPTH_MODES["lime"] = DepthMode(router_weights, mixes_k=True, mixes_v=True)
DEFAULT_STRIDES["lime"] = 1
DEPTH_COSTS = {"lime": lime_cost}  # by depth_mode: bench_cache.depth_cost's rows not of Table 2


# ----------------------------------------------------------------------------- ResFormer

# Value residual learning (ResFormer, arXiv 2410.17897; the value-residual lever of the modded-
# nanoGPT speedrun): every layer after the first attends with lambda_1 V_l + lambda_2 V_0, its own
# value and layer 0's. On this decoder it is a row over the sources S(l) = {0}: layer 0 stores its
# own value, which later layers read. `resformer`: the paper's fixed 1/2 and 1/2, Uniform Mix
# over {0, l}; `resformer_learned`: lambda_1, lambda_2 learned per block, 1/2 each at init.
LAYER_0_ONLY = 2 ** 31  # a depth_stride beyond any depth: S(l) = {0} (ModelConfig.sources)


class ValueResidual(nn.Module):
    """One block's (lambda_2, lambda_1): the weight of each source's value (layer 0's, by the row's
    sources) and of the layer's own, 1/2 each at init, so the row starts as `resformer`."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.lambdas = nn.Parameter(torch.full((2,), 0.5))  # (each source's, the layer's own)


def value_residual_weights(qbar, keys, params, e):
    """alpha = (lambda_2 for each source, lambda_1 for the layer), whatever the query."""
    B, n_kv, T, _ = qbar.shape
    lam = fp32_or_wider(params.lambdas)
    alpha = torch.cat([lam[:1].expand(len(keys) - 1), lam[1:]])              # (C,)
    return alpha.view(1, 1, -1, 1).expand(B, n_kv, len(keys), T)           # (B, n_kv, C, T)


DEPTH_MODES["resformer"] = DepthMode(uniform_weights, mixes_v=True)
DEPTH_MODES["resformer_learned"] = DepthMode(value_residual_weights, mixes_v=True,
                                             params=ValueResidual, starts_as="resformer")
DEFAULT_STRIDES.update(resformer=LAYER_0_ONLY, resformer_learned=LAYER_0_ONLY)


# ----------------------------------------------------------------------------- Keyless Attention

class ValueCache(KVCache):
    """A keyless model's cache: V alone, (n_eff_layer, B, n_kv_head, max_len, D), half of KVCache's
    bytes; `k` is None. The routing views attention scores against are recomputed from V."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device=None,
                 dtype=torch.float32):
        super().__init__(config, batch_size, max_len, "meta", dtype)  # KVCache's checks, no memory
        self.k, self.v = None, torch.zeros(self.v.shape, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.v.nbytes

    def update(self, e: int, k, v):
        """Write layer e's values of this chunk (k is None); return (None, V over 0..pos+T-1)."""
        end = self.pos + v.shape[2]
        self.v[e, :, :, self.pos:end] = v
        return None, self.v[e, :, :, :end]


class KeylessAttention(Attention):
    """Keyless Attention (arXiv 2606.21848): no key projection. Query head h is scored against the
    values of its KV group through its D x D routing matrix R_h, and reads those same values:

        s_ts = (q_t R_h) . v_s / sqrt(D),   o_t = sum_{s <= t} softmax_s(s_ts) v_s

    Ours, where the paper leaves it open (README, "Where we deviate"): q R_h takes q_norm and RoPE
    like any query (q_norm after R, so W_Q R still folds into one matrix); it is scored against a
    routing view of each value, RoPE_s(k_norm(v_s)), while attention reads the raw v_s; R_h starts
    at the identity (the model starts as K = V sharing). The cache holds V only (ValueCache; the
    mixed value where a depth step mixes): the views are recomputed from it when attending, every
    cached position rotated again.

    With a depth step (depth_mode value or uniform) the routing views play the keys: the routed
    group-mean query weighs the sources' views at the same position and the mixed value replaces
    v in its slot. A keyless layer is scored against its values, so mixing V here also moves what
    later queries are scored against: the step is no longer "value only" in effect."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        del self.k_proj
        eye = torch.eye(config.head_dim)
        self.routing = nn.Parameter(eye.repeat(config.n_head, 1, 1))      # R: (n_head, D, D)

    def forward(self, x, cos, sin, src_k, src_v, cache, e):
        """cos, sin: the rotations of every position the layer attends to, 0 .. pos+T-1 (Keyless
        .run_layers); the chunk's are the last T."""
        T = x.shape[1]
        q, view, v = self.rotate(*self.project(x), cos[-T:], sin[-T:])   # (B, heads, T, D)
        if src_k:  # src_k: the sources' routing views, the keys of the depth step
            _, v = self.depth_step(q, view, v, src_k, src_v, e)
        return self.attend_values(q, v, cos, sin, cache, e)

    def project(self, x):
        """q R: (B, T, n_head, D), and v (B, T, n_kv_head, D) twice: as the value, and where the
        key was, for rotate to make its routing view."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        return torch.einsum("bthd,hde->bthe", q, self.routing.to(q.dtype)), v, v

    def attend_values(self, q, v, cos, sin, cache, e):
        """Store v in layer e's slots, attend with the routing views of every stored value.
        Returns (output, record): the record is (views, values) of this chunk's positions."""
        start = 0 if cache is None else cache.pos
        if cache is not None:
            v = cache.update(e, None, v)[1]                               # (B, n_kv, pos+T, D)
        view = self.position_key(v, cos, sin)
        y = causal_attention(q, view, v).transpose(1, 2)                 # (B, T, n_head, D)
        return self.o_proj(y.flatten(2)), (view[:, :, start:], v[:, :, start:])


class Keyless(GPT):
    attention_type = KeylessAttention
    cache_type = ValueCache

    def run_layers(self, x, cos, sin, cache):
        """GPT's, with the rotations of every cached position too, made once for all the layers:
        the routing views of the cached values are rotated again at every step."""
        if cache is not None and cache.pos:
            cos, sin = rope_tables(self.config, 0, cache.pos + x.shape[1], x.device, cos.dtype)
        return super().run_layers(x, cos, sin, cache)


# ----------------------------------------------------------------------------- by name

BASELINES = {"denseformer": DenseFormer, "attnres": BlockAttnRes, "mhc": MHC}  # by `residual`
DEPTH_MODELS = {"lime": LIMe}  # by depth_mode, where model.GPT's layers are not the mode's
ATTENTIONS = {"standard": GPT, "keyless": Keyless}  # by `attention`
# BaselineConfig's keys beyond ModelConfig's, and of those the methods' knobs
BASELINE_KEYS = tuple(f.name for f in fields(BaselineConfig))[len(fields(ModelConfig)):]
KNOBS = BASELINE_KEYS[2:]


def make_config(**keys) -> ModelConfig:
    """The config a flat dict of keys names (train.py's, a checkpoint's of any version, a Hugging
    Face record): a BaselineConfig for a baseline or keyless model, else a ModelConfig, whose dict
    then carries no baseline keys. An unknown key is a ConfigError naming the known ones."""
    known = [f.name for f in fields(BaselineConfig)]
    if unknown := sorted(keys.keys() - set(known)):
        raise ConfigError(f"unknown model keys {unknown} (from a newer version of this code?); "
                          f"this version knows {', '.join(known)}")
    config = BaselineConfig(**keys)
    if config.residual == "add" and config.attention == "standard":
        return ModelConfig(**{k: v for k, v in keys.items() if k not in BASELINE_KEYS})
    return config


def checkpoint_units(model) -> list:
    """The (object, method name) pairs activation checkpointing recomputes (train.py's
    --activation_checkpointing, an export's gradient_checkpointing_enable): each block's forward,
    or the pieces a model class names in its `recomputed` (a block's methods or modules)."""
    units = []
    for block in model.layers:
        for name in getattr(type(model), "recomputed", ("forward",)):
            part = getattr(block, name)
            units.append((part, "forward") if isinstance(part, nn.Module) else (block, name))
    return units


def recompute(method):
    """A unit under activation checkpointing: only its inputs are kept, the rest recomputed in
    the backward pass (non-reentrant: it takes keyword arguments, outputs without gradient)."""
    return functools.partial(torch.utils.checkpoint.checkpoint, method, use_reentrant=False)


def wrap_units(model, wrap=recompute):
    """Replace every unit's method by wrap(method) (an instance attribute shadows the class's, and
    nn.Module.__call__ finds it); returns the function that puts them back."""
    units = checkpoint_units(model)
    for owner, name in units:
        setattr(owner, name, wrap(getattr(owner, name)))
    return lambda: [delattr(owner, name) for owner, name in units]


def build_model(keys: dict) -> GPT:
    """The model a flat dict of keys names: a hidden-state baseline, a keyless model, LIMe, or
    model.GPT (the depth modes and ResFormer's rows run on GPT's own layers)."""
    config = make_config(**keys)
    if isinstance(config, BaselineConfig) and config.residual != "add":
        return BASELINES[config.residual](config)
    if isinstance(config, BaselineConfig):
        return ATTENTIONS[config.attention](config)
    return DEPTH_MODELS.get(config.depth_mode, GPT)(config)
