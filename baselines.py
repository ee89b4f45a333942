"""
The paper's three baselines (section 3.1, Table 1; their costs in section 3.2, Tables 2-4): methods that mix
*hidden states* across depth, outside attention, where Depth-Attention mixes values inside it.

    DenseFormer     after every block, a learned weighted average of the embedding and all earlier block
                    outputs (the DenseFormer paper's depth-weighted average, DWA)
    Block AttnRes   before every sublayer, a softmax over depth of a learned pseudo-query against snapshots
                    of the residual stream taken every few sublayers (the Attention Residuals paper)
    mHC             n parallel residual streams, read, written and mixed by maps computed from the token's
                    streams, the mixing matrix made doubly stochastic by Sinkhorn iterations (the mHC paper)

Each is a GPT (model.py) with the same blocks, attention, KV cache and weights, and overrides one method,
`run_layers`, which carries the residual stream through the layers. All three use vanilla attention and mix
only states of the *same* token, so a cached decode step rebuilds them for the new token alone and the KV
cache stays exactly vanilla's. What they hold while a prompt is processed is their transient per-token state:
the whole history (DenseFormer), the block snapshots (AttnRes), n streams (mHC).

Module and parameter names follow the authors' released checkpoints (their names are ours with a `model.`
prefix, hf.py). Their switches extend model.ModelConfig in `BaselineConfig`; `make_config` turns any flat dict
of keys into the right config and `build_model` into the right model:

    model = build_model(make_config(residual="mhc", depth_mode="vanilla", n_layer=12))
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn

from model import GPT, ModelConfig, RMSNorm, config_check, fp32_or_wider

RESIDUALS = ("add", "denseformer", "attnres", "mhc")


@dataclass
class BaselineConfig(ModelConfig):
    # The baselines of the paper's Table 1; each runs with depth_mode="vanilla".
    residual: str = "add"           # residual path: add (plain stream) | denseformer | attnres | mhc (with vanilla)
    denseformer_dwa_dilation: int = 1       # DenseFormer: average every k-th earlier output (authors: 1)
    denseformer_dwa_period: int = 1         # DenseFormer: average after every p-th block (authors: 1)
    attnres_block_size: int = 12            # Block AttnRes: sublayers per block, 2 per layer (authors: 12)
    attnres_recency_bias_init: float = 3.0  # Block AttnRes: initial logit bonus of the running stream (authors: 3.0)
    mhc_num_streams: int = 4                # mHC: parallel residual streams n (authors: 4)
    mhc_alpha_init: float = 0.01            # mHC: initial gain of the input-dependent maps (authors: 0.01)
    mhc_sinkhorn_iters: int = 20            # mHC: Sinkhorn row/column normalisations (authors: 20)

    def __post_init__(self):
        super().__post_init__()
        need = config_check("BaselineConfig")
        for name in ("denseformer_dwa_dilation", "denseformer_dwa_period", "attnres_block_size", "mhc_num_streams",
                     "mhc_sinkhorn_iters"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.residual in RESIDUALS, f"unknown residual {self.residual!r}; choose one of {', '.join(RESIDUALS)}")
        if self.residual != "add":  # the paper compares each baseline with vanilla attention, one change at a time
            need(self.depth_mode == "vanilla", f"residual={self.residual} is a baseline with vanilla attention; "
                 f"use --depth_mode=vanilla with --residual={self.residual} (not depth_mode={self.depth_mode})")
            need(self.n_loops == 1, f"residual={self.residual} is defined for one pass over the layers; "
                 f"use --n_loops=1 with --residual={self.residual}")
        need(self.mhc_num_streams >= 2, f"mhc_num_streams must be at least 2, got {self.mhc_num_streams}")


# The baselines' own keys beyond ModelConfig's: `residual` and the methods' knobs, which a plain model
# (residual "add") has no use for.
BASELINE_KEYS = tuple(f.name for f in fields(BaselineConfig) if f.name not in {g.name for g in fields(ModelConfig)})
KNOBS = tuple(k for k in BASELINE_KEYS if k != "residual")


def make_config(**keys) -> ModelConfig:
    """The config a flat dict of keys describes (train.py's namespace, a checkpoint's stored dict of any version,
    a Hugging Face record): a BaselineConfig for a baseline, else a ModelConfig, whose dict then carries no
    baseline keys. Every key is checked either way; an unknown one is a ValueError."""
    known = [f.name for f in fields(BaselineConfig)]
    unknown = sorted(keys.keys() - set(known))
    if unknown:
        raise ValueError(f"unknown model keys {unknown} (from a newer version of this code?); this version knows "
                         f"{', '.join(known)}")
    config = BaselineConfig(**keys)
    if config.residual == "add":
        return ModelConfig(**{k: v for k, v in keys.items() if k not in BASELINE_KEYS})
    return config


# ----------------------------------------------------------------------------- DenseFormer

class DepthWeightedAverage(nn.Module):
    """DenseFormer's DWA: one weight vector per block, over the history [x0, b_1, ..., b_L] of the embedding
    and every block's raw output. After block i (depth d = i + 1), if d % period == 0:
        y = sum_k alphas[i][k] * history[s + k * dilation],   s = d % dilation, the last term being b_d
    else y = b_d. The weights are plain (no softmax), zeros with a final 1: y = b_d, the vanilla model, at init.
    Blocks skipped by the period keep an empty vector, as in the authors' checkpoints."""

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
    def __init__(self, config: BaselineConfig):
        super().__init__(config)
        self.densetransformer_dwa = DepthWeightedAverage(config.n_layer, config.denseformer_dwa_dilation,
                                                         config.denseformer_dwa_period)

    def run_layers(self, x, cos, sin, cache):
        history = [x]  # x0, b_1, ..., b_i: (L + 1) hidden states per token by the end
        for i, block in enumerate(self.layers):
            b, _, _ = block(x, cos, sin, [], [], cache, i)
            history.append(b)
            x = self.densetransformer_dwa(history, i)
        return x


