"""What baselines.py's models claim beyond the contract every variant passes (test_model.py): the
naive reference at the shapes a family's own rule needs; DenseFormer = vanilla at init and a seed
giving each backbone vanilla's weights; the extra parameters at the paper's 3B shape; the authors'
names and config keys; the configs refused by name; LIMe's router (shapes, init, what it reduces
to, its optimizer group, its cost row, its training memory); Keyless Attention's V-only cache, K = V
sharing at init, the routing folding into W_Q, its parameter trade; and each family through
train.py, a resume and sample.py."""
import math
from dataclasses import asdict

import pytest
import torch

import checkpoint
import sample
import train as train_py
from baselines import LIMe, Keyless, ValueCache, build_model, make_config
from bench_cache import depth_cost
from conftest import tiny_config, tiny_model, tiny_variant
from configurator import CheckpointError
from helpers import TINY_SHORT, eval_losses, resumed_losses, train, write_authors_folder
from lab import hf, memory
from model import GPT, ConfigError, KVCache, ModelConfig
from reference import MODEL_REFERENCES, assert_matches_reference

LIME = dict(depth_mode="lime", depth_stride=None)  # LIMe as published: every earlier layer
PAPER_3B = dict(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32, n_kv_head=8,
                head_dim=64)

# ----------------------------------------------------------------------------- naive reference at
# the shapes the contract's one per variant leaves out: (MODEL_REFERENCES key, config keys)

EXTRA_SHAPES = {
    # skipped blocks (period 2), picks starting at s = d % 3 = 2, 1 and 0
    "denseformer-period-dilation": ("denseformer", dict(
        residual="denseformer", depth_mode="vanilla", n_layer=6, denseformer_dwa_dilation=3,
        denseformer_dwa_period=2)),
    # 8 sublayers < 12: the embedding stays the only snapshot
    "attnres-no-snapshot": ("attnres", dict(residual="attnres", depth_mode="vanilla")),
    # a snapshot once n reaches 4 >= 3, MQA, no qk-norm, tied embeddings
    "attnres-overshoot-mqa": ("attnres", dict(
        residual="attnres", depth_mode="vanilla", attnres_block_size=3, n_kv_head=1,
        qk_norm=False, tie_embeddings=True)),
    "mhc-2-streams-mha": ("mhc", dict(residual="mhc", depth_mode="vanilla", mhc_num_streams=2,
                                      mhc_sinkhorn_iters=3, n_kv_head=4)),
    "lime-mha-untied": ("lime", dict(**LIME, n_kv_head=4, qk_norm=False, tie_embeddings=True)),
    "lime-mqa-looped": ("lime", dict(**LIME, n_kv_head=1, n_layer=2, n_loops=3,
                                     k_norm_after_rope=True)),
    "lime-window": ("lime", dict(depth_mode="lime", depth_stride=3, depth_recent_window=1,
                                 n_layer=5)),
    "keyless-uniform-mha": ("keyless", dict(attention="keyless", depth_mode="uniform",
                                            n_kv_head=4, qk_norm=False, tie_embeddings=True)),
    "keyless-mqa-looped": ("keyless", dict(attention="keyless", depth_mode="value", n_kv_head=1,
                                           n_layer=2, n_loops=2, depth_stride=None,
                                           k_norm_after_rope=True)),
    "keyless-window": ("keyless", dict(attention="keyless", depth_mode="value", depth_stride=3,
                                       depth_recent_window=1, n_layer=5)),
}


@pytest.mark.parametrize("case", EXTRA_SHAPES)
def test_matches_the_naive_reference_at_the_familys_own_shapes(case):
    name, keys = EXTRA_SHAPES[case]
    assert_matches_reference(tiny_variant(dtype=torch.float64, **keys), MODEL_REFERENCES[name])


# ----------------------------------------------------------------------------- init and parameters

