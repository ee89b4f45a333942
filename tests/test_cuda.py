"""What only a GPU can show, on one CUDA GPU; skipped without one. docs/gpu.md runs it beside the
commands that give the GPU figures (bench_cache.py and train.py at the paper's 1.5B shape).

At the 1.5B model's heads and width (configs/paper_1p5b_value.py: width 1536, 24 query / 6 KV heads
of 64) on 4 layers, for vanilla and Depth-Attention (value): which attention kernel SDPA can take
depends on the heads, the dtype and the mask, not on the depth. The CPU suite proves the same paths
structurally (no mask in training, prefill and decode: test_model.py); here the GPU's kernels are
held to it."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import train
from baselines import build_model
from helpers import ROOT
from lab.memory import plan
from model import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (docs/gpu.md)")

PAPER = train.read_config_file(ROOT / "configs" / "paper_1p5b_value.py", train.table(True))
SHAPE = {k: v for k, v in PAPER.items() if k in ModelConfig.__dataclass_fields__}
SHAPE.update(n_layer=4, depth_stride=2)  # every layer but the first mixes 2 or 3 candidates
MODES = ("vanilla", "value")
B, T = 2, 512  # sequences, and tokens per sequence (a prompt, for inference)
BF16_LOGITS = 0.02  # largest |bf16 - float32| logit over the logits' spread (their std), at init
PLAN = 0.10  # the memory plan off the allocator's peak of a bf16 training step, a fraction of it


def model(mode, **keys):
    torch.manual_seed(0)
    with torch.device("cuda"):
        return build_model({**SHAPE, **keys, "depth_mode": mode})


def tokens(n=T + 2):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, SHAPE["vocab_size"], (B, n), generator=g).cuda()


@pytest.mark.parametrize("mode", MODES)
def test_training_prefill_and_decode_run_on_flash_attention_alone(mode):
    """A bf16 training step, a prefill into an empty cache and a decode step, each with SDPA
    restricted to FlashAttention: torch raises when a call cannot take it (a mask, a dtype, a
    layout). Value's decode step calls SDPA twice a layer, for attention and for its depth step (one
    query over its candidates)."""
    net, toks = model(mode), tokens()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = net(toks[:, :T], toks[:, 1:T + 1])
        loss.backward()
        net = net.to(torch.bfloat16).eval()  # weights and cache in bf16 for inference
        with torch.no_grad():
            cache = net.new_cache(B, T + 1)
            net(toks[:, :T], cache=cache)
            logits, _ = net(toks[:, T:T + 1], cache=cache)
    assert torch.isfinite(loss) and torch.isfinite(logits).all() and cache.pos == T + 1


def test_a_bf16_training_step_compiles_in_one_graph():
    """torch.compile with inductor and fullgraph=True: a graph break would raise. The compiled
    step's loss and gradients are eager's, to bf16's rounding."""
    net, toks = model("value"), tokens()
    compiled = torch.compile(net, fullgraph=True)
    losses, grads = [], []
    for fwd in (compiled, net):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = fwd(toks[:, :T], toks[:, 1:T + 1])
        loss.backward()
        losses.append(loss.item())
        grads.append(net.lm_head.weight.grad.clone())
        net.zero_grad(set_to_none=True)
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1]), losses
    assert (grads[0] - grads[1]).norm() < 0.05 * grads[1].norm()


@pytest.mark.parametrize("mode", MODES)
def test_bf16_logits_agree_with_float32(mode):
    """train.py's precision on a GPU (bf16 autocast over float32 weights) against float32 (TF32
    off): every logit within BF16_LOGITS of the logits' spread."""
    net, toks = model(mode).eval(), tokens()
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            exact, _ = net(toks)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                half, _ = net(toks)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    err = (half.float() - exact).abs().max() / exact.std()
    assert err < BF16_LOGITS, f"bf16 logits differ from float32 by {err:.4f} of their spread"


def test_a_bf16_steps_peak_agrees_with_the_memory_plan():
    """The allocator's peak over a bf16 training step (weights, gradients, AdamW's state, the
    activations and autocast's weight copies) against lab/memory.py's plan of it, within PLAN
    (docs/memory.md: the plan leaves out only the CUDA context and library workspaces, which the
    allocator does not count either)."""
    net, toks = model("value"), tokens()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = net(toks[:, :T], toks[:, 1:T + 1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's state exists from here on, as in every step of a run
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    planned = plan(net.config, B, T, 1, "ddp", False, True)["total"]
    assert abs(planned - peak) < PLAN * peak, f"planned {planned / 2**30:.3f} GiB, measured " \
        f"{peak / 2**30:.3f} GiB"
