"""Problem 3: the mix, and what the cache stores (weighted_sum, depth_mix, depth_mix_one,
Attention.forward, Attention.store_and_attend, GPT.run_layers). The functions of problems 1, 2 and 4
answer from the reference's record here, so this problem is graded on its own."""
import pytest

import model
from course import fixtures

pytestmark = pytest.mark.problem3


@pytest.fixture(autouse=True)
def others_from_the_record(ref):
    with fixtures.replaying(3, ref["calls"]):
        yield


def close(got, want, what):
    assert got is not None and got.shape == want.shape, \
        f"{what}: shape {None if got is None else tuple(got.shape)}, expected {tuple(want.shape)}"
    gap = (got.double() - want.double()).abs().max().item()
    assert gap < 1e-10, f"{what} differs from the reference by {gap:.3g}"


def test_the_weighted_sum_of_the_candidates(ref):
    for alpha, xs, want in ref["weighted_sum"]:
        close(model.weighted_sum(alpha.clone(), [x.clone() for x in xs]), want,
              f"{len(xs)} candidates")


def test_depth_mix_mixes_what_each_mode_says(ref):
    for mode, args, want in ref["depth_mix"]:
        got = model.depth_mix(*args, model.DEPTH_MODES[mode], fast=False)
        what = f"depth_mode={mode}, {len(args[3])} sources, T={args[0].shape[2]}"
        for part, name in zip(range(3), ("the key", "the value", "alpha")):
            close(got[part], want[part], f"{what}: {name}")


def test_one_new_token_in_one_attention_call(ref):
    for mode, args, want in ref["depth_mix_one"]:
        k, v = model.depth_mix_one(*args, model.DEPTH_MODES[mode])
        close(k, want[0], f"depth_mix_one, {mode}: the key")
        close(v, want[1], f"depth_mix_one, {mode}: the value")
        k, v, alpha = model.depth_mix(*args, model.DEPTH_MODES[mode])  # fast by default: the kernel
        assert alpha is None, \
            "depth_mix(fast=True) of one token should run depth_mix_one (alpha None)"
        close(v, want[1], f"depth_mix of one token, {mode}: the value")


@pytest.mark.parametrize("name", fixtures.MODELS)
def test_the_model_gives_the_reference_logits(ref, name):
    idx, want = ref["models"][name]
    close(fixtures.build(name, ref["state"])(idx)[0], want, f"{name}: the logits")


@pytest.mark.parametrize("name", fixtures.CACHED)
def test_each_layer_stores_its_mixed_record_and_decoding_reads_it(ref, name):
    """KVCache.update answers from the record only when a layer writes what the reference wrote: in
    depth_mode=value its V slot holds the mixed value, in kv both slots are mixed."""
    idx, want = ref["models"][name]
    close(fixtures.decode(fixtures.build(name, ref["state"]), idx), want,
          f"{name}: cached decoding")
