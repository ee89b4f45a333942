"""
Depth-Attention (arXiv 2606.05014) on a Qwen3-style decoder, in one file.

Before layer l attends over the sequence, its query attends over the keys that a few earlier layers stored
*at the same token position* and mixes their values into its own value (`depth_mix`, paper section 2).
The mixed value is what goes into the V cache, so inference keeps exactly a normal KV cache (`KVCache`).
The closest prior method, LIMe (Layer-Integrated Memory), is depth_mode="lime" (`lime_mix`): a learned static
router mixes the raw keys and values of the earlier layers' heads, and the mixture is what goes into the cache.

Reading order: ModelConfig and the source rule, `depth_mix` (the method), `lime_mix`, `KVCache`, then the
decoder (RoPE, RMSNorm, Attention, MLP, Block, GPT) and `depth_cost` (paper Table 2). This file imports only
torch and the standard library; the paper's hidden-state baselines build on it in baselines.py, Hugging Face
folders in hf.py.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

DEPTH_MODES = ("vanilla", "uniform", "key", "kv", "value", "lime")
MIXES_KEY = ("key", "kv", "lime")                  # modes whose cache K slot holds the depth-mixed key
MIXES_VALUE = ("value", "uniform", "kv", "lime")   # modes whose cache V slot holds the depth-mixed value


def config_check(name):
    """need(ok, msg): a ValueError "name: msg" unless ok. A config's checks read as a list of rules."""
    def need(ok, msg):
        if not ok:
            raise ValueError(f"{name}: {msg}")
    return need