def test_denseformer_equals_vanilla_exactly_at_init():
    """DWA's weights start as zeros and a final 1: y = b_d, full forward and cached alike."""
    idx = torch.randint(0, 50, (2, 9))
    outs = []
    for residual in ("add", "denseformer"):
        torch.manual_seed(0)
        model = build_model(asdict(tiny_config(depth_mode="vanilla", residual=residual)))
        cache = model.new_cache(2, 9)
        with torch.no_grad():
            outs.append((model(idx)[0], model(idx[:, :5], cache=cache)[0],
                         model(idx[:, 5:], cache=cache)[0]))
    for a, b in zip(*outs):
        assert torch.equal(a, b), f"DenseFormer at init differs by {(a - b).abs().max():.3e}"


@pytest.mark.parametrize("keys", [dict(residual="denseformer", depth_mode="vanilla"),
                                  dict(residual="attnres", depth_mode="vanilla"),
                                  dict(residual="mhc", depth_mode="vanilla"), LIME],
                         ids=["denseformer", "attnres", "mhc", "lime"])
def test_a_seed_gives_the_backbone_vanillas_weights(keys):
    """Paired runs (one seed, two models) share their backbone: its weights are drawn first, the
    family's own after them."""
    torch.manual_seed(3)
    vanilla = GPT(tiny_config(depth_mode="vanilla")).state_dict()
    torch.manual_seed(3)
    model = build_model(asdict(tiny_config(**keys))).state_dict()
    assert all(torch.equal(v, model[k]) for k, v in vanilla.items())
    assert len(model) > len(vanilla)


@pytest.mark.parametrize("keys, extra", [
    (dict(residual="denseformer"), 1_224), (dict(residual="attnres"), 397_409),
    (dict(residual="mhc"), 19_663_396), (dict(**LIME, residual="add"), 75_200)],
    ids=["denseformer", "attnres", "mhc", "lime"])
def test_extra_parameters_at_the_paper_3b_shape(keys, extra):
    with torch.device("meta"):  # shapes only: nothing of the 3B model is allocated
        vanilla = GPT(ModelConfig(**PAPER_3B, depth_mode="vanilla"))
        model = build_model({"depth_mode": "vanilla", **PAPER_3B, **keys})
    assert model.num_params() - vanilla.num_params() == extra
    assert {n for n, _ in vanilla.named_parameters()} < {n for n, _ in model.named_parameters()}


def authors_names(residual, L, D, n):
    """The names and shapes of the authors' baseline tensors (their modeling code), written out
    independently of ours."""
    names = {}
    if residual == "denseformer":
        names.update({f"model.densetransformer_dwa.alphas.{i}": (i + 2,) for i in range(L)})
    elif residual == "attnres":
        for prefix in [f"model.layers.{i}.attnres_{s}_aggregator" for i in range(L)
                       for s in ("attn", "mlp")] + ["model.attnres_final_aggregator"]:
            names.update({f"{prefix}.pseudo_query": (D,), f"{prefix}.norm.weight": (D,),
                          f"{prefix}.recency_bias": ()})
    else:
        for p in [f"model.layers.{i}.{s}_residual_connector" for i in range(L)
                  for s in ("attn", "mlp")]:
            names.update({f"{p}.pre_logits": (n,), f"{p}.post_logits": (n,),
                          f"{p}.residual_logits": (n, n), f"{p}.alpha_pre": (),
                          f"{p}.alpha_post": (), f"{p}.alpha_res": (),
                          f"{p}.mhc_input_norm.weight": (n * D,),
                          f"{p}.mhc_dynamic_projection.weight": (n * n + 2 * n, n * D)})
        names["model.residual_stream_projector.reduce_logits"] = (n,)
    return names


@pytest.mark.parametrize("spelling, residual, knob", [
    ("densetransformer", "denseformer", {}),
    ("Block_AttnRes", "attnres", {"attnres_block_size": 4}),
    ("MHC", "mhc", {"mhc_num_streams": 2})],
    ids=["denseformer", "attnres", "mhc"])
