"""
Depth-Attention (arXiv 2606.05014) on a Qwen3-style decoder, in one file.

Before layer l attends over the sequence, its query attends over the keys that a few earlier
layers stored *at the same token position* and mixes their values into its own value
(`depth_mix`, paper section 2). The mixed value is what goes into the V cache, so inference keeps
exactly a normal KV cache (`KVCache`). The paper's variants are the rows of one table, DEPTH_MODES.

Reading order: ModelConfig and the source rule; the method (the depth weights, DEPTH_MODES,
`depth_mix`); `KVCache`; the decoder (RoPE, RMSNorm, Attention, MLP, Block, GPT). It imports only
torch; baselines.py builds the comparisons on it, bench_cache.py measures and counts its cost.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConfigError(ValueError):
    """A config that describes no model; the message names the fix."""


def need(ok: bool, message: str):  # a ConfigError unless ok: the checks read as rules
    if not ok:
        raise ConfigError(message)


@dataclass
class ModelConfig:
    vocab_size: int = 50304  # tokenizer vocabulary (paper: GPT-NeoX 50304)
    block_size: int = 1024  # context length in tokens (paper: 2048)
    n_layer: int = 12  # distinct blocks (paper 3B: 48)
    n_head: int = 12  # query heads (paper 3B: 32)
    n_kv_head: int = 4  # key/value heads: n_head = MHA, 1 = MQA, else GQA (3B: 8)
    head_dim: int = 64  # per-head width (paper: 64)
    n_embd: int = 768  # hidden size (paper 3B: 2048)
    mlp_hidden: int = 2048  # SwiGLU inner width (paper 3B: 6912)
    rope_theta: float = 10000.0  # RoPE base (paper: 1e4)
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE, as in Qwen3
    k_norm_after_rope: bool = False  # k_norm after RoPE: the authors' released model
    tie_embeddings: bool = False  # share token embedding and lm_head (paper: untied)
    norm_eps: float = 1e-6  # RMSNorm epsilon (Qwen3 default)
    init_std: float = 0.02  # std of every Linear's and the embedding's init (3B: 0.01)
    depth_mode: str = "value"  # a row of model.DEPTH_MODES (value = Depth-Attention)
    depth_stride: Optional[int] = None  # a source every k-th layer; None = the mode's default
    depth_recent_window: int = 0  # also the r most recent earlier layers (paper: 0)
    n_loops: int = 1  # run the n_layer blocks this many times (looped Transformer)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "head_dim",
                     "n_embd", "mlp_hidden", "n_loops"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1,
                 f"ModelConfig: {name} must be a positive integer, got {value!r}")
        need(self.n_head % self.n_kv_head == 0, f"ModelConfig: n_head ({self.n_head}) must be a "
             f"multiple of n_kv_head ({self.n_kv_head}); pick n_kv_head from the divisors of "
             f"n_head")
        need(self.head_dim % 2 == 0, f"ModelConfig: head_dim must be even (RoPE): {self.head_dim}")
        need(self.depth_mode in DEPTH_MODES, f"ModelConfig: unknown depth_mode "
             f"{self.depth_mode!r}; choose one of {', '.join(DEPTH_MODES)}")
        stride, window = self.depth_stride, self.depth_recent_window
        need(stride is None or (isinstance(stride, int) and stride >= 1), f"ModelConfig: "
             f"depth_stride must be an integer >= 1 or None (the mode's default), got {stride!r}")
        need(isinstance(window, int) and window >= 0,
             f"ModelConfig: depth_recent_window must be an integer >= 0, got {window!r}")
        need(self.init_std > 0 and self.rope_theta > 0 and self.norm_eps > 0,
             "ModelConfig: init_std, rope_theta and norm_eps must be positive")

    @property
    def n_eff_layer(self) -> int:
        """Effective depth: the depth index, the source rule and the cache slots run over it."""
        return self.n_layer * self.n_loops

    @property
    def stride(self) -> int:
        """depth_stride, or its mode's in DEFAULT_STRIDES, or half the effective depth (2.3)."""
        if self.depth_stride is not None:
            return self.depth_stride
        return DEFAULT_STRIDES.get(self.depth_mode) or max(1, self.n_eff_layer // 2)

    def sources(self, e: int) -> list[int]:
        """S(e) = {j < e : j % stride == 0} U {e-r, ..., e-1}, ascending (paper section 2.3).
        Layer 0 has none, and neither has a mode without a depth step (vanilla)."""
        if not DEPTH_MODES[self.depth_mode].mixes or e == 0:
            return []
        recent = range(max(0, e - self.depth_recent_window), e)
        return sorted({j for j in range(e) if j % self.stride == 0}.union(recent))


# ----------------------------------------------------------------------------- the method

def fp32_or_wider(x):
    """x in float32 for bf16/fp16, else as it is: the precision of softmax, norms, the loss."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def group_mean(q, n_kv_head):
    """qbar: the mean of each group of g = n_head / n_kv_head query heads that share a KV head
    (section 2.3), (B, n_head, T, D) -> (B, n_kv_head, T, D)."""
    return q.unflatten(1, (n_kv_head, -1)).mean(2)


# How a layer weighs its C candidates: qbar and the keys, each (B, n_kv_head, T, D), give alpha
# (B, n_kv_head, C, T) in float32, positions contiguous (2x faster than C last, docs/cost.md).

def softmax_weights(qbar, keys):
    """The paper's depth weights (section 2.1): alpha_c = softmax_c(<qbar, K_c> / sqrt(D))."""
    scores = torch.stack([torch.linalg.vecdot(qbar, kc) for kc in keys], 2)  # (B, n_kv, C, T)
    return (fp32_or_wider(scores) / math.sqrt(qbar.shape[-1])).softmax(2)


def uniform_weights(qbar, keys):
    """Uniform Mix (paper Table 5): alpha_c = 1 / C, whatever the query."""
    B, n_kv, T, _ = qbar.shape
    return qbar.new_full((B, n_kv, len(keys), T), 1 / len(keys), dtype=fp32_or_wider(qbar).dtype)


@dataclass(frozen=True)
class DepthMode:
    """A row of DEPTH_MODES: how a layer weighs its candidates, and which of its K and V the mix
    replaces. A new row takes the plain path everywhere; a fast path is opt-in (decode_kernel)."""
    weights: Optional[Callable] = None  # (qbar, keys) -> alpha, as above; None: no depth step
    mixes_k: bool = False         # the mixed key replaces the layer's own (its K cache slot)
    mixes_v: bool = False         # the mixed value replaces the layer's own (its V cache slot)
    decode_kernel: bool = False   # a decode step in one attention call (softmax_weights only)
    params: Optional[Callable] = None  # a learned rule: (config, layer) -> one block's nn.Module
    # (Attention.depth_params); weights then gets (qbar, keys, depth_params, e)
    starts_as: Optional[str] = None  # a learned row's base: the row it equals at init (contract)

    def __post_init__(self):
        if self.decode_kernel and self.weights is not softmax_weights:
            raise ValueError("decode_kernel is softmax_weights' mix; others take the plain path")
        if (self.weights is None) == self.mixes:
            raise ValueError("a row has weights exactly when it mixes K or V (mixes_k, mixes_v)")
        if self.params is not None and self.weights is None:
            raise ValueError("a row's params are read by its weights: give it weights")

    @property
    def mixes(self) -> bool:  # the layers have a depth step (every mode but vanilla)
        return self.mixes_k or self.mixes_v


DEPTH_MODES = {
    "vanilla": DepthMode(),                                                     # no depth step
    "value": DepthMode(softmax_weights, mixes_v=True, decode_kernel=True),      # Depth-Attention
    "uniform": DepthMode(uniform_weights, mixes_v=True),                        # Table 5
    "key": DepthMode(softmax_weights, mixes_k=True, decode_kernel=True),        # Table 6
    "kv": DepthMode(softmax_weights, mixes_k=True, mixes_v=True, decode_kernel=True),  # Table 6
}
DEFAULT_STRIDES: dict[str, int] = {}  # a row's own stride for depth_stride=None (LIMe's: 1)


def depth_mix(q, k, v, src_k, src_v, mode: DepthMode, rule=()):
    """The depth step of layer l at every position t at once (paper sections 2.1-2.2).

    q: (B, n_head, T, D) this layer's queries; k, v: (B, n_kv_head, T, D) its key and value.
    src_k, src_v: lists over the sources j in S(l), each (B, n_kv_head, T, D): what source j
    stored in its cache slots at the same positions (already mixed: the mixing is recursive).
    The candidates are the sources in ascending order, then the layer itself:

      qbar_t = the mean of the g = n_head / n_kv_head query heads that share a KV head
      alpha  = mode.weights: softmax_c(<qbar_t, K_c,t> / sqrt(D)) in float32 (uniform: 1 / C)
      vt_t   = sum_c alpha_c V_c,t  if the mode mixes V;   kt_t = sum_c alpha_c K_c,t  if K

    q and k arrive after RoPE; every candidate carries the same rotation R_t, so the scores are
    those of the unrotated vectors and mixing keys commutes with it (README, "Where we deviate").
    Returns (k_out, v_out, alpha (B, n_kv_head, C, T)). rule: a learned row's (depth_params, e).
    """
    keys, values = src_k + [k], src_v + [v]
    qbar = group_mean(q, k.shape[1])                                   # (B, n_kv_head, T, D)
    alpha = mode.weights(qbar, keys, *rule)                            # (B, n_kv_head, C, T)
    k_out = weighted_sum(alpha, keys) if mode.mixes_k else k
    v_out = weighted_sum(alpha, values) if mode.mixes_v else v
    return k_out, v_out, alpha


def weighted_sum(alpha, xs):
    """sum_c alpha_c xs[c] in xs' dtype, a multiply-add in place per candidate (2x faster than a
    stack and a sum, docs/cost.md): backward keeps the records, never a stacked copy per layer."""
    w = alpha.to(xs[0].dtype).unsqueeze(-1)                            # (B, n_kv_head, C, T, 1)
    out = w[:, :, 0] * xs[0]
    for c in range(1, len(xs)):
        out = out.addcmul_(w[:, :, c], xs[c])
    return out


def depth_mix_one(q, k, v, src_k, src_v, mode: DepthMode):
    """depth_mix for one new token: attention of one query, qbar, over the C candidates on the key
    axis, so one scaled_dot_product_attention call does softmax_weights' scores, softmax and mix
    (2.6x faster than the passes on a CPU, docs/cost.md). Its scores stay float32, where the passes
    round them to the activations' dtype: bf16 differs by that. q (B, n_head, 1, D)."""
    qbar = group_mean(q, k.shape[1])                                   # (B, n_kv_head, 1, D)
    keys = torch.cat(src_k + [k], 2)                                   # (B, n_kv_head, C, D)
    k_out = F.scaled_dot_product_attention(qbar, keys, keys) if mode.mixes_k else k
    if mode.mixes_v:
        v = F.scaled_dot_product_attention(qbar, keys, torch.cat(src_v + [v], 2))
    return k_out, v


# ----------------------------------------------------------------------------- the KV cache

class KVCache:
    """Preallocated K and V of every effective layer, (n_eff_layer, B, n_kv_head, max_len, D):
    each layer's record (mixed where its mode mixes) and nothing else, so the same size in every
    mode, 2 * n_layer * n_loops * n_kv_head * head_dim * bytes_per_element per token, sequence."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device=None,
                 dtype=torch.float32):
        need(max_len <= config.block_size, f"KVCache max_len {max_len} exceeds the context length "
             f"block_size={config.block_size}; shorten the prompt or the number of new tokens")
        shape = (config.n_eff_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k, self.v = (torch.zeros(shape, device=device, dtype=dtype) for _ in "kv")
        self.pos = 0  # tokens written so far: advance(T) once per forward, after every layer

    @property
    def max_len(self) -> int:
        return self.v.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, e: int, k, v):
        """Write layer e's records of this chunk; return its K, V over positions 0..pos+T-1."""
        end = self.pos + k.shape[2]
        self.k[e, :, :, self.pos:end] = k
        self.v[e, :, :, self.pos:end] = v
        return self.k[e, :, :, :end], self.v[e, :, :, :end]

    def advance(self, T: int):
        """The chunk's T tokens are in every layer: the next forward continues after them."""
        self.pos += T


# ----------------------------------------------------------------------------- the decoder

def rope_tables(config: ModelConfig, start: int, T: int, device, dtype):
    """cos, sin (T, D) of positions start .. start+T-1, float32 or wider; apply_rope casts them."""
    dims = torch.arange(0, config.head_dim, 2, device=device, dtype=dtype)
    inv_freq = 1.0 / config.rope_theta ** (dims / config.head_dim)             # (D/2,)
    freqs = torch.outer(torch.arange(start, start + T, device=device, dtype=dtype), inv_freq)
    freqs = torch.cat([freqs, freqs], -1)                                       # (T, D)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (the Llama/Qwen3 layout); x: (B, heads, T, D), cos/sin: (T, D)."""
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(fp32_or_wider(x), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def causal_attention(q, k, v):
    """Causal attention of q's T queries, the last T of k's S positions. Training, a prefill
    (is_causal) and a decode step take no mask, so FlashAttention serves them; a chunk continuing a
    filled cache takes causal_lower_right (docs/cost.md). is_causal: a literal, for torch.compile."""
    T, S = q.shape[2], k.shape[2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right  # here: it imports torch._dynamo, 1 s
    mask = causal_lower_right(T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    """Grouped-query attention with q/k-norm and RoPE (Qwen3) and the depth step between RoPE and
    the cache. A variant's forward reuses the steps below (baselines.LIMeAttention)."""

    weights_sink = None  # train.capture_depth_weights: called with (e, alpha) while set

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.mode, self.k_norm_after_rope = DEPTH_MODES[c.depth_mode], c.k_norm_after_rope
        self.q_proj = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else nn.Identity()
        # a learned row's (DepthMode.params), none where the block never has sources (layer 0),
        # drawn on a fork of the generator: a seed gives the backbone its base's weights (paired)
        mixing = any(c.sources(e) for e in range(layer, c.n_eff_layer, c.n_layer))
        dev = torch.get_default_device()  # CPU's generator, or a torch.device context's (cuda)
        with torch.random.fork_rng([dev] * (dev.type != "cpu"), device_type=dev.type):
            self.depth_params = self.mode.params(c, layer) if self.mode.params and mixing else None

    def forward(self, x, cos, sin, src_k, src_v, cache, e):
        """x: (B, T, n_embd) at effective layer e; src_k, src_v: its sources' records. Returns
        (output, record): what it stored, which later depth steps read (section 2.4)."""
        q, k, v = self.rotate(*self.project(x), cos, sin)                 # (B, heads, T, D)
        if src_k:  # the sources S(e) (ModelConfig.sources): none in vanilla and at layer 0
            k, v = self.depth_step(q, k, v, src_k, src_v, e)
        return self.store_and_attend(q, k, v, cache, e)

    def project(self, x):  # q: (B, T, n_head, D); k, v: (B, T, n_kv_head, D)
        B, T, _ = x.shape
        return (self.q_proj(x).view(B, T, self.n_head, self.head_dim),
                self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim),
                self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim))

    def rotate(self, q, k, v, cos, sin):  # q/k-norm and RoPE; q, k, v come back (B, heads, T, D)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        return q, self.position_key(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def position_key(self, k, cos, sin):  # k_norm and RoPE of keys in the configured order
        if self.k_norm_after_rope:  # RoPE keeps the RMS: the orders differ by k_norm's weight
            return self.k_norm(apply_rope(k, cos, sin))
        return apply_rope(self.k_norm(k), cos, sin)

    def depth_step(self, q, k, v, src_k, src_v, e):
        """k, v mixed with the sources' records as the layer's row of DEPTH_MODES says; a decode
        step's one-call kernel (the same mix, faster) has no alpha for weights_sink."""
        if self.mode.decode_kernel and q.shape[2] == 1 and self.weights_sink is None:
            return depth_mix_one(q, k, v, src_k, src_v, self.mode)
        rule = () if self.depth_params is None else (self.depth_params, e)
        k, v, alpha = depth_mix(q, k, v, src_k, src_v, self.mode, rule)
        if self.weights_sink is not None:
            self.weights_sink(e, alpha)
        return k, v

    def store_and_attend(self, q, k, v, cache, e):
        """Store k, v in layer e's cache slots and attend. Returns (output, record)."""
        if cache is None:
            record = (k, v)
        else:
            pos = cache.pos
            k, v = cache.update(e, k, v)                                  # (B, n_kv, pos+T, D)
            record = (k[:, :, pos:], v[:, :, pos:])  # views of the slots just written
        y = causal_attention(q, k, v).transpose(1, 2)                     # (B, T, n_head, D)
        return self.o_proj(y.flatten(2)), record


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, attention=Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    # The pre-norm sublayers; the baselines call them with inputs of their own (baselines.py).
    def attend(self, x, cos, sin, src_k, src_v, cache, e):
        return self.self_attn(self.input_layernorm(x), cos, sin, src_k, src_v, cache, e)

    def feed_forward(self, x):
        return self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, src_k, src_v, cache, e):
        a, record = self.attend(x, cos, sin, src_k, src_v, cache, e)
        x = x + a
        return x + self.feed_forward(x), record


class GPT(nn.Module):
    attention_type = Attention  # the class of every block's attention: the seam for a variant
    cache_type = KVCache        # the cache new_cache makes: a variant may store less

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config, i, self.attention_type)
                                    for i in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The source rule per effective layer, and the last reader of each source (then freed).
        self.depth_sources = [config.sources(e) for e in range(config.n_eff_layer)]
        for e, src in enumerate(self.depth_sources):  # a fork's rule too: records exist below e
            need(src == sorted(set(src)) and all(0 <= j < e for j in src), f"ModelConfig: sources"
                 f"({e}) gives {src}: earlier layers 0 <= j < {e}, each once, ascending; fix the "
                 f"rule in ModelConfig.sources")
        self.last_reader = {j: e for e, src in enumerate(self.depth_sources) for j in src}
        rows = {m for a in self.modules() if isinstance(getattr(a, "depth_params", 0), nn.Module)
                for m in a.depth_params.modules()}  # a learned row keeps its own init (starts_as)
        self.apply(lambda module: module in rows or self._init_weights(module))

    def run_layers(self, x, cos, sin, cache):
        """The residual stream through every effective layer: the embeddings (B, T, n_embd) ->
        the final hidden state. The hidden-state baselines (baselines.py) override only this."""
        records = {}  # effective layer -> the (K, V) it stored, kept until its last reader
        for e in range(self.config.n_eff_layer):
            src = self.depth_sources[e]
            x, record = self.layers[e % self.config.n_layer](
                x, cos, sin, [records[j][0] for j in src], [records[j][1] for j in src], cache, e)
            for j in src:
                if self.last_reader[j] == e:
                    del records[j]
            if e in self.last_reader:
                records[e] = record
        return x

    def forward(self, idx, targets=None, cache: Optional[KVCache] = None):
        """idx: (B, T) token ids. Returns (logits (B, T, vocab), loss or None). With a cache, idx
        continues the sequence at position cache.pos (a prefill, a chunk or one token)."""
        T, pos = idx.shape[1], (cache.pos if cache is not None else 0)
        if pos + T > self.config.block_size:  # raise, not need(): no message built per forward
            raise ValueError(f"{pos + T} tokens exceed the context length {self.config.block_size}")
        if cache is not None and pos + T > cache.max_len:
            raise ValueError(f"the KV cache holds {cache.max_len} tokens, {pos + T} requested")
        wide = torch.promote_types(self.lm_head.weight.dtype, torch.float32)
        cos, sin = rope_tables(self.config, pos, T, idx.device, wide)
        x = self.run_layers(self.embed_tokens(idx), cos, sin, cache)          # (B, T, n_embd)
        if cache is not None:
            cache.advance(T)
        logits = self.lm_head(self.norm(x))                                    # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(
            fp32_or_wider(logits).flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k=None,
                 generator: Optional[torch.Generator] = None, cache_dtype=None):
        """Sample max_new_tokens after the prompt idx (B, T) with the KV cache (temperature 0:
        greedy). cache_dtype: K and V's dtype where not the parameters' (FSDP's bf16 compute)."""
        B, T = idx.shape
        need(T + max_new_tokens <= self.config.block_size, f"prompt ({T} tokens) + max_new_tokens "
             f"({max_new_tokens}) exceeds the context length block_size={self.config.block_size}; "
             f"shorten the prompt or ask for fewer tokens")
        cache = self.new_cache(B, T + max_new_tokens, dtype=cache_dtype)
        logits, _ = self(idx, cache=cache)
        out = [idx]
        for i in range(max_new_tokens):
            last = logits[:, -1].float()
            if temperature == 0:
                nxt = last.argmax(-1, keepdim=True)
            else:
                last = last / temperature
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.size(-1))).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                nxt = torch.multinomial(last.softmax(-1), 1, generator=generator)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits, _ = self(nxt, cache=cache)
        return torch.cat(out, 1)

    def new_cache(self, batch_size: int, max_len: Optional[int] = None, dtype=None) -> KVCache:
        p = self.lm_head.weight
        return self.cache_type(self.config, batch_size, max_len or self.config.block_size,
                               p.device, dtype or p.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