@dataclass
class ModelConfig:
    vocab_size: int = 50304         # tokenizer vocabulary (paper: GPT-NeoX 50304)
    block_size: int = 1024          # context length in tokens (paper: 2048)
    n_layer: int = 12               # distinct blocks (paper 3B: 48)
    n_head: int = 12                # query heads (paper 3B: 32)
    n_kv_head: int = 4              # key/value heads: = n_head is MHA, 1 is MQA, else GQA (paper 3B: 8)
    head_dim: int = 64              # per-head width (paper: 64)
    n_embd: int = 768               # hidden size (paper 3B: 2048)
    mlp_hidden: int = 2048          # SwiGLU inner width (paper 3B: 6912)
    rope_theta: float = 10000.0     # RoPE base (paper: 1e4)
    qk_norm: bool = True            # per-head RMSNorm on q and k before RoPE, as in Qwen3
    k_norm_after_rope: bool = False  # apply k_norm after RoPE (q_norm stays before): the authors' released model
    tie_embeddings: bool = False    # share token embedding and lm_head (paper: untied)
    norm_eps: float = 1e-6          # RMSNorm epsilon (Qwen3 default)
    init_std: float = 0.02          # std of normal init for every Linear and the embedding (paper 3B: 0.01)
    depth_mode: str = "value"       # vanilla | uniform | key | kv | value | lime (value = Depth-Attention)
    depth_stride: Optional[int] = None  # source every `stride`-th layer; None = half the effective depth (lime: 1)
    depth_recent_window: int = 0    # also use the r most recent earlier layers as sources (paper: 0)
    n_loops: int = 1                # apply the same n_layer blocks this many times (looped Transformer)

    def __post_init__(self):
        need = config_check("ModelConfig")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "head_dim", "n_embd",
                     "mlp_hidden", "n_loops"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.n_head % self.n_kv_head == 0,
             f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}); "
             f"pick n_kv_head from the divisors of n_head")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        need(self.depth_mode in DEPTH_MODES,
             f"unknown depth_mode {self.depth_mode!r}; choose one of {', '.join(DEPTH_MODES)}")
        need(self.depth_stride is None or (isinstance(self.depth_stride, int) and self.depth_stride >= 1),
             f"depth_stride must be an integer >= 1 (1 = every earlier layer, >= n_layer = layer 0 only) "
             f"or None for half the depth, got {self.depth_stride!r}")
        need(isinstance(self.depth_recent_window, int) and self.depth_recent_window >= 0,
             f"depth_recent_window must be an integer >= 0, got {self.depth_recent_window!r}")
        need(self.init_std > 0 and self.rope_theta > 0 and self.norm_eps > 0,
             "init_std, rope_theta and norm_eps must be positive")

    @property
    def n_eff_layer(self) -> int:
        """Effective depth: the depth index, the source rule and the cache slots all run over it."""
        return self.n_layer * self.n_loops

    @property
    def stride(self) -> int:
        if self.depth_stride is not None:
            return self.depth_stride
        # LIMe reads every earlier layer; Depth-Attention's default is half the depth (paper section 2.3)
        return 1 if self.depth_mode == "lime" else max(1, self.n_eff_layer // 2)

    def sources(self, e: int) -> list[int]:
        """S(e) = {j < e : j % stride == 0} U {e-r, ..., e-1}, ascending (paper section 2.3). Layer 0 has none.
        lime's default (stride 1, no window) is LIMe's: every earlier effective layer."""
        if self.depth_mode == "vanilla" or e == 0:
            return []
        picked = {j for j in range(e) if j % self.stride == 0}
        picked |= set(range(max(0, e - self.depth_recent_window), e))
        return sorted(picked)


# ----------------------------------------------------------------------------- the method

def fp32_or_wider(x):
    """x in float32 for bf16/fp16, else as it is: the precision of softmax, norms, RoPE and the loss."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def group_sum(q, g):
    """The sum of the g query heads that share each KV head, (B, n_head, T, D) -> (B, n_kv_head, T, D): g * qbar.
    Query head h reads KV head h // g, so group r is heads r*g .. r*g + g-1. Added slice by slice: a reduction
    over a dim of 2 to 4 is several times slower on CPU."""
    return sum((q[:, i::g] for i in range(1, g)), q[:, 0::g])


def depth_mix(q, k, v, src_k, src_v, mode, with_alpha=True):
    """The depth step of layer l at every position t at once (paper sections 2.1-2.2).

    q: (B, n_head, T, D) this layer's queries; k, v: (B, n_kv_head, T, D) its new key and value.
    src_k, src_v: lists over the sources j in S(l), each (B, n_kv_head, T, D): what source j stored in
    its own cache slots at the same positions (already mixed, so the mixing is recursive).
    Candidates are the sources in ascending order, then the layer itself.

      qbar_t  = mean of the g = n_head / n_kv_head query heads sharing a KV head
      s_c     = <qbar_t, K_c,t> / sqrt(D)
      alpha   = softmax_c(s) in float32              (uniform: 1 / number of candidates)
      vt_t    = sum_c alpha_c V_c,t   (value, uniform, kv);   kt_t = sum_c alpha_c K_c,t   (key, kv)

    q and k arrive after RoPE; every candidate carries the same rotation R_t, so the scores equal those of
    the unrotated vectors and mixing keys commutes with the rotation (see the README, "Where we deviate").
    Returns (k_out, v_out, alpha) with alpha: (B, n_kv_head, T, C) float32, C = len(src_k) + 1. A decode step
    (T = 1) with with_alpha=False runs depth_mix_one instead and returns alpha None (uniform: never). Both keep
    the softmax in float32; the kernel also its scores, which these passes round to the activations' dtype first
    (bf16: the two differ by that rounding, float32: not at all).
    """
    if q.shape[2] == 1 and not with_alpha and mode != "uniform":
        return (*depth_mix_one(q, k, v, src_k, src_v, mode), None)
    keys, values = src_k + [k], src_v + [v]
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    # One vector op per candidate, each reading a record in place: backward keeps the records themselves
    # (alive for attention anyway), never a stacked copy of the candidates per layer. The weights are laid
    # out (B, n_kv_head, C, T), so the softmax and every weight slice run along contiguous positions.
    if mode == "uniform":
        wide = torch.promote_types(q.dtype, torch.float32)
        alpha = q.new_full((B, n_kv, len(keys), T), 1.0 / len(keys), dtype=wide)
    else:
        g = H // n_kv
        qsum = group_sum(q, g)                                                      # (B, n_kv_head, T, D)
        scores = torch.stack([torch.linalg.vecdot(qsum, kc) for kc in keys], 2)    # (B, n_kv_head, C, T)
        alpha = (fp32_or_wider(scores) / (g * math.sqrt(D))).softmax(2)           # 1/g: qbar from the sum

    def mix(xs):
        w = alpha.to(xs[0].dtype).unsqueeze(-1)                                     # (B, n_kv_head, C, T, 1)
        out = w[:, :, 0] * xs[0]
        for c in range(1, len(xs)):
            out.addcmul_(w[:, :, c], xs[c])
        return out

    k_out, v_out = (mix(keys) if mode in MIXES_KEY else k), (mix(values) if mode in MIXES_VALUE else v)
    return k_out, v_out, alpha.transpose(2, 3)


def depth_mix_one(q, k, v, src_k, src_v, mode):
    """depth_mix for one new token (a decode step), where the cost is the number of operations, not their
    bytes. The depth step is attention with one query (qbar) over C keys (the candidates), so one
    scaled_dot_product_attention call over the candidates laid along its key axis does the scores, the float32
    softmax and the mix. For longer chunks depth_mix's passes over the records in place are faster, and stack
    nothing that backward would keep. q: (B, n_head, 1, D); k, v and the records (B, n_kv_head, 1, D)."""
    g, D = q.shape[1] // k.shape[1], q.shape[3]
    qsum = group_sum(q, g)                                                         # (B, n_kv_head, 1, D)
    keys = torch.cat(src_k + [k], 2)                                               # (B, n_kv_head, C, D)

    def mix(xs):  # scale 1/g makes the sum the mean qbar
        return F.scaled_dot_product_attention(qsum, keys, xs, scale=1 / (g * math.sqrt(D)))  # (B, n_kv_head, 1, D)

    return (mix(keys) if mode in MIXES_KEY else k), (mix(torch.cat(src_v + [v], 2)) if mode in MIXES_VALUE else v)


def lime_mix(router, ks, vs):
    """LIMe's step at layer l, every position at once (Layer-Integrated Memory: the paper "You Do Not Fully
    Utilize Transformer's Representation Capacity", arXiv 2502.09245, and its released code).

    ks, vs: lists over the candidates, the sources S(l) ascending then layer l itself, each (B, T, R, D) with
    R = n_kv_head: the raw key and value projections, before k_norm, RoPE and any mixing.
    router W: (R, C * R), C = len(ks); column c * R + r' is head r' of candidate c:

      kt_{t,r} = sum_{c, r'} W[r, c R + r'] k_{c,t,r'},   vt_{t,r} = the same sum over v

    one static weight per (head, candidate head), shared by K and V, raw (no softmax). Accumulated one
    candidate at a time, each product reading a record in place: backward keeps the records themselves, never
    a stacked copy of every earlier layer per layer, which would grow with depth squared (LIMe's code
    concatenates its buffer at every layer). Returns kt, vt: (B, T, R, D).
    """
    R = router.shape[0]
    w = router.view(R, len(ks), R).unbind(1)                         # (R, C, R) -> C blocks W[:, cR:(c+1)R]

    def mix(xs):  # an expanded (not reshaped) W keeps matmul from saving a transposed copy of x
        return sum(torch.matmul(wc.expand(*x.shape[:-2], R, R), x) for wc, x in zip(w, xs))

    return mix(ks), mix(vs)


def init_lime_router(w):
    """LIMe's init (their code): uniform in +-sqrt(3 / fan_in), fan_in = C * R, so each head starts as a
    unit-variance random mix of every candidate head, plus itself: the layer's own block (the last R columns)
    is the identity. Not vanilla at init: the other blocks are random."""
    R, fan_in = w.shape
    bound = math.sqrt(3 / fan_in)
    with torch.no_grad():
        w.uniform_(-bound, bound)
        w[:, -R:] = torch.eye(R, dtype=w.dtype, device=w.device)


# ----------------------------------------------------------------------------- the KV cache

class KVCache:
    """Preallocated K/V for every effective layer: (n_eff_layer, B, n_kv_head, max_len, head_dim) each.

    Holds exactly what each layer stored: the mixed V for value/uniform, the mixed K for key, both for kv/lime,
    and nothing else, so its size is the same for every mode:
    2 * n_layer * n_loops * n_kv_head * head_dim * bytes_per_element bytes per token per sequence.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device=None, dtype=torch.float32):
        if max_len > config.block_size:
            raise ValueError(f"KVCache max_len {max_len} exceeds the context length block_size="
                             f"{config.block_size}; shorten the prompt or the number of new tokens")
        shape = (config.n_eff_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # tokens written so far; advanced by GPT.forward after all layers ran

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Per token of one sequence: vanilla's, in every mode (paper section 2.4)."""
        return self.nbytes // (self.k.shape[1] * self.max_len)

    def update(self, e: int, k, v):
        """Write layer e's records for the current chunk; return its K, V over positions 0..pos+T-1."""
        end = self.pos + k.shape[2]
        self.k[e, :, :, self.pos:end] = k
        self.v[e, :, :, self.pos:end] = v
        return self.k[e, :, :, :end], self.v[e, :, :, :end]


# ----------------------------------------------------------------------------- the decoder

def rope_tables(config: ModelConfig, start: int, T: int, device, dtype):
    """cos, sin for positions start .. start+T-1, (T, D). Computed on the fly in the model's parameter
    precision (float32, or float64 for exact tests), which every backend supports and keeps long positions
    accurate; apply_rope casts them to the activations."""
    dims = torch.arange(0, config.head_dim, 2, device=device, dtype=dtype)
    inv_freq = 1.0 / config.rope_theta ** (dims / config.head_dim)                 # (D/2,)
    freqs = torch.outer(torch.arange(start, start + T, device=device, dtype=dtype), inv_freq)
    freqs = torch.cat([freqs, freqs], -1)                                           # (T, D)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (the Llama/Qwen3 layout); x: (B, heads, T, D), cos/sin: (T, D)."""
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in at least float32 (bf16 activations under autocast), as Qwen3 does.
        return F.rms_norm(fp32_or_wider(x), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def causal_attention(q, k, v):
    """Causal attention where q's T queries are the last T of k's S positions (a cache continues at S - T).
    The calls a GPU runs most take no mask, so FlashAttention serves them: training and a prefill into an empty
    cache (T = S) are is_causal, a decode step (T = 1) sees every key. Only a chunk that continues a filled cache
    needs the diagonal moved to the bottom right: causal_lower_right, which CUDA runs on flash in bf16/fp16 (with
    grouped KV heads the memory-efficient kernel does not apply) and otherwise, like the CPU, as a boolean mask.
    is_causal stays a literal: under torch.compile with dynamic shapes `T > 1` would be a symbolic bool, which
    SDPA refuses."""
    T, S = q.shape[2], k.shape[2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.head_dim, self.mode = c.n_head, c.n_kv_head, c.head_dim, c.depth_mode
        self.k_norm_after_rope = c.k_norm_after_rope
        self.q_proj = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else nn.Identity()
        if c.depth_mode == "lime":  # a router per effective layer e this block runs at (none at e = 0), keyed by e
            self.lime_router = nn.ParameterDict({
                str(e): nn.Parameter(torch.empty(c.n_kv_head, (len(c.sources(e)) + 1) * c.n_kv_head))
                for e in range(layer, c.n_eff_layer, c.n_layer) if e > 0})  # filled by init_lime_router

    capture = False  # GPT.capture_depth_weights: the depth weights are wanted, so depth_mix returns them

    def forward(self, x, cos, sin, src_k, src_v, cache, e):
        B, T, _ = x.shape
        lime = self.mode == "lime"
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)                  # (B, T, n_head, D)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)               # (B, T, n_kv_head, D)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        raw = (k, v)  # LIMe's record: what later layers mix, before k_norm, RoPE and any mixing
        if lime and src_k:  # k_norm and RoPE then act on the mixed key, as on any key attention reads
            k, v = lime_mix(self.lime_router[str(e)], src_k + [k], src_v + [v])
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)                   # (B, n_head, T, D)
        if self.k_norm_after_rope:  # RoPE keeps the RMS, so the orders differ only through k_norm's weight
            k = self.k_norm(apply_rope(k.transpose(1, 2), cos, sin))               # (B, n_kv_head, T, D)
        else:
            k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)               # (B, n_kv_head, T, D)
        v = v.transpose(1, 2)                                                       # (B, n_kv_head, T, D)
        alpha = None
        if src_k and not lime:  # the sources S(e) (ModelConfig.sources): none in vanilla and at layer 0
            k, v, alpha = depth_mix(q, k, v, src_k, src_v, self.mode, with_alpha=self.capture)
        # record: what this layer stores; later layers' depth steps read exactly this (paper section 2.4), but
        # LIMe's read the raw projections
        if cache is None:
            record = (k, v)
        else:
            pos = cache.pos
            k, v = cache.update(e, k, v)                                            # (B, n_kv_head, pos+T, D)
            record = (k[:, :, pos:], v[:, :, pos:])  # views of the slots just written: no second copy
        y = causal_attention(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)            # (B, T, n_head * D)
        return self.o_proj(y), raw if lime else record, alpha


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    # The two pre-norm sublayers, each returning what is added to the stream; the baselines (baselines.py)
    # call them with their own inputs, so a change here reaches them too.
    def attend(self, x, cos, sin, src_k, src_v, cache, e):
        return self.self_attn(self.input_layernorm(x), cos, sin, src_k, src_v, cache, e)

    def feed_forward(self, x):
        return self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, src_k, src_v, cache, e):
        a, record, alpha = self.attend(x, cos, sin, src_k, src_v, cache, e)
        x = x + a
        return x + self.feed_forward(x), record, alpha


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Source rule per effective layer, and the last layer that reads each source (records are freed then).
        self.depth_sources = [config.sources(e) for e in range(config.n_eff_layer)]
        self.last_reader = {j: e for e, src in enumerate(self.depth_sources) for j in src}
        self._alpha_sink = None
        self.apply(self._init_weights)
        for w in self.lime_routers():  # after the backbone, so a seed gives lime vanilla's other weights
            init_lime_router(w)

    def run_layers(self, x, cos, sin, cache):
        """The residual stream through every effective layer: embeddings (B, T, n_embd) -> final hidden state.
        The hidden-state baselines (baselines.py) override only this."""
        records = {}  # effective layer -> (K, V) it stored for these positions, kept until its last reader
        for e in range(self.config.n_eff_layer):
            src = self.depth_sources[e]
            x, record, alpha = self.layers[e % self.config.n_layer](
                x, cos, sin, [records[j][0] for j in src], [records[j][1] for j in src], cache, e)
            for j in src:
                if self.last_reader[j] == e:
                    del records[j]
            if e in self.last_reader:
                records[e] = record
            if self._alpha_sink is not None and alpha is not None:
                self._alpha_sink[e] = (src, alpha.detach())
        return x

    def forward(self, idx, targets=None, cache: Optional[KVCache] = None):
        """idx: (B, T) token ids. Returns (logits (B, T, vocab), loss or None).
        With a cache, idx continues the sequence at position cache.pos (prefill, a chunk or one token)."""
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the context length block_size="
                             f"{self.config.block_size}")
        if cache is not None and pos + T > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens, {pos + T} requested; make a larger cache")
        wide = torch.promote_types(self.lm_head.weight.dtype, torch.float32)
        cos, sin = rope_tables(self.config, pos, T, idx.device, wide)
        x = self.run_layers(self.embed_tokens(idx), cos, sin, cache)               # (B, T, n_embd)
        if cache is not None:
            cache.pos += T
        logits = self.lm_head(self.norm(x))                                         # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(fp32_or_wider(logits).view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, cache_dtype=None):
        """Sample max_new_tokens after the prompt idx (B, T) with the KV cache; temperature 0 is greedy.
        cache_dtype: the dtype K and V are computed in, where it is not the parameters' (None: theirs), e.g.
        bf16 under FSDP's mixed precision, which keeps float32 parameters and computes in bf16."""
        B, T = idx.shape
        if T + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} "
                             f"exceeds the context length block_size={self.config.block_size}; shorten the "
                             f"prompt or ask for fewer tokens")
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
        return KVCache(self.config, batch_size, max_len or self.config.block_size, p.device, dtype or p.dtype)

    @contextmanager
    def capture_depth_weights(self):
        """Collect the depth weights of every forward inside the block, for analysis:
        {effective layer e: (sources S(e), alpha (B, n_kv_head, T, |S(e)| + 1) float32, detached)}.
        Off by default (a decode step's fused kernel does not return its weights, depth_mix_one). lime has no
        per-token weights (its router is a parameter, GPT.lime_routers): nothing is collected."""
        sink = {}
        attns = [m for m in self.modules() if isinstance(m, Attention)]
        self._alpha_sink = sink
        for m in attns:
            m.capture = True
        try:
            yield sink
        finally:
            self._alpha_sink = None
            for m in attns:
                m.capture = False

    def lime_routers(self) -> list:
        """LIMe's router matrices (depth_mode="lime"; none otherwise): train.py gives them their own learning
        rate and no weight decay."""
        return [p for name, p in self.named_parameters() if ".lime_router." in name]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)