def test_an_authors_release_loads_by_their_names_and_config_keys(tmp_path, spelling, residual,
                                                                 knob):
    """A synthetic release: the authors' baseline_mode spelling and knobs in config.json, their
    tensor names; from_pretrained builds the baseline and every tensor lands, none left over."""
    backbone = tiny_model(depth_mode="vanilla")
    c = backbone.config
    theirs = {k: torch.randn(s) for k, s in authors_names(residual, c.n_layer, c.n_embd,
                                                           knob.get("mhc_num_streams", 4)).items()}
    write_authors_folder(tmp_path, backbone, depth=False, extra=theirs, baseline_mode=spelling,
                         **knob)
    model = hf.from_pretrained(tmp_path)
    assert model.config.residual == residual and model.config.depth_mode == "vanilla"
    assert all(getattr(model.config, k) == v for k, v in knob.items())
    state = model.state_dict()
    for k, v in theirs.items():
        assert torch.equal(state[k.removeprefix("model.")], v), k


def test_an_unknown_baseline_mode_is_refused_by_name():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "max_position_embeddings": 32,
           "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 16,
           "intermediate_size": 32, "baseline_mode": "densenet"}
    with pytest.raises(CheckpointError, match="'densenet' is not one of the paper's baselines"):
        hf.config_from_hf(cfg)