# ----------------------------------------------------------------------------- Block AttnRes

class AttnResAggregator(nn.Module):
    """The input of one sublayer (or of the final norm): a softmax over depth, per token, of the completed
    block snapshots s_0 .. s_m and the running stream p:
        w   = pseudo_query * norm.weight                           (D,)
        l_k = (s_k . w) / rms(s_k),   l_p = (p . w) / rms(p) + recency_bias
        out = sum_k a_k s_k + a_p p,  a = softmax(l) in float32
    pseudo_query starts at 0 and recency_bias at 3.0, so p gets most of the weight at init (~95% beside one
    snapshot). rms(s) = sqrt(mean(s^2) + eps) is the RMSNorm denominator; the norm's weight is folded into w."""

    def __init__(self, config: BaselineConfig):
        super().__init__()
        self.pseudo_query = nn.Parameter(torch.zeros(config.n_embd))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.recency_bias = nn.Parameter(torch.tensor(config.attnres_recency_bias_init))

    def forward(self, blocks, p):
        candidates = blocks + [p]
        w = self.pseudo_query * self.norm.weight                                    # (D,)
        logits = [fp32_or_wider(torch.linalg.vecdot(s, w.to(s.dtype)))
                  * torch.rsqrt(fp32_or_wider(s).pow(2).mean(-1) + self.norm.eps) for s in candidates]
        logits[-1] = logits[-1] + self.recency_bias
        a = torch.stack(logits, -1).softmax(-1).to(p.dtype)                         # (B, T, m + 2)
        return sum(a[..., k, None] * s for k, s in enumerate(candidates))


class BlockAttnRes(GPT):
    """Each sublayer reads an aggregate of the snapshots and the stream instead of the stream, and adds its
    output to the stream as usual. After every attnres_block_size sublayers (checked at the end of a layer)
    a snapshot of the stream joins the snapshots; the embedding is the first one."""

    def __init__(self, config: BaselineConfig):
        super().__init__(config)  # the backbone first, so a seed gives it vanilla's weights
        for block in self.layers:
            block.attnres_attn_aggregator = AttnResAggregator(config)
            block.attnres_mlp_aggregator = AttnResAggregator(config)
        self.attnres_final_aggregator = AttnResAggregator(config)

    def run_layers(self, x, cos, sin, cache):
        blocks, p, n = [x], x, 0  # snapshots (B, T, D) each, the running stream, sublayers since a snapshot
        for i, block in enumerate(self.layers):
            p = p + block.attend(block.attnres_attn_aggregator(blocks, p), cos, sin, [], [], cache, i)[0]
            p = p + block.feed_forward(block.attnres_mlp_aggregator(blocks, p))
            n += 2
            if n >= self.config.attnres_block_size:
                blocks, n = blocks + [p], 0
        return self.attnres_final_aggregator(blocks, p)


# ----------------------------------------------------------------------------- mHC

MHC_SELF_SHARE = 0.99  # the mixing matrix's diagonal at init: each stream keeps 99% of itself (authors' code)
SINKHORN_FLOOR = 1e-12  # keeps entries and sums positive through the normalisations (authors' code)


def sinkhorn(logits, iters: int):
    """A doubly stochastic matrix from logits (..., n, n): exp, then `iters` rounds of row then column
    normalisation, in float32 or wider."""
    m = fp32_or_wider(logits)
    m = (m - m.amax((-1, -2), keepdim=True)).exp().clamp_min(SINKHORN_FLOOR)
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True).clamp_min(SINKHORN_FLOOR)
        m = m / m.sum(-2, keepdim=True).clamp_min(SINKHORN_FLOOR)
    return m