# ----------------------------------------------------------------------------- analytic cost (paper Table 2)

def depth_cost(config: ModelConfig, bytes_per_element: int = 2) -> dict:
    """Per-token extra cost of the depth step over vanilla, from the paper's formulas (Table 2).

    C = number of candidates (sources plus self) summed over the layers that mix, d_kv = n_kv_head * head_dim.
    value (the paper's row): FLOPs 4 * d_kv * C (2 for the scores, 2 for the mix); activation I/O
    bytes * (2 * C + L) * d_kv (read K and V of every candidate, write one mixed vector per layer).
    Other modes scale the same terms: uniform has no scores and reads only V; key/kv mix K (and V).
    lime (LIMe) has no scores and mixes K and V, but every output head reads all R = n_kv_head heads of a
    candidate layer: FLOPs 4 * R * d_kv * C; I/O bytes * (2 * C + 2 * L) * d_kv (read each candidate's raw
    K and V once, write the mixed K and V); its router adds R^2 * C parameters (extra_params; with the default
    every-earlier-layer sources C = L (L + 1) / 2 - 1). Candidates count layers, not heads.
    The persistent state (KV cache) is unchanged in every mode.
    """
    L, d_kv, mode = config.n_eff_layer, config.n_kv_head * config.head_dim, config.depth_mode
    C = sum(len(config.sources(e)) + 1 for e in range(1, L)) if mode != "vanilla" else 0
    mixing_layers = L if C else 0  # the paper counts L written vectors (Table 2 uses L = 48)
    n_mix = (mode in MIXES_KEY) + (mode in MIXES_VALUE)  # vectors mixed per layer: K, V or both
    scored = mode not in ("vanilla", "uniform", "lime")  # uniform and lime have fixed weights: no scores
    heads_read = config.n_kv_head if mode == "lime" else 1  # candidate heads per output head
    score_flops = 2 * d_kv * C if scored else 0
    reads = C * ((scored or mode in MIXES_KEY) + (mode in MIXES_VALUE))  # each candidate's K and/or V, once
    return {
        "candidates": C,
        "flops_per_token": score_flops + 2 * d_kv * C * n_mix * heads_read,
        "io_bytes_per_token": bytes_per_element * (reads + n_mix * mixing_layers) * d_kv,
        "extra_persistent_bytes": 0,
        "extra_params": config.n_kv_head ** 2 * C if mode == "lime" else 0,
    }