@pytest.mark.parametrize("keys, fragment", [
    (dict(residual="mhc", depth_mode="value"), "use --depth_mode=vanilla --n_loops=1"),
    (dict(residual="denseformer", depth_mode="vanilla", n_loops=2), "--n_loops=1 with it"),
    (dict(residual="hc"), "unknown residual 'hc'; choose one of add, denseformer, attnres, mhc"),
    (dict(mhc_num_streams=1), "mhc_num_streams must be at least 2"),
    (dict(attnres_block_size=0), "attnres_block_size must be a positive integer"),
    (dict(attention="keyless", depth_mode="key"), "keyless has no keys to mix"),
    (dict(attention="keyless", depth_mode="vanilla", residual="mhc"), "with --residual=add"),
    (dict(attention="keyles"), "unknown attention 'keyles'; choose one of standard, keyless"),
    (dict(residul="mhc"), r"unknown model keys \['residul'\]"),
], ids=str)
def test_bad_configs_are_refused_by_name(keys, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make_config(**keys)


# ----------------------------------------------------------------------------- LIMe

def test_every_builder_builds_lime_and_a_plain_gpt_refuses_it():
    """LIMe's weights are its routers, which model.GPT's layers lack: both builders (a config's,
    baselines.build_model, and a checkpoint's, checkpoint.build_model) build LIMe."""
    keys = asdict(tiny_config(**LIME))
    assert type(build_model(keys)) is LIMe
    assert type(checkpoint.build_model(keys)) is LIMe
    with pytest.raises(ValueError, match="build it with baselines.build_model"):
        GPT(make_config(**keys))(torch.zeros(1, 3, dtype=torch.long))


def test_lime_sources_and_cost_row():
    assert ModelConfig(n_layer=6, **LIME).sources(5) == [0, 1, 2, 3, 4]
    assert ModelConfig(n_layer=6, depth_mode="lime", depth_stride=3).sources(5) == [0, 3]
    lime = depth_cost(ModelConfig(**PAPER_3B, **LIME))
    R, C = 8, 48 * 49 // 2 - 1  # every output head mixes all 8 heads of each earlier layer, K and V
    assert lime == {"candidates": C, "flops_per_token": 4 * R * 512 * C,
                    "io_bytes_per_token": 2 * (2 * C + 2 * 48) * 512, "extra_persistent_bytes": 0,
                    "extra_params": R * R * C}
    assert lime["extra_params"] == 75_200 and f"{lime['flops_per_token']:.2e}" == "1.93e+07"
    # with the 3B config's Depth-Attention sources (stride 24) the router spans those alone
    assert depth_cost(ModelConfig(**PAPER_3B, depth_mode="lime",
                                  depth_stride=24))["extra_params"] == 64 * 117


@pytest.mark.parametrize("n_layer, n_kv_head, n_loops", [(5, 1, 1), (2, 2, 3)])
def test_router_shapes_and_parameter_count(n_layer, n_kv_head, n_loops):
    """Effective layer e >= 1 owns (R, (e + 1) R) in block e % n_layer; R^2 (L (L + 1) / 2 - 1) in
    all, depth_cost's count."""
    model = tiny_model(**LIME, n_layer=n_layer, n_kv_head=n_kv_head, n_loops=n_loops)
    R, L = n_kv_head, n_layer * n_loops
    routers = {n: tuple(p.shape) for n, p in model.named_parameters() if ".lime_router." in n}
    assert routers == {f"layers.{e % n_layer}.self_attn.lime_router.{e}": (R, (e + 1) * R)
                       for e in range(1, L)}
    extra = sum(p.numel() for p in model.lime_routers())
    assert extra == R * R * (L * (L + 1) // 2 - 1) == depth_cost(model.config)["extra_params"]


def test_router_init_and_identity_reduction():
    """LIMe's init: uniform in +-sqrt(3 / fan_in) with the layer's own block the identity. So LIMe
    is not vanilla at init; with the other blocks zero it is."""
    shape = dict(n_layer=6, n_kv_head=4, depth_stride=None)
    lime, vanilla = tiny_model(**shape, depth_mode="lime"), tiny_model(**shape,
                                                                       depth_mode="vanilla")
    vanilla.load_state_dict({n: p for n, p in lime.state_dict().items()
                             if ".lime_router." not in n})
    R, spread = 4, []
    for w in lime.lime_routers():
        bound = math.sqrt(3 / w.shape[1])
        assert torch.equal(w[:, -R:], torch.eye(R)), "the layer's own block starts as the identity"
        rest = w[:, :-R]
        assert bound / 2 < rest.abs().max() <= bound
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


def test_routers_have_their_own_group_without_decay_at_the_multiplied_lr():
    """The multiplied rate in a run: test_trains_resumes_and_samples_end_to_end's checkpoint."""
    model = tiny_model(**LIME)
    cfg = {k: key.default for k, key in train_py.KEYS.items()}
    opt = train_py.make_optimizer(model, cfg, "cpu")
    decay, no_decay, router = opt.param_groups
    ids = {id(p) for p in router["params"]}
    assert ids == {id(p) for p in model.lime_routers()}
    assert not ids & {id(p) for p in decay["params"] + no_decay["params"]}
    assert all(p.dim() == 2 for p in router["params"]), "the decay group's rule would take them"
    assert router["weight_decay"] == 0.0 and decay["weight_decay"] == cfg["weight_decay"] > 0
    assert opt.lr_mults == [1, 1, "lime_router_lr_mult"] and cfg["lime_router_lr_mult"] == 10.0


def test_lime_training_memory_grows_linearly_with_depth():
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


# ----------------------------------------------------------------------------- Keyless Attention

def test_keyless_cache_holds_values_only_half_of_vanillas_bytes():
    vanilla = tiny_model(depth_mode="vanilla")
    model = tiny_variant(attention="keyless", depth_mode="value")
    idx = torch.randint(0, 50, (2, 10))
    caches = [m.new_cache(2, 10) for m in (vanilla, model)]
    with torch.no_grad():
        for m, cache in zip((vanilla, model), caches):
            m(idx, cache=cache)
    assert type(caches[0]) is KVCache and type(caches[1]) is ValueCache and caches[1].k is None
    assert caches[1].nbytes * 2 == caches[0].nbytes
    assert caches[1].v.shape == caches[0].v.shape
    assert vars(caches[1]).keys() == {"k", "v", "pos"}


def test_keyless_depth_step_writes_the_mixed_value_in_place():
    """keyless + value: a layer with sources stores its mixed value, not its raw projection."""
    model = tiny_variant(attention="keyless", depth_mode="value", depth_stride=1)
    idx = torch.randint(0, 50, (1, 6))
    raw = {}
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, out, e=e: raw.__setitem__(e, out)) for e, layer in enumerate(model.layers)]
    cache = model.new_cache(1, 6)
    with torch.no_grad():
        model(idx, cache=cache)
    for h in hooks:
        h.remove()
    for e, out in raw.items():
        slot = cache.v[e, 0].transpose(0, 1).flatten(1)                        # (T, n_kv * D)
        assert torch.allclose(slot, out[0], atol=1e-6) == (e == 0), e