class MHCConnector(nn.Module):
    """Wraps one sublayer f (attention or MLP) of the n-stream residual X (B, T, n, D):
        z = RMSNorm(X flattened to n*D);  [d_pre, d_post, d_res] = z @ W       (n, n, n*n values per token)
        h_pre = sigmoid(alpha_pre * d_pre + pre_logits)              read weights         (B, T, n)
        h_post = 2 sigmoid(alpha_post * d_post + post_logits)        write weights        (B, T, n)
        H_res = sinkhorn(alpha_res * d_res + residual_logits)        stream mixing        (B, T, n, n)
        X' = H_res X + h_post f(sum_j h_pre_j X_j)
    At init h_pre = 1/n (the read is the mean stream), h_post = 1 and H_res is nearly the identity."""

    def __init__(self, config: BaselineConfig):
        super().__init__()
        n, D = config.mhc_num_streams, config.n_embd
        self.n, self.iters = n, config.mhc_sinkhorn_iters
        self.pre_logits = nn.Parameter(torch.full((n,), -math.log(n - 1)))     # logit(1/n)
        self.post_logits = nn.Parameter(torch.zeros(n))
        off = (1 - MHC_SELF_SHARE) / (n - 1)
        self.residual_logits = nn.Parameter(torch.full((n, n), off).fill_diagonal_(MHC_SELF_SHARE).log())
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            setattr(self, name, nn.Parameter(torch.tensor(config.mhc_alpha_init)))
        self.mhc_input_norm = RMSNorm(n * D, config.norm_eps)
        self.mhc_dynamic_projection = nn.Linear(n * D, n * n + 2 * n, bias=False)

    def forward(self, X, f):
        B, T, n, D = X.shape
        d = fp32_or_wider(self.mhc_dynamic_projection(self.mhc_input_norm(X.reshape(B, T, n * D))))  # (B, T, n*n + 2n)
        d_pre, d_post, d_res = d.split([n, n, n * n], -1)
        h_pre = torch.sigmoid(self.alpha_pre * d_pre + self.pre_logits).to(X.dtype)            # (B, T, n)
        h_post = (2 * torch.sigmoid(self.alpha_post * d_post + self.post_logits)).to(X.dtype)  # (B, T, n)
        H_res = sinkhorn(self.alpha_res * d_res.view(B, T, n, n) + self.residual_logits, self.iters).to(X.dtype)
        u = f(torch.einsum("btn,btnd->btd", h_pre, X))                                          # (B, T, D)
        return torch.einsum("btij,btjd->btid", H_res, X) + h_post[..., None] * u[:, :, None]


class StreamReduce(nn.Module):
    """The final hidden state: a softmax-weighted sum of the streams (reduce_logits 0 at init: the mean)."""

    def __init__(self, n: int):
        super().__init__()
        self.reduce_logits = nn.Parameter(torch.zeros(n))

    def forward(self, X):
        return torch.einsum("n,btnd->btd", fp32_or_wider(self.reduce_logits).softmax(0).to(X.dtype), X)


class MHC(GPT):
    def __init__(self, config: BaselineConfig):
        super().__init__(config)  # the backbone first, so a seed gives it vanilla's weights
        for block in self.layers:
            block.attn_residual_connector = MHCConnector(config)
            block.mlp_residual_connector = MHCConnector(config)
            for connector in (block.attn_residual_connector, block.mlp_residual_connector):
                connector.apply(self._init_weights)  # the projection: normal(0, init_std) like every Linear
        self.residual_stream_projector = StreamReduce(config.mhc_num_streams)

    def run_layers(self, x, cos, sin, cache):
        X = x.unsqueeze(2).expand(-1, -1, self.config.mhc_num_streams, -1)  # (B, T, n, D): the embedding n times
        for i, block in enumerate(self.layers):
            X = block.attn_residual_connector(X, lambda h: block.attend(h, cos, sin, [], [], cache, i)[0])
            X = block.mlp_residual_connector(X, block.feed_forward)
        return self.residual_stream_projector(X)


BASELINES = {"denseformer": DenseFormer, "attnres": BlockAttnRes, "mhc": MHC}


def residual_of(config: ModelConfig) -> str:
    """A config's residual path: "add" (the plain stream) for a ModelConfig, else the baseline's name."""
    return getattr(config, "residual", "add")


def build_model(config: ModelConfig) -> GPT:
    """The model a config describes: GPT for the plain residual stream, else that baseline."""
    residual = residual_of(config)
    return GPT(config) if residual == "add" else BASELINES[residual](config)
