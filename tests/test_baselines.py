"""The paper's baselines (baselines.py) held to model.py's standard: a naive reference written from
the equations (loops over rows, positions and sources) on logits and gradients at several shapes,
DenseFormer = vanilla at init, the extra parameter counts at the 3B shape, the authors' names, and
train.py / sample.py end to end. Cached decoding, causality, the KV cache and the round trips are
tests/test_contract.py's, for every variant."""

import pytest
import torch
import torch.nn.functional as F

from support.variants import build_model, make_config
from conftest import tiny_config, tiny_model, tiny_variant
from model import GPT, ModelConfig
from support import hf
from support.errors import CheckpointError
from helpers import TINY_SHAPE, run
from reference import (MODEL_REFERENCES, ref_attention, ref_mlp, ref_positioned, ref_projections,
                       rms)

BASELINES = ["denseformer", "attnres", "mhc"]


def vanilla_names(config: ModelConfig) -> set:
    with torch.device("meta"):
        return {n for n, _ in GPT(make_config(**{**config.__dict__,
                                                 "residual": "add"})).named_parameters()}


def baseline_model(residual, seed=0, dtype=torch.float64, **overrides):
    """A tiny baseline with every parameter of its own moved off its init (zeros, ones, a 3.0 bias,
    a near-identity matrix), so that no term of the equations can hide behind a special value."""
    return tiny_variant(seed, dtype, residual=residual, depth_mode="vanilla", **overrides)


# ----------------------------------------------------------------------------- naive reference, one
# row at a time

def attend(blk, c, x):
    """The block's vanilla attention sublayer at its input x (T, n_embd): norm, project, RoPE,
    attend."""
    q, k, v = ref_positioned(blk.self_attn, c, *ref_projections(blk, c, x), c.k_norm_after_rope)
    return ref_attention(blk.self_attn, c, q, k, v)


def ref_denseformer(model, x):
    """y_d = sum_k alpha_{d-1}[k] * H[s + k * dilation] (s = d % dilation) if d % period == 0, else
    b_d."""
    c, dwa = model.config, model.densetransformer_dwa
    history, y = [x], x
    for i, blk in enumerate(model.layers):
        h = y + attend(blk, c, y)
        b = h + ref_mlp(blk, c, h)
        history.append(b)
        d = i + 1
        if d % c.denseformer_dwa_period:
            y = b
            continue
        alpha, s = dwa.alphas[i], d % c.denseformer_dwa_dilation
        y = torch.stack([sum(alpha[k] * history[s + k * c.denseformer_dwa_dilation][t]
                             for k in range(len(alpha))) for t in range(x.shape[0])])
    return y


def ref_attnres(model, x):
    c = model.config

    def aggregate(agg, snapshots, p):
        w = agg.pseudo_query * agg.norm.weight
        out = []
        for t in range(x.shape[0]):
            cands = [s[t] for s in snapshots] + [p[t]]
            logits = [(s @ w) / torch.sqrt((s * s).mean() + c.norm_eps) for s in cands]
            logits[-1] = logits[-1] + agg.recency_bias
            a = torch.softmax(torch.stack(logits), 0)
            out.append(sum(a[k] * s for k, s in enumerate(cands)))
        return torch.stack(out)

    snapshots, p, n = [x], x, 0
    for blk in model.layers:
        h = aggregate(blk.attnres_attn_aggregator, snapshots, p)
        p = p + attend(blk, c, h)
        h = aggregate(blk.attnres_mlp_aggregator, snapshots, p)
        p = p + ref_mlp(blk, c, h)
        n += 2
        if n >= c.attnres_block_size:
            snapshots.append(p)
            n = 0
    return aggregate(model.attnres_final_aggregator, snapshots, p)


def ref_mhc(model, x):
    c = model.config
    n, T, floor = c.mhc_num_streams, x.shape[0], 1e-12

    def connector(con, X, f):  # X: (T, n, D)
        reads, posts, mats = [], [], []
        for t in range(T):
            z = rms(X[t].reshape(-1), con.mhc_input_norm.weight, c.norm_eps)
            d = con.mhc_dynamic_projection.weight @ z                       # (n + n + n*n,)
            h_pre = torch.sigmoid(con.alpha_pre * d[:n] + con.pre_logits)
            posts.append(2 * torch.sigmoid(con.alpha_post * d[n:2 * n] + con.post_logits))
            L = con.alpha_res * d[2 * n:].view(n, n) + con.residual_logits
            M = torch.exp(L - L.max()).clamp_min(floor)
            for _ in range(c.mhc_sinkhorn_iters):
                M = M / M.sum(1, keepdim=True).clamp_min(floor)   # rows
                M = M / M.sum(0, keepdim=True).clamp_min(floor)   # columns
            mats.append(M)
            reads.append(sum(h_pre[j] * X[t, j] for j in range(n)))
        u = f(torch.stack(reads))
        return torch.stack([torch.stack([sum(mats[t][i, j] * X[t, j]
                                             for j in range(n)) + posts[t][i] * u[t]
                                         for i in range(n)]) for t in range(T)])

    X = torch.stack([x] * n, 1)
    for blk in model.layers:
        X = connector(blk.attn_residual_connector, X, lambda h: attend(blk, c, h))
        X = connector(blk.mlp_residual_connector, X, lambda h: ref_mlp(blk, c, h))
    r = torch.softmax(model.residual_stream_projector.reduce_logits, 0)
    return sum(r[j] * X[:, j] for j in range(n))