def test_keyless_starts_as_key_value_sharing():
    """R = I at init: the model is a vanilla GPT whose key projection is its value projection."""
    model = tiny_model(attention="keyless", depth_mode="vanilla").eval()
    vanilla = tiny_model(depth_mode="vanilla").eval()
    state = {k: v for k, v in model.state_dict().items() if ".routing" not in k}
    for i in range(len(model.layers)):
        state[f"layers.{i}.self_attn.k_proj.weight"] = state[f"layers.{i}.self_attn.v_proj.weight"]
    vanilla.load_state_dict(state)
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.allclose(model(idx)[0], vanilla(idx)[0], atol=1e-5)


def test_keyless_routing_folds_into_the_query_projection():
    """q_norm comes after R, so W_Q R is one matrix (the paper's inference-time fold): W_Q R_h in
    q_proj and R = I give the same logits."""
    model = tiny_variant(dtype=torch.float64, attention="keyless", depth_mode="value")
    c = model.config
    folded = tiny_model(dtype=torch.float64, attention="keyless", depth_mode="value")
    folded.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in folded.layers:
            at = layer.self_attn
            W = at.q_proj.weight.view(c.n_head, c.head_dim, c.n_embd)         # (H, D_out, n_embd)
            at.q_proj.weight.copy_(torch.einsum("hdn,hde->hen", W, at.routing).flatten(0, 1))
            at.routing.copy_(torch.eye(c.head_dim).expand_as(at.routing))
        idx = torch.randint(0, 50, (2, 9))
        assert (model(idx)[0] - folded(idx)[0]).abs().max() < 1e-10


def test_keyless_trades_the_key_projection_for_the_routing_matrices():
    vanilla, model = tiny_model(depth_mode="vanilla"), tiny_model(attention="keyless")
    c = model.config
    k_proj = c.n_layer * c.n_embd * c.n_kv_head * c.head_dim
    routing = c.n_layer * c.n_head * c.head_dim ** 2
    assert model.num_params() == vanilla.num_params() - k_proj + routing
    assert not any("k_proj" in name for name, _ in model.named_parameters())
    assert type(model) is Keyless


# ----------------------------------------------------------------------------- the scripts

# family -> (its train.py flags, what sample.py reports of the model, each group's lr / the first's)
FAMILIES = {
    "mhc": (["--residual=mhc", "--depth_mode=vanilla"],
            "depth_mode=vanilla, residual=mhc, attention=standard", [1, 1]),
    "lime": (["--depth_mode=lime"], "depth_mode=lime, residual=add, attention=standard",
             [1, 1, 10]),
    "keyless": (["--attention=keyless"], "depth_mode=value, residual=add, attention=keyless",
                [1, 1]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_resumes_and_samples_end_to_end(family, data_root, tmp_path, monkeypatch, capsys):
    """As a user runs it: the loss falls, a resume reproduces the run in one go (LIMe's router
    group keeps its rate), sample.py reads the run back as the family's model."""
    flags, described, lr_ratios = FAMILIES[family]
    args = [*TINY_SHORT, f"--data_root={data_root}", *flags, "--max_iters=8", "--eval_interval=4"]
    out = tmp_path / "run"
    assert train(monkeypatch, *args, f"--out_dir={out}") is None
    losses = eval_losses(out)
    assert losses[8] < losses[0] - 0.5, losses
    groups = torch.load(out / "ckpt.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["lr"] / groups[0]["lr"] for g in groups] == pytest.approx(lr_ratios)
    assert resumed_losses(monkeypatch, args, tmp_path / "resumed", stop=4) == losses
    capsys.readouterr()
    sample.main([f"--init_from={out}", "--prompt=the", "--max_new_tokens=6", "--device=cpu"])
    printed = capsys.readouterr()
    assert described in printed.err and "3 prompt + 6 new tokens" in printed.out


def test_train_py_names_the_fix_for_a_baseline_on_depth_attention(data_root, tmp_path,
                                                                     monkeypatch):
    """train.py's default depth_mode is value: a baseline without --depth_mode=vanilla is one
    error line naming it, nothing trained."""
    err = train(monkeypatch, *TINY_SHORT, f"--data_root={data_root}", "--residual=mhc",
                "--max_iters=2", f"--out_dir={tmp_path / 'run'}")
    assert err and err.startswith("error:") and "--depth_mode=vanilla" in err, err
    assert not (tmp_path / "run" / "ckpt.pt").exists()
