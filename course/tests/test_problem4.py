"""Problem 4: cached decoding (KVCache.update, KVCache.advance, causal_attention): a stack of layers
that writes each chunk into the cache in place, attends, and moves on once per forward gives what
one causal attention over the whole sequence gives."""
import pytest
import torch

from model import KVCache, ModelConfig, causal_attention

pytestmark = pytest.mark.problem4


def close(got, want, what):
    assert got.shape == want.shape, \
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    gap = (got.double() - want.double()).abs().max().item()
    assert gap < 1e-10, f"{what} differs from the reference by {gap:.3g}"


def test_causal_attention_over_a_whole_sequence(ref):
    for e, (qkv, want) in enumerate(zip(ref["attention"]["layers"], ref["attention"]["outputs"])):
        close(causal_attention(*qkv), want, f"layer {e}")


def test_a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence(ref):
    layers, outputs, chunks = (ref["attention"]["layers"], ref["attention"]["outputs"],
                               ref["attention"]["chunks"])
    B, n_kv, T, D = layers[0][1].shape
    config = ModelConfig(n_layer=len(layers), n_head=layers[0][0].shape[1], n_kv_head=n_kv,
                         head_dim=D, block_size=T)
    cache = KVCache(config, B, T, dtype=torch.float64)
    start = 0
    for n in chunks:
        end = start + n
        for e, (q, k, v) in enumerate(layers):
            K, V = cache.update(e, k[:, :, start:end], v[:, :, start:end])
            assert cache.pos == start, (f"update moved cache.pos to {cache.pos}: "
                                        f"the position moves once per forward, "
                                        f"after every layer wrote (advance)")
            close(K, k[:, :, :end], f"chunk {start}..{end - 1}, layer {e}: the keys update returns")
            close(V, v[:, :, :end],
                  f"chunk {start}..{end - 1}, layer {e}: the values update returns")
            assert (K.data_ptr() == cache.k[e].data_ptr()
                    and V.data_ptr() == cache.v[e].data_ptr()), \
                ("update should return views of the cache's own tensors (written in place), "
                 "not copies")
            close(causal_attention(q[:, :, start:end], K, V), outputs[e][:, :, start:end],
                  f"chunk {start}..{end - 1}, layer {e}: attention over the cache")
        cache.advance(n)
        assert cache.pos == end, (f"after a chunk of {n} tokens from {start}, "
                                  f"cache.pos is {cache.pos}, not {end}")
        start = end
    close(cache.k, torch.stack([k for _, k, _ in layers]), "the cache's keys at the end")
