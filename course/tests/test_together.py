"""Not graded: every problem at once, nothing replayed. Cached decoding equals the full forward in
every mode, and both equal the reference."""
import pytest
import torch

from course import fixtures

pytestmark = [pytest.mark.together, pytest.mark.usefixtures("problems_pass")]


@pytest.mark.parametrize("name", fixtures.MODELS)
def test_the_whole_model(ref, name):
    idx, want = ref["models"][name]
    gpt = fixtures.build(name, ref["state"])
    full, cached = gpt(idx)[0], fixtures.decode(gpt, idx)
    assert torch.allclose(full, want, rtol=0, atol=1e-10), (f"{name}: the logits differ "
                                                            f"from the reference")
    assert torch.allclose(cached, full, rtol=0, atol=1e-10), (f"{name}: cached decoding differs "
                                                              f"from the full forward")