REFERENCES = {"denseformer": ref_denseformer, "attnres": ref_attnres, "mhc": ref_mhc}


def reference_forward(model, idx):
    c = model.config
    rows = [REFERENCES[c.residual](model, model.embed_tokens.weight[idx[b]])
            for b in range(idx.shape[0])]
    return torch.stack([rms(h, model.norm.weight, c.norm_eps) @ model.lm_head.weight.T
                        for h in rows])


MODEL_REFERENCES.update(dict.fromkeys(REFERENCES, reference_forward))  # the contract's


REFERENCE_CASES = [
    dict(residual="denseformer"), dict(residual="denseformer", denseformer_dwa_dilation=2, denseformer_dwa_period=2),
    dict(residual="denseformer", n_layer=5, denseformer_dwa_dilation=3),
    # 8 sublayers < 12: the embedding is the only snapshot
    dict(residual="attnres"),
    # a snapshot after every layer, MQA
    dict(residual="attnres", attnres_block_size=2, n_kv_head=1),
    # n reaches 4 >= 3
    dict(residual="attnres", attnres_block_size=3, qk_norm=False, tie_embeddings=True),
    dict(residual="mhc"), dict(residual="mhc", mhc_num_streams=2, mhc_sinkhorn_iters=3, n_kv_head=4),
]


@pytest.mark.parametrize("overrides", REFERENCE_CASES, ids=lambda o: "-".join(f"{k}={v}" for k,
                                                                              v in o.items()))
def test_matches_naive_reference_logits_and_gradients(overrides):
    model = baseline_model(**overrides)
    idx = torch.randint(0, model.config.vocab_size, (2, 6))
    targets = torch.randint(0, model.config.vocab_size, (2, 6))
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    ref = reference_forward(model, idx)
    F.cross_entropy(ref.view(-1, ref.size(-1)), targets.view(-1)).backward()
    diff = (logits - ref).abs().max().item()
    assert diff < 1e-10, f"logits differ from the reference by {diff:.3e}"
    backbone = vanilla_names(model.config)
    for n, g in grads.items():
        gdiff = (g - model.get_parameter(n).grad).abs().max().item()
        assert gdiff < 1e-10, f"grad of {n} differs from the reference by {gdiff:.3e}"
        assert n in backbone or g.abs().max() > 0, f"{n} gets no gradient"


@pytest.mark.parametrize("residual", BASELINES)
def test_baselines_change_the_output(residual):
    """The reference test would pass trivially if run_layers were vanilla's: check that it is
    not."""
    idx = torch.randint(0, 50, (2, 9))
    base, _ = tiny_model(depth_mode="vanilla")(idx)
    out, _ = baseline_model(residual, dtype=torch.float32)(idx)
    assert (out - base).abs().max() > 1e-2


# ----------------------------------------------------------------------------- decoding

def test_generate_with_the_cache_matches_the_full_forward():
    model = baseline_model("mhc", dtype=torch.float32).eval()
    prompt = torch.randint(0, 50, (2, 4))
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(model.generate(prompt, 8, temperature=0), seq)


# ----------------------------------------------------------------------------- init and parameters

def test_denseformer_equals_vanilla_exactly_at_init():
    idx = torch.randint(0, 50, (2, 9))
    outs = []
    for residual in ("add", "denseformer"):
        torch.manual_seed(0)
        model = build_model(tiny_config(depth_mode="vanilla", residual=residual))
        cache = model.new_cache(2, 9)
        outs.append((model(idx)[0], model(idx[:, :5], cache=cache)[0], model(idx[:, 5:],
                                                                             cache=cache)[0]))
    for a, b in zip(*outs):
        assert torch.equal(a, b), f"DenseFormer at init differs from vanilla by {(a - b).abs().max():.3e}"


@pytest.mark.parametrize("residual", BASELINES)
def test_a_seed_gives_the_backbone_vanillas_weights(residual):
    """ablate.py pairs runs by seed: the shared weights must start equal, the baseline's own drawn
    after them."""
    torch.manual_seed(3)
    vanilla = GPT(tiny_config(depth_mode="vanilla")).state_dict()
    torch.manual_seed(3)
    model = build_model(tiny_config(depth_mode="vanilla", residual=residual)).state_dict()
    assert all(torch.equal(v, model[k]) for k, v in vanilla.items())
    assert len(model) > len(vanilla)


PAPER_3B = dict(vocab_size=50304, n_embd=2048, mlp_hidden=6912, n_layer=48, n_head=32, n_kv_head=8,
                head_dim=64, depth_mode="vanilla")


