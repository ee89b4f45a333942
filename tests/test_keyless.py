"""Keyless Attention (attention="keyless", baselines.Keyless), alone and with a depth step: a naive
reference written from its equation, and beyond the contract every variant passes
(tests/test_contract.py): a V-only cache of half vanilla's bytes, what it reduces to (K = V sharing
at init), the routing matrix folding into W_Q, its parameter count, the refusals, and train.py."""
import pytest
import torch

from baselines import Keyless, ValueCache
from support.variants import make_config
from conftest import tiny_model
import export
from helpers import TINY_SHORT, eval_losses, resumed_losses, train
from model import ConfigError, KVCache
import sample
from support import hf
from support.checkpoint import load_model
from reference import (MODEL_REFERENCES, REFERENCE_MODES, assert_matches_reference, ref_attention,
                       ref_mlp, reference_sources, rms, rope)

KEYLESS_MODES = ["vanilla", "value", "uniform"]


def keyless_reference(model, idx):
    """Logits with loops over rows, layers, positions and heads. Query head h at position t:
    q'_t = RoPE_t(q_norm(q_t R_h)), scored against the routing view of each value of its KV group,
    RoPE_s(k_norm(v_s)), reading the raw v_s: s_ts = q'_t . view_s / sqrt(D). With a depth mode,
    qbar' (the group's mean q') weighs the routing views of the sources' stored values and of its
    own value at position t (each view made by the layer that stored the value); the mix replaces
    the value, and the view attention scores against is the mixed value's."""
    c = model.config
    spec, g, D, theta = (REFERENCE_MODES[c.depth_mode], c.n_head // c.n_kv_head, c.head_dim,
                         c.rope_theta)

    def norm(x, module):
        return rms(x, module.weight, c.norm_eps) if c.qk_norm else x

    def view(at, u, t):  # the routing view of value u at position t, by layer `at`'s k_norm
        if c.k_norm_after_rope:
            return norm(rope(u, t, theta), at.k_norm)
        return rope(norm(u, at.k_norm), t, theta)

    rows = []
    for row in idx:
        x, T = model.embed_tokens.weight[row], len(row)
        stored = {}  # effective layer -> (views, values): lists over positions, then KV heads
        for e in range(c.n_eff_layer):
            blk = model.layers[e % c.n_layer]
            at = blk.self_attn
            h = rms(x, blk.input_layernorm.weight, c.norm_eps)
            q = (h @ at.q_proj.weight.T).view(T, c.n_head, D)
            v = (h @ at.v_proj.weight.T).view(T, c.n_kv_head, D)
            qs = [[rope(norm(q[t, i] @ at.routing[i], at.q_norm), t, theta)
                   for i in range(c.n_head)] for t in range(T)]
            V = [[v[t, j] for j in range(c.n_kv_head)] for t in range(T)]
            src = reference_sources(c, e) if spec else []
            for t in range(T):
                for j in range(c.n_kv_head):
                    if src:
                        qbar = sum(qs[t][j * g + i] for i in range(g)) / g
                        cand_k = [stored[s][0][t][j] for s in src] + [view(at, v[t, j], t)]
                        cand_v = [stored[s][1][t][j] for s in src] + [v[t, j]]
                        V[t][j] = sum(a * u for a, u in zip(spec[0](qbar, cand_k), cand_v))
            K = [[view(at, V[t][j], t) for j in range(c.n_kv_head)] for t in range(T)]
            stored[e] = (K, V)
            x = x + ref_attention(at, c, qs, K, V)
            x = x + ref_mlp(blk, c, x)
        rows.append(rms(x, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T)
    return torch.stack(rows)


MODEL_REFERENCES["keyless"] = MODEL_REFERENCES["keyless+value"] = keyless_reference  # the contract


def keyless(seed=0, dtype=torch.float64, **overrides):
    """A tiny keyless model with its routing matrices off the identity."""
    model = tiny_model(seed, dtype, attention="keyless", **overrides)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.routing.add_(0.3 * torch.randn_like(layer.self_attn.routing))
    return model


CASES = ([dict(depth_mode=m, n_kv_head=kv) for m in KEYLESS_MODES for kv in (4, 2, 1)]
         + [dict(depth_mode=m, n_layer=2, n_loops=2, depth_stride=None) for m in KEYLESS_MODES]
         + [dict(depth_mode="value", depth_stride=3, depth_recent_window=1, n_layer=5),
            dict(depth_mode="value", qk_norm=False, tie_embeddings=True),
            dict(depth_mode="value", k_norm_after_rope=True)])


@pytest.mark.parametrize("overrides", CASES,
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_matches_naive_reference_logits_and_gradients(overrides):
    assert_matches_reference(keyless(**overrides), keyless_reference)


@pytest.mark.parametrize("mode", KEYLESS_MODES)
def test_cache_holds_values_only_half_of_vanillas_bytes(mode):
    """The same model shape: vanilla's cache holds K and V, a keyless one (with or without the
    depth step) V alone, in place, with nothing else persistent."""
    vanilla = tiny_model(depth_mode="vanilla")
    model = keyless(dtype=torch.float32, depth_mode=mode)
    idx = torch.randint(0, 50, (2, 10))
    caches = [m.new_cache(2, 10) for m in (vanilla, model)]
    with torch.no_grad():
        for m, cache in zip((vanilla, model), caches):
            m(idx, cache=cache)
    assert type(caches[0]) is KVCache and type(caches[1]) is ValueCache and caches[1].k is None
    assert caches[1].nbytes * 2 == caches[0].nbytes
    assert caches[1].v.shape == caches[0].v.shape
    assert vars(caches[1]).keys() == {"k", "v", "pos"}


def test_the_depth_step_writes_the_mixed_value_in_place():
    """keyless + value: each layer's V slot holds its mixed value, which later queries read and are
    scored against (a layer with sources stores something other than its raw projection)."""
    model = keyless(dtype=torch.float32, depth_mode="value", depth_stride=1)
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


def test_starts_as_key_value_sharing():
    """R = I at init: the model is a vanilla GPT whose key projection is its value projection."""
    model = tiny_model(attention="keyless", depth_mode="vanilla").eval()  # R as initialised
    vanilla = tiny_model(depth_mode="vanilla").eval()
    with torch.no_grad():
        state = {k: v for k, v in model.state_dict().items() if ".routing" not in k}
        for i in range(len(model.layers)):
            attn = f"layers.{i}.self_attn"
            state[f"{attn}.k_proj.weight"] = state[f"{attn}.v_proj.weight"]
        vanilla.load_state_dict(state)
        idx = torch.randint(0, 50, (2, 9))
        assert torch.allclose(model(idx)[0], vanilla(idx)[0], atol=1e-5)


def test_routing_folds_into_the_query_projection():
    """q_norm comes after R, so W_Q R is one matrix (the paper's inference-time fold): the model
    with W_Q R_h in q_proj and R = I gives the same logits."""
    model = keyless(depth_mode="value")
    c = model.config
    folded = keyless(depth_mode="value")
    folded.load_state_dict(model.state_dict())
    with torch.no_grad():
        for at in folded.layers:
            at = at.self_attn
            W = at.q_proj.weight.view(c.n_head, c.head_dim, c.n_embd)         # (H, D_out, n_embd)
            at.q_proj.weight.copy_(torch.einsum("hdn,hde->hen", W, at.routing).flatten(0, 1))
            at.routing.copy_(torch.eye(c.head_dim).expand_as(at.routing))
        idx = torch.randint(0, 50, (2, 9))
        assert (model(idx)[0] - folded(idx)[0]).abs().max() < 1e-10


def test_parameters_trade_the_key_projection_for_the_routing_matrices():
    vanilla, model = tiny_model(depth_mode="vanilla"), keyless(depth_mode="value")
    c = model.config
    k_proj = c.n_layer * c.n_embd * c.n_kv_head * c.head_dim
    routing = c.n_layer * c.n_head * c.head_dim ** 2
    assert model.num_params() == vanilla.num_params() - k_proj + routing
    assert not any("k_proj" in name for name, _ in model.named_parameters())
    assert type(model) is Keyless


@pytest.mark.parametrize("keys, fragment", [
    (dict(depth_mode="key"), "no keys for depth_mode=key"),
    (dict(depth_mode="kv"), "no keys for depth_mode=kv"),
    (dict(depth_mode="lime"), "no keys for depth_mode=lime"),
    (dict(depth_mode="vanilla", residual="mhc"), "--residual=add with --attention=keyless"),
    (dict(attention="keyles"), "unknown attention 'keyles'; choose one of standard, keyless"),
])
def test_configs_it_cannot_run_are_refused_by_name(keys, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make_config(**{"attention": "keyless", **keys})


def test_train_resume_sample_and_export_a_keyless_run(data_root, tmp_path, monkeypatch, capsys):
    """`python train.py --attention=keyless` (with the default depth_mode=value) trains, a resume
    reproduces the run in one go, sample.py reads it, export.py writes a folder our loader reads
    back; --init_from of a vanilla run cannot switch attention (its keys would be dropped)."""
    out = tmp_path / "keyless"
    args = [*TINY_SHORT, "--n_layer=3", f"--data_root={data_root}", "--attention=keyless",
            "--max_iters=20", "--eval_interval=10"]
    assert train(monkeypatch, *args, f"--out_dir={out}") is None
    losses = eval_losses(out)
    assert losses[20] < losses[0] - 1.0, losses
    assert resumed_losses(monkeypatch, args, tmp_path / "resumed", stop=10) == losses
    capsys.readouterr()
    sample.main([f"--init_from={out}", "--prompt=the", "--max_new_tokens=8", "--device=cpu"])
    assert "depth_mode=value, residual=add, attention=keyless" in capsys.readouterr().err
    export.main([str(out), str(tmp_path / "hf")])
    loaded = load_model(out).model
    assert type(hf.from_pretrained(tmp_path / "hf")) is type(loaded) is Keyless

    vanilla = [*TINY_SHORT, f"--data_root={data_root}", "--depth_mode=vanilla", "--max_iters=2"]
    assert train(monkeypatch, *vanilla, f"--out_dir={tmp_path / 'vanilla'}") is None
    err = train(monkeypatch, *vanilla, f"--init_from={tmp_path / 'vanilla'}", "--attention=keyless",
                f"--out_dir={tmp_path / 'switched'}")
    assert err and "attention" in err, err
