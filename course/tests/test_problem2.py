"""Problem 2: the depth weights (group_mean, the depth query of a KV group; softmax_weights)."""
import pytest
import torch

from model import group_mean, softmax_weights

pytestmark = pytest.mark.problem2


def test_qbar_is_the_mean_of_each_group_of_query_heads(ref):
    for q, n_kv, want in ref["group_mean"]:
        got = group_mean(q.clone(), n_kv)
        assert got.shape == want.shape, (f"n_kv_head={n_kv}: shape {tuple(got.shape)}, "
                                         f"expected {tuple(want.shape)}")
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"n_kv_head={n_kv}: qbar differs"


def test_the_weights_are_a_softmax_over_the_candidates(ref):
    for qbar, keys, want in ref["softmax"]:
        got = softmax_weights(qbar.clone(), [k.clone() for k in keys])
        C = len(keys)
        assert got.shape == want.shape, (f"{C} candidates: alpha has shape {tuple(got.shape)}, "
                                         f"expected {tuple(want.shape)} (B, n_kv_head, C, T)")
        assert torch.allclose(got.sum(2).double(), torch.ones_like(got.sum(2)).double(),
                              atol=1e-6), "alpha does not sum to one over the candidates"
        tol = 1e-12 if qbar.dtype == torch.float64 else 2e-2  # bf16: scores rounded or not
        assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), \
            f"{C} candidates: alpha differs"


def test_the_softmax_runs_in_float32_for_bf16_activations(ref):
    """float32 weights, and float32's values: from the scores in bf16 (as the reference rounds
    them) or in float32; a bf16 softmax cast to float32 is 1e-3 away from both."""
    qbar, keys, want = next(s for s in ref["softmax"] if s[0].dtype == torch.bfloat16)
    got = softmax_weights(qbar, keys)
    assert got.dtype == torch.float32, f"alpha is {got.dtype}: compute the softmax in float32"
    assert any(torch.allclose(got, w.float(), rtol=0, atol=1e-6)
               for w in (want, ref["softmax_wide"])), "alpha is not a float32 softmax's"