@pytest.mark.parametrize("residual, extra", [("denseformer", 1_224), ("attnres", 397_409), ("mhc", 19_663_396)])
def test_extra_parameters_at_the_paper_3b_shape(residual, extra):
    with torch.device("meta"):  # shapes only: nothing of the 3B model is allocated
        vanilla = GPT(ModelConfig(**PAPER_3B))
        model = build_model(make_config(**PAPER_3B, residual=residual))
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() - vanilla.num_params() == extra
    assert {n for n, _ in vanilla.named_parameters()} < {n for n, _ in model.named_parameters()}


def authors_names(residual, L, D, n=4):
    """The names and shapes of the authors' checkpoints (their modeling code), written out
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
        for i in range(L):
            for s in ("attn", "mlp"):
                p = f"model.layers.{i}.{s}_residual_connector"
                names.update({f"{p}.pre_logits": (n,), f"{p}.post_logits": (n,),
                              f"{p}.residual_logits": (n, n), f"{p}.alpha_pre": (),
                              f"{p}.alpha_post": (), f"{p}.alpha_res": (),
                              f"{p}.mhc_input_norm.weight": (n * D,),
                              f"{p}.mhc_dynamic_projection.weight": (n * n + 2 * n, n * D)})
        names["model.residual_stream_projector.reduce_logits"] = (n,)
    return names


@pytest.mark.parametrize("residual", BASELINES)
def test_authors_checkpoint_loads_with_the_name_map(residual):
    c = tiny_config(depth_mode="vanilla", residual=residual)
    model = build_model(c)
    shapes = {f"model.{k}": tuple(v.shape) for k,
              v in GPT(tiny_config(depth_mode="vanilla")).state_dict().items()
              if k != "lm_head.weight"}
    shapes.update({"lm_head.weight": (c.vocab_size, c.n_embd),
                   "lm_head_layernorm.weight": (c.n_embd,)})
    shapes.update(authors_names(residual, c.n_layer, c.n_embd))
    # a synthetic release
    theirs = {k: torch.randn(s, dtype=torch.float64) for k, s in shapes.items()}
    # the loader's name map
    ours = {hf.our_name(k): v for k, v in theirs.items() if not hf.IGNORED.search(k)}
    model.load_state_dict(ours, strict=True)  # no reshaping, nothing missing or left
    for k, v in ours.items():
        assert torch.equal(model.state_dict()[k], v.float()), k


def test_authors_config_keys():
    got = hf._authors_baseline({"baseline_mode": "densetransformer", "denseformer_dwa_period": 2,
                                "hidden_size": 2048}, "config.json")
    assert got == {"residual": "denseformer", "depth_mode": "vanilla", "denseformer_dwa_period": 2}
    assert hf._authors_baseline({"baseline_mode": "MHC", "mhc_num_streams": 4},
                                "config.json")["residual"] == "mhc"
    with pytest.raises(CheckpointError, match="not one of the paper's baselines"):
        hf._authors_baseline({"baseline_mode": "densenet"}, "config.json")


# ----------------------------------------------------------------------------- errors and the
# scripts

@pytest.mark.parametrize("overrides, fragment", [
    (dict(residual="mhc"), "use --depth_mode=vanilla with --residual=mhc"),
    (dict(residual="attnres", depth_mode="kv"), "use --depth_mode=vanilla with --residual=attnres"),
    (dict(residual="denseformer", depth_mode="vanilla", n_loops=2), "use --n_loops=1 with --residual=denseformer"),
    (dict(residual="hc"), "choose one of add, denseformer, attnres, mhc"),
    (dict(mhc_num_streams=1), "mhc_num_streams must be at least 2"),
    (dict(attnres_block_size=0), "attnres_block_size must be a positive integer"),
    (dict(denseformer_dwa_dilation=0), "denseformer_dwa_dilation must be a positive integer"),
])
def test_bad_configs_raise_clear_errors(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        tiny_config(**overrides)


TINY_BASELINE = ["--dataset=tiny", "--n_layer=2", *TINY_SHAPE, "--max_iters=2", "--eval_interval=2",
                 "--eval_seqs=2", "--micro_batch=2", "--batch_tokens=64", "--sample_tokens=0"]


def test_train_and_sample_a_baseline(data_root, tmp_path):
    """End to end as a user runs it (mHC, the most involved; the others differ only in build_model's
    pick)."""
    proc = run("train.py", *TINY_BASELINE, f"--data_root={data_root}", f"--out_dir={tmp_path}",
               "--residual=mhc", check=False)
    assert proc.returncode != 0 and "use --depth_mode=vanilla with --residual=mhc" in proc.stderr
    proc = run("train.py", *TINY_BASELINE, f"--data_root={data_root}", f"--out_dir={tmp_path}",
               "--residual=mhc", "--depth_mode=vanilla", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["model_config"]["residual"] == "mhc"
    proc = run("sample.py", f"--out_dir={tmp_path}", "--prompt=the", "--max_new_tokens=6",
               "--device=cpu", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "residual=mhc" in proc.stderr and "3 prompt + 6 new tokens" in proc.stdout
