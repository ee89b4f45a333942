"""LIMe (depth_mode="lime", model.lime_mix) beyond the shared mode battery in test_model.py (naive reference,
cache parity, causality, cache bytes, cost row): its router's parameters and init, what it reduces to, its
optimizer group, its training memory, and a run of train.py and sample.py."""
import math

import pytest
import torch

import hf
import memory
import sample
import train as train_script
from baselines import make_config
from conftest import tiny_config, tiny_model
from model import GPT, ModelConfig, depth_cost
from test_hf import TINY, eval_losses, train

LIME = dict(depth_mode="lime", depth_stride=None)  # LIMe as published: every earlier layer


def routers(model) -> dict:
    return {name: p for name, p in model.named_parameters() if ".lime_router." in name}


@pytest.mark.parametrize("n_layer, n_kv_head, n_loops", [(4, 2, 1), (5, 1, 1), (3, 4, 1), (2, 2, 3)])
def test_router_shapes_and_parameter_count(n_layer, n_kv_head, n_loops):
    """Effective layer e >= 1 owns (R, (e + 1) R) in block e % n_layer; R^2 (L (L + 1) / 2 - 1) in all."""
    model = tiny_model(**LIME, n_layer=n_layer, n_kv_head=n_kv_head, n_head=4, n_loops=n_loops)
    R, L = n_kv_head, n_layer * n_loops
    expected = {f"layers.{e % n_layer}.self_attn.lime_router.{e}": (R, (e + 1) * R) for e in range(1, L)}
    assert {name: tuple(p.shape) for name, p in routers(model).items()} == expected
    extra = sum(p.numel() for p in routers(model).values())
    assert extra == R * R * (L * (L + 1) // 2 - 1) == depth_cost(model.config)["extra_params"]
    assert model.num_params() - extra == tiny_model(depth_mode="vanilla", n_layer=n_layer, n_kv_head=n_kv_head,
                                                    n_head=4, n_loops=n_loops).num_params()


def test_paper_shapes_parameter_count():
    """The 3B shape (48 layers, 8 KV heads): 75,200 router parameters, built on the meta device; with the
    3B config's Depth-Attention sources (stride 24) the router spans those alone."""
    shape = dict(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32, n_kv_head=8, head_dim=64)
    with torch.device("meta"):
        model = GPT(ModelConfig(**shape, depth_mode="lime", depth_stride=None))
    assert sum(p.numel() for p in model.lime_routers()) == 75_200
    assert depth_cost(ModelConfig(**shape, depth_mode="lime", depth_stride=24))["extra_params"] == 64 * 117


def test_router_init_and_identity_reduction():
    """A seed gives lime vanilla's weights and then the routers: LIMe's init, uniform in +-sqrt(3 / fan_in) with the
    layer's own block the identity. So lime is not vanilla at init; with the other blocks zero it is exactly."""
    shape = dict(n_layer=6, n_kv_head=4, depth_stride=None)
    built = {}
    for mode in ("lime", "vanilla"):
        torch.manual_seed(0)
        built[mode] = GPT(tiny_config(**shape, depth_mode=mode)).state_dict()
    assert all(torch.equal(p, built["lime"][name]) for name, p in built["vanilla"].items())
    lime, vanilla = tiny_model(**shape, depth_mode="lime"), tiny_model(**shape, depth_mode="vanilla")
    vanilla.load_state_dict({name: p for name, p in lime.state_dict().items() if ".lime_router." not in name})
    R, spread = 4, []
    for w in lime.lime_routers():
        bound = math.sqrt(3 / w.shape[1])
        assert torch.equal(w[:, -R:], torch.eye(R)), "the layer's own block starts as the identity"
        rest = w[:, :-R]
        assert rest.abs().max() <= bound and rest.abs().max() > bound / 2
        spread.append(rest.flatten() / bound)
    spread = torch.cat(spread)  # uniform in [-1, 1]: mean 0, variance 1/3
    assert abs(spread.mean()) < 0.1 and abs(spread.var() - 1 / 3) < 0.05, (spread.mean(), spread.var())
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
    cfg = {**train_script.DEFAULTS, "learning_rate": 1e-3, "weight_decay": 0.1}
    opt = train_script.make_optimizer(model, cfg, "cpu")
    decay, no_decay, router = opt.param_groups
    assert {id(p) for p in router["params"]} == {id(p) for p in model.lime_routers()}
    assert all(p.dim() == 2 for p in router["params"]), "2-D: the decay group's rule would have taken them"
    assert not {id(p) for p in router["params"]} & {id(p) for p in decay["params"] + no_decay["params"]}
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
    assert len(train_script.make_optimizer(tiny_model(), cfg, "cpu").param_groups) == 2  # other modes: as before


def test_training_memory_grows_linearly_with_depth():
    """Saved for backward beyond vanilla's: the mixed K and V of each mixing layer, (L - 1) * 2 * T * d_kv floats,
    not a stacked buffer of every earlier layer per layer (quadratic in depth, as in LIMe's code)."""
    T, d_kv = 16, 2 * 8
    for n_layer in (3, 6):
        saved = {}
        for mode in ("vanilla", "lime"):
            config = make_config(vocab_size=50, block_size=T, n_layer=n_layer, n_head=4, n_kv_head=2, head_dim=8,
                                 n_embd=24, mlp_hidden=40, depth_mode=mode, depth_stride=None)
            traced = memory.trace(config, 1, T)
            saved[mode] = traced.total(traced.saved())
        assert saved["lime"] - saved["vanilla"] == (n_layer - 1) * 2 * T * d_kv * 4, (n_layer, saved)


def test_looped_lime_round_trips_through_hugging_face(tmp_path):
    model = tiny_model(**LIME, n_layer=2, n_loops=2).eval()
    hf.save_pretrained(model, tmp_path, None)
    back = hf.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(idx)[0], model(idx)[0])
    with model.capture_depth_weights() as alphas:  # a static router has no per-token weights to collect
        model(idx)
    assert alphas == {}


def test_train_lowers_the_loss_and_sample_reads_the_run(data_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "lime"
    args = [*TINY, "--n_layer=3", f"--data_root={data_root}", "--depth_mode=lime", "--max_iters=20",
            "--eval_interval=10"]
    assert train(monkeypatch, *args, f"--out_dir={out}") is None
    losses = eval_losses(out)
    assert losses[20] < losses[0] - 1.0, losses
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert len(ckpt["optimizer"]["param_groups"]) == 3 and "layers.2.self_attn.lime_router.2" in ckpt["model"]
    capsys.readouterr()
    sample.main([f"--out_dir={out}", "--prompt=the", "--max_new_tokens=8", "--device=cpu"])
    printed = capsys.readouterr()
    assert "depth_mode=lime" in printed.err and "--- sample 1/1: 3 prompt + 8 new tokens" in printed.out
    # A resumed run keeps the router's group and its multiplied lr: the same losses as the run in one go
    assert train(monkeypatch, *args, f"--out_dir={tmp_path / 'resumed'}", "--stop_at_step=10") is None
    assert train(monkeypatch, f"--out_dir={tmp_path / 'resumed'}", "--resume=True") is None
    assert eval_losses(tmp_path / "resumed") == losses
