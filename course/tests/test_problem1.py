"""Problem 1: the source rule S(l) (ModelConfig.stride and ModelConfig.sources)."""
import pytest

from model import ModelConfig

pytestmark = pytest.mark.problem1


def rules(ref):
    return [pytest.param(rule, stride, sources) for rule, stride, sources in ref["sources"]]


def describe(rule):
    return ", ".join(f"{k}={v}" for k, v in rule.items())


def test_the_default_stride_is_half_the_effective_depth(ref):
    for rule, stride, _ in ref["sources"]:
        if rule.get("depth_stride") is None:
            got = ModelConfig(**rule).stride
            assert got == stride, f"{describe(rule)}: stride {got}, expected {stride}"


def test_an_explicit_stride_is_kept(ref):
    for rule, stride, _ in ref["sources"]:
        if rule.get("depth_stride") is not None:
            assert ModelConfig(**rule).stride == stride, describe(rule)


def test_every_layer_has_the_sources_of_the_rule(ref):
    for rule, _, sources in ref["sources"]:
        config = ModelConfig(**rule)
        for e, want in enumerate(sources):
            got = config.sources(e)
            assert list(got) == want, f"{describe(rule)}: S({e}) = {got}, expected {want}"


def test_layer_zero_and_vanilla_have_no_sources(ref):
    for rule, _, _ in ref["sources"]:
        config = ModelConfig(**rule)
        assert config.sources(0) == []
        if rule.get("depth_mode") == "vanilla":
            assert all(config.sources(e) == [] for e in range(config.n_eff_layer)), describe(rule)


def test_the_paper_counts_117_candidates_at_48_layers():
    config = ModelConfig(n_layer=48, depth_stride=24)
    assert sum(len(config.sources(e)) + 1 for e in range(1, 48)) == 117  # sources plus
                                                                         # the layer itself
