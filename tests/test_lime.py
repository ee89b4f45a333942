"""LIMe (depth_mode="lime", baselines.LIMe): a naive reference written from its equations, and
beyond the contract every variant passes (tests/test_contract.py): its router's parameters and init,
what it reduces to, its optimizer group, its cost row, its training memory, and train.py and
sample.py."""
import math

import pytest
import torch

from baselines import LIMe
from support.variants import build_model, make_config
from conftest import tiny_config, tiny_model
from model import ModelConfig
from support.cost import depth_cost
import sample
from support import hf, memory
from support.depth_weights import capture
from helpers import TINY_SHORT, eval_losses, resumed_losses, train
from reference import (MODEL_REFERENCES, assert_matches_reference, ref_attention, ref_mlp,
                       ref_positioned, ref_projections, ref_sources, rms)
import train as train_script
from support import run_config

LIME = dict(depth_mode="lime", depth_stride=None)  # LIMe as published: every earlier layer


def lime_reference(model, idx):
    """Logits with loops over rows, layers, positions and heads: at layer e >= 1, head r of the new
    key (value) is sum over candidates c and their heads r' of W_e[r, c R + r'] times the raw key
    (value) projection k_{c,t,r'}; then k_norm and RoPE; every layer's record is its raw k, v."""
    c = model.config
    L, R = c.n_eff_layer, c.n_kv_head
    stride = c.depth_stride if c.depth_stride is not None else 1  # LIMe: every earlier layer
    rows = []
    for row in idx:
        x, raw = model.embed_tokens.weight[row], {}  # raw: effective layer -> its (k, v) (T, R, D)
        for e in range(L):
            blk = model.layers[e % c.n_layer]
            q, k, v = ref_projections(blk, c, x)
            raw[e], src = (k, v), ref_sources(e, stride, c.depth_recent_window)
            if src:
                W, cands = blk.self_attn.lime_router[str(e)], [raw[s] for s in src] + [(k, v)]
                k, v = (torch.stack([torch.stack([
                    sum(W[r, ci * R + r2] * cands[ci][kv][t, r2] for ci in range(len(cands))
                        for r2 in range(R)) for r in range(R)]) for t in range(len(row))])
                    for kv in (0, 1))
            q, K, V = ref_positioned(blk.self_attn, c, q, k, v, c.k_norm_after_rope)
            x = x + ref_attention(blk.self_attn, c, q, K, V)
            x = x + ref_mlp(blk, c, x)
        rows.append(rms(x, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T)
    return torch.stack(rows)


MODEL_REFERENCES["lime"] = lime_reference  # the contract's


@pytest.mark.parametrize("overrides", [dict(n_kv_head=4), dict(n_kv_head=2), dict(n_kv_head=1),
                                       dict(qk_norm=False, tie_embeddings=True),
                                       dict(n_layer=2, n_loops=3, k_norm_after_rope=True),
                                       dict(depth_stride=3, depth_recent_window=1, n_layer=5)], ids=str)
def test_matches_naive_reference_logits_and_gradients(overrides):
    assert_matches_reference(tiny_model(dtype=torch.float64, **{**LIME, **overrides}),
                             lime_reference)


def test_a_plain_gpt_refuses_the_lime_row():
    """LIMe's weights are its router, which model.GPT's layers do not have: build_model builds
    LIMe."""
    from model import GPT
    config = make_config(**{**vars(tiny_config()), **LIME})
    assert type(build_model(config)) is LIMe
    with pytest.raises(ValueError, match="build it with support.variants.build_model"):
        GPT(config)(torch.zeros(1, 3, dtype=torch.long))


def test_source_rule_and_cost_row():
    assert ModelConfig(n_layer=6, depth_mode="lime").sources(5) == [0, 1, 2, 3, 4]
    assert ModelConfig(n_layer=6, depth_mode="lime", depth_stride=3).sources(5) == [0, 3]
    paper_3b = dict(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32,
                    n_kv_head=8, head_dim=64)
    lime = depth_cost(ModelConfig(**paper_3b, **LIME))
    R, C = 8, 48 * 49 // 2 - 1  # every output head mixes all 8 heads of each earlier layer, K and V
    assert lime == {"candidates": C, "flops_per_token": 4 * R * 512 * C,
                    "io_bytes_per_token": 2 * (2 * C + 2 * 48) * 512, "extra_persistent_bytes": 0,
                    "extra_params": R * R * C}
    assert lime["extra_params"] == 75_200 and f"{lime['flops_per_token']:.2e}" == "1.93e+07"


def routers(model) -> dict:
    return {name: p for name, p in model.named_parameters() if ".lime_router." in name}


@pytest.mark.parametrize("n_layer, n_kv_head, n_loops", [(4, 2, 1), (5, 1, 1), (3, 4, 1), (2, 2,
                                                                                           3)])
def test_router_shapes_and_parameter_count(n_layer, n_kv_head, n_loops):
    """Effective layer e >= 1 owns (R, (e + 1) R) in block e % n_layer; R^2 (L (L + 1) / 2 - 1) in
    all."""
    model = tiny_model(**LIME, n_layer=n_layer, n_kv_head=n_kv_head, n_head=4, n_loops=n_loops)
    R, L = n_kv_head, n_layer * n_loops
    expected = {f"layers.{e % n_layer}.self_attn.lime_router.{e}": (R, (e + 1) * R)
                for e in range(1, L)}
    assert {name: tuple(p.shape) for name, p in routers(model).items()} == expected
    extra = sum(p.numel() for p in routers(model).values())
    assert extra == R * R * (L * (L + 1) // 2 - 1) == depth_cost(model.config)["extra_params"]
    assert model.num_params() - extra == tiny_model(depth_mode="vanilla", n_layer=n_layer,
                                                    n_kv_head=n_kv_head, n_head=4,
                                                    n_loops=n_loops).num_params()


def test_paper_shapes_parameter_count():
    """The 3B shape (48 layers, 8 KV heads): 75,200 router parameters, built on the meta device;
    with the 3B config's Depth-Attention sources (stride 24) the router spans those alone."""
    shape = dict(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32, n_kv_head=8,
                 head_dim=64)
    with torch.device("meta"):
        model = build_model(ModelConfig(**shape, **LIME))
    assert sum(p.numel() for p in model.lime_routers()) == 75_200
    assert depth_cost(ModelConfig(**shape, depth_mode="lime",
                                  depth_stride=24))["extra_params"] == 64 * 117


def test_router_init_and_identity_reduction():
    """A seed gives lime vanilla's weights and then the routers: LIMe's init, uniform in +-sqrt(3 /
    fan_in) with the layer's own block the identity. So lime is not vanilla at init; with the other
    blocks zero it is exactly."""
    shape = dict(n_layer=6, n_kv_head=4, depth_stride=None)
    built = {}
    for mode in ("lime", "vanilla"):
        torch.manual_seed(0)
        built[mode] = build_model(tiny_config(**shape, depth_mode=mode)).state_dict()
    assert all(torch.equal(p, built["lime"][name]) for name, p in built["vanilla"].items())
    lime, vanilla = tiny_model(**shape, depth_mode="lime"), tiny_model(**shape,
                                                                       depth_mode="vanilla")
    vanilla.load_state_dict({name: p for name, p in lime.state_dict().items()
                             if ".lime_router." not in name})
    R, spread = 4, []
    for w in lime.lime_routers():
        bound = math.sqrt(3 / w.shape[1])
        assert torch.equal(w[:, -R:], torch.eye(R)), "the layer's own block starts as the identity"
        rest = w[:, :-R]
        assert rest.abs().max() <= bound and rest.abs().max() > bound / 2
        spread.append(rest.flatten() / bound)
    spread = torch.cat(spread)  # uniform in [-1, 1]: mean 0, variance 1/3
    assert abs(spread.mean()) < 0.1 and abs(spread.var() - 1 / 3) < 0.05, (spread.mean(),
                                                                           spread.var())
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        base = vanilla(idx)[0]
        assert (lime(idx)[0] - base).abs().max() > 1e-2, "random routers change the output"
        for w in lime.lime_routers():
            w[:, :-R] = 0
        diff = (lime(idx)[0] - base).abs().max().item()
    assert diff < 1e-5, f"identity routers differ from vanilla by {diff:.3e}"


def test_router_group_has_the_multiplied_lr_and_no_weight_decay():
    model = tiny_model(**LIME)
    cfg = {**run_config.DEFAULTS, "learning_rate": 1e-3, "weight_decay": 0.1}
    opt = train_script.make_optimizer(model, cfg, "cpu")
    decay, no_decay, router = opt.param_groups
    assert {id(p) for p in router["params"]} == {id(p) for p in model.lime_routers()}
    assert all(p.dim() == 2
               for p in router["params"]), "2-D: the decay group's rule would have taken them"
    assert not {id(p) for p in router["params"]} & {id(p)
                                                    for p in decay["params"] + no_decay["params"]}
    assert router["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert router["lime_routers"] and cfg["lime_router_lr_mult"] == 10.0
    before = {id(p): p.detach().clone() for p in model.parameters()}
    model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))[1].backward()
    train_script.set_lr(opt, 2e-3, cfg)  # what train.py's loop does before every step
    opt.step()
    # Adam's first step moves every weight with a gradient by lr (times the sign of its gradient)
    step = {g: max((p - before[id(p)]).abs().max().item() for p in opt.param_groups[g]["params"]) for g in (1, 2)}
    assert router["lr"] == pytest.approx(2e-2) and step[2] == pytest.approx(2e-2, rel=1e-3)
    assert step[1] == pytest.approx(2e-3, rel=1e-3)
    # other modes: as before
    assert len(train_script.make_optimizer(tiny_model(), cfg, "cpu").param_groups) == 2


def test_training_memory_grows_linearly_with_depth():
    """Saved for backward beyond vanilla's: the mixed K and V of each mixing layer, (L - 1) * 2 * T
    * d_kv floats, not a stacked buffer of every earlier layer per layer (quadratic in depth, as in
    LIMe's code)."""
    T, d_kv = 16, 2 * 8
    for n_layer in (3, 6):
        saved = {}
        for mode in ("vanilla", "lime"):
            config = make_config(vocab_size=50, block_size=T, n_layer=n_layer, n_head=4,
                                 n_kv_head=2, head_dim=8, n_embd=24, mlp_hidden=40, depth_mode=mode,
                                 depth_stride=None)
            traced = memory.trace(config, 1, T)
            saved[mode] = traced.total(traced.saved())
        assert saved["lime"] - saved["vanilla"] == (n_layer - 1) * 2 * T * d_kv * 4, (n_layer,
                                                                                      saved)


def test_looped_lime_round_trips_through_hugging_face(tmp_path):
    model = tiny_model(**LIME, n_layer=2, n_loops=2).eval()
    hf.save_pretrained(model, tmp_path, None)
    back = hf.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(idx)[0], model(idx)[0])
    with capture(model) as alphas:  # a static router has no per-token weights to collect
        model(idx)
    assert alphas == {}


def test_train_lowers_the_loss_and_sample_reads_the_run(data_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "lime"
    args = [*TINY_SHORT, "--n_layer=3", f"--data_root={data_root}", "--depth_mode=lime",
            "--max_iters=20", "--eval_interval=10"]
    assert train(monkeypatch, *args, f"--out_dir={out}") is None
    losses = eval_losses(out)
    assert losses[20] < losses[0] - 1.0, losses
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert len(ckpt["optimizer"]["param_groups"]) == 3 and "layers.2.self_attn.lime_router.2" in ckpt["model"]
    capsys.readouterr()
    sample.main([f"--out_dir={out}", "--prompt=the", "--max_new_tokens=8", "--device=cpu"])
    printed = capsys.readouterr()
    assert "depth_mode=lime" in printed.err and "--- sample 1/1: 3 prompt + 8 new tokens" in printed.out
    # A resumed run keeps the router's group and its multiplied lr: the same losses as the run in
    # one go
    assert resumed_losses(monkeypatch, args, tmp_path / "resumed", stop=10) == losses
