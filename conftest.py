import gc
import random
import signal
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
# tests/'s shared modules (helpers, the naive reference) for test_model.py too, run alone.
sys.path.insert(1, str(ROOT / "tests"))
# A suite started in the background by a script (`cmd &`) inherits SIGINT ignored, and so would
# every script it starts (an ignored signal survives exec): the Ctrl-C tests would wait on scripts
# that never hear it. A handler, unlike SIG_IGN, is reset to the default in a child.
signal.signal(signal.SIGINT, signal.default_int_handler)

from baselines import build_model, make_config  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402

# helpers.cli's gc.collect() after each in-process script would walk every object torch made at
# import (0.25 s a call): they are frozen, out of the collector's sight.
gc.freeze()


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier, `python -m pytest -m fast`: what "
                            "makes a reader trust the model, and the README's first commands")


def tiny_config(**overrides) -> ModelConfig:
    """A model small enough for loops in Python. init_std is large on purpose: with the paper's
    0.02 the depth weights of a tiny random model are nearly uniform and a wrong mixing rule could
    hide."""
    base = dict(vocab_size=50, block_size=32, n_layer=4, n_head=4, n_kv_head=2, head_dim=8,
                n_embd=24, mlp_hidden=40, init_std=0.3, depth_mode="value", depth_stride=2)
    return make_config(**{**base, **overrides})


def tiny_model(seed=0, dtype=torch.float32, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = build_model(asdict(tiny_config(**overrides))).to(dtype)
    # Norm weights start at one; perturb them so a swapped or missing norm cannot pass unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def tiny_variant(seed=0, dtype=torch.float32, **overrides) -> GPT:
    """tiny_model with every parameter a plain vanilla GPT lacks (a baseline's, LIMe's routers)
    moved off its init too, so that no term of a variant's equations hides behind a special
    value."""
    model = tiny_model(seed, dtype, **overrides)
    with torch.no_grad():
        for name in added_parameters(model):
            p = model.get_parameter(name)
            p.add_(0.3 * torch.randn_like(p))
    return model


def added_parameters(model) -> list:
    """The names of the parameters a plain vanilla GPT of the model's shape lacks (a baseline's,
    LIMe's routers, a learned row's depth_params), less any empty one."""
    shape = {f.name: getattr(model.config, f.name) for f in fields(ModelConfig)}
    with torch.device("meta"):
        vanilla = GPT(ModelConfig(**{**shape, "depth_mode": "vanilla"}))
    backbone = {name for name, _ in vanilla.named_parameters()}
    return [name for name, p in model.named_parameters() if name not in backbone and p.numel()]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """A tiny corpus from a small grammar, prepared as bytes by prepare_data.py's text source:
    data_root/tiny."""
    import prepare_data
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat log and then".split()
    for i in range(10):
        text = "\n".join(" ".join(rng.choice(words) for _ in range(8)) + "." for _ in range(40))
        (root / f"doc{i}.txt").write_text(text)
    inputs = [str(root / "doc*.txt")]
    prepare_data.prepare(lambda: prepare_data.corpus("text", inputs, 1, 0.1, "strict"), "text",
                         "tiny", "bytes", root, num_proc=1)
    return root


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread than on threads that wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
