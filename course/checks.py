"""
How the trusted parent judges a student's results: one line saying what differs (never the
reference's output), or None. float64 scenarios compare to 1e-10 (another order of operations
passes, another formula does not); bf16 ones with the float64 value within what bf16 rounding
can change.
"""
import math

import torch

from course import fixtures

BF16_UNIT = 2.0 ** -8  # bf16's unit roundoff: 8 bits of significand
DECODED = ("cached decoding", "the keys the cache holds", "the values the cache holds")
PARTS = {"depth_mix_mixes_what_each_mode_says": ("the key", "the value", "alpha"),
         "one_new_token_in_one_attention_call": ("the key", "the value"),
         "together": ("the full forward", *DECODED),
         "each_layer_stores_its_mixed_record_and_decoding_reads_it": DECODED}


def close(got, want, what, tol=1e-10):
    if not isinstance(got, torch.Tensor):
        return f"{what}: returned {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    gap = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not gap <= tol * max(1.0, want.double().abs().max().item() if want.numel() else 1.0):
        return f"{what} differs from the reference by {gap:.3g}"
    return None


def rounded(got, exact, bound, why):
    """got within bound of the float64 exact value, element by element."""
    if got.shape != exact.shape:
        return f"{why}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    off = (got.double() - exact).abs()
    return None if (off <= bound).all() else f"{why} (off by {off.max().item():.3g})"


def first(*reasons):
    return next((r for r in reasons if r), None)


def softmax_bf16(got, args, what):
    """float32 weights within what any rounding of the bf16 scores gives: each score may move by
    D units of bf16 rounding of the sum of |products| (rounded products, summed in bf16), and the
    softmax of scores moved by at most d_c moves alpha_c by at most
    alpha_c (exp(d_c + max d) - 1)."""
    qbar, keys = args
    if not isinstance(got, torch.Tensor) or got.dtype != torch.float32:
        return f"{what}: alpha is {getattr(got, 'dtype', type(got).__name__)}: compute the " \
               f"softmax in float32"
    q, ks = qbar.double(), [k.double() for k in keys]
    D = q.shape[-1]
    scores = torch.stack([(q * k).sum(-1) for k in ks], 2) / math.sqrt(D)
    spread = torch.stack([(q * k).abs().sum(-1) for k in ks], 2) / math.sqrt(D) * D * BF16_UNIT
    alpha = scores.softmax(2)
    bound = alpha * torch.expm1(spread + spread.amax(2, keepdim=True)) + 1e-6
    return rounded(got, alpha, bound, f"{what}: alpha is not a float32 softmax of <qbar, K_c> / "
                                      f"sqrt(D) over the candidates")


def weighted_bf16(got, args, what):
    alpha, xs = args
    if not isinstance(got, torch.Tensor) or got.dtype != xs[0].dtype:
        return f"{what}: the sum is {getattr(got, 'dtype', type(got).__name__)}, the records " \
               f"{xs[0].dtype}: return it in the records' dtype"
    terms = [alpha[:, :, c].double().unsqueeze(-1) * x.double() for c, x in enumerate(xs)]
    exact, size = sum(terms), sum(t.abs() for t in terms)
    return rounded(got, exact, 2 * (len(xs) + 1) * BF16_UNIT * size + 1e-6,
                   f"{what} differs from sum_c alpha_c X_c by more than bf16 rounding")


def logits_bf16(got, want, what):
    """bf16 logits near the reference's: the float64 scenarios check the formula."""
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bfloat16:
        return f"{what}: the logits are {getattr(got, 'dtype', type(got).__name__)}, not bf16"
    return close(got, want, what, tol=0.1)


def empty_sources(got, want, what):
    if not isinstance(got, list) or len(got) != len(want):
        return f"{what}: {len(got) if isinstance(got, list) else got} layers' sources, " \
               f"expected {len(want)}"
    if got[0] != []:
        return f"{what}: S(0) = {got[0]}, expected []"
    if all(w == [] for w in want) and any(got):
        return f"{what}: a mode without a depth step has sources {got}"
    return None


def parts(got, want, what, names):
    if not isinstance(got, list) or len(got) != len(want):
        return f"{what}: returned {type(got).__name__}, expected {len(want)} results"
    return first(*(close(g, w, f"{what}: {n}") for g, w, n in zip(got, want, names)))


def cached(got, want, what):
    """A KVCache call on a state the parent sent: the state it leaves, then what it returned."""
    if not isinstance(got, list) or len(got) != 2 or not isinstance(got[1], dict):
        return f"{what}: the call did not return a result and the cache's state"
    (result, state), (wanted, after) = got, want
    if state.get("pos") != after["pos"]:
        return f"{what}: cache.pos is {state.get('pos')} after it: update writes at pos, advance " \
               f"moves it on once per forward, after every layer wrote"
    return first(close(state.get("k"), after["k"], f"{what}: the keys the cache holds after it"),
                 close(state.get("v"), after["v"], f"{what}: the values the cache holds after it"),
                 wanted is not None and parts(result, wanted, what, ("the keys update returns",
                                                                     "the values update returns")))


def judge(test, got, want, args, what, op=None):
    """One scenario of a test: None, or why it fails."""
    if op in ("backward", "gradients"):  # each input's (or parameter's) gradient
        return parts(got, want, what, [f"the gradient of input {i}" for i in range(len(want))])
    if test in ("the_default_stride_is_the_modes_or_half_the_effective_depth",
                "an_explicit_stride_is_kept"):
        return None if got == want else f"{what}: stride {got} is not the rule's"
    if test == "every_layer_has_the_sources_of_the_rule":
        return next((f"{what}: S({e}) = {g} is not the rule's" for e, (g, w)
                     in enumerate(zip(got, want)) if g != w), None) if isinstance(got, list) \
            and len(got) == len(want) else f"{what}: {got} is not the rule's"
    if test == "layer_zero_and_vanilla_have_no_sources":
        return empty_sources(got, want, what)
    if test == "the_paper_counts_117_candidates_at_48_layers":
        count = fixtures.candidates(got)
        return None if count == want else f"{what}: {count} candidates, expected {want}"
    if test == "the_softmax_runs_in_float32_for_bf16_activations":
        return softmax_bf16(got, args, what)
    if test == "the_weighted_sum_of_the_candidates" and args[1][0].dtype == torch.bfloat16:
        return weighted_bf16(got, args, what)
    if test == "a_bf16_model_runs_in_bf16":
        return logits_bf16(got, want, what)
    if test in PARTS:
        return parts(got, want, what, PARTS[test])
    if op == "call":
        return cached(got, want, what)
    tol = 1e-12 if test == "qbar_is_the_mean_of_each_group_of_query_heads" else 1e-10
    return close(got, want, what, tol)
