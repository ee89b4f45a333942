"""
The graded tests' scenarios: the inputs each test hands a student's functions, drawn from a seed.
A student copy grades the practice set (seed 0) against outputs and problem 3's calls recorded by
course/make.py; the instructor's grader draws a fresh seed each time, adds hidden scenarios and
computes the outputs from its own model.py, so no answer from the fixtures or a report matches.
"""
import torch

from course import ops
from course.problems import PROBLEMS

FORMAT = 4  # bumped when the scenarios change: grade.py refuses fixtures of another format
# The tiny decoder of problem 3's scenarios; init_std is large so a wrong rule cannot hide behind
# nearly uniform depth weights.
TINY = dict(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_kv_head=1, head_dim=4, n_embd=8,
            mlp_hidden=16, init_std=0.3, depth_stride=2)
MODELS = {"value": dict(depth_mode="value"), "key": dict(depth_mode="key", depth_stride=1),
          "kv": dict(depth_mode="kv", depth_stride=3, depth_recent_window=1),
          "uniform": dict(depth_mode="uniform"),
          "vanilla": dict(depth_mode="vanilla", depth_stride=None),
          "looped": dict(depth_mode="value", n_layer=2, n_loops=2, depth_stride=None)}
HIDDEN_MODELS = {"own stride": dict(depth_mode=ops.OWN_STRIDE_MODE, depth_stride=None),
                 "grouped": dict(depth_mode="value", n_head=4, n_kv_head=2),
                 "looped, stride 3": dict(depth_mode="kv", n_layer=2, n_loops=3, depth_stride=3)}
CACHED = ("value", "kv", "looped")  # also decoded: a prefill of 3 tokens, then one at a time
SOURCE_RULES = [dict(n_layer=4, depth_stride=2), dict(n_layer=12), dict(n_layer=12, depth_stride=1),
                dict(n_layer=12, depth_stride=5, depth_recent_window=2),
                dict(n_layer=6, depth_stride=100), dict(n_layer=3, n_loops=4),
                dict(n_layer=3, n_loops=4, depth_stride=4, depth_recent_window=1),
                dict(n_layer=5, depth_mode="vanilla"), dict(n_layer=5, depth_mode="uniform")]
PAPER = dict(n_layer=48, depth_stride=24)  # 117 candidates over its 48 layers (Table 2)


def state_of(model, config, seed):
    """Weights of a tiny decoder: a GPT's init, norm weights moved off one so a missing or swapped
    norm shows."""
    torch.manual_seed(seed)
    state = model.GPT(model.ModelConfig(**config)).state_dict()
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.2 * torch.randn(v.shape, generator=g) if k.endswith("norm.weight") else v)
            .double() for k, v in state.items()}


def drawn_rules(g) -> list:
    """Problem 1's hidden rules, drawn from the seed (a table of one grading's answers misses the
    next's): a mode with its own stride (its effective depth 4 or more: half of it is not 1),
    grouped and looped models, explicit strides, recent windows."""
    def pick(*xs):
        return xs[int(torch.randint(len(xs), (), generator=g))]
    rules = [dict(n_layer=pick(*range(4, 13)), n_loops=pick(1, 1, 2, 3), depth_mode=mode,
                  depth_recent_window=pick(0, 0, 1, 2, 3))
             for mode in (ops.OWN_STRIDE_MODE, ops.OWN_STRIDE_MODE, "kv", "value", "value", "kv")]
    for rule in rules[4:]:  # explicit strides
        rule["depth_stride"] = pick(*range(1, rule["n_layer"] * rule["n_loops"] + 2))
    return rules


def scenarios(model, seed=0, hidden=False) -> dict:
    """{test: [(op, args, what)]}: every test's inputs (model: the reference, for the weights)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.float64, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    def described(rule):
        return ", ".join(f"{k}={v}" for k, v in rule.items())
    rules = SOURCE_RULES + (drawn_rules(g) if hidden else [])
    s = {"the_default_stride_is_the_modes_or_half_the_effective_depth":
         [("stride", (r,), described(r)) for r in rules if r.get("depth_stride") is None],
         "an_explicit_stride_is_kept":
         [("stride", (r,), described(r)) for r in rules if r.get("depth_stride") is not None],
         "every_layer_has_the_sources_of_the_rule":
         [("sources", (r,), described(r)) for r in rules],
         "layer_zero_and_vanilla_have_no_sources": [("sources", (r,), described(r)) for r in rules],
         "the_paper_counts_117_candidates_at_48_layers": [("sources", (PAPER,), "48 layers")]}

    q = randn(2, 4, 5, 3)
    heads = [(q, n_kv) for n_kv in (1, 2, 4)] + [(randn(3, 6, 2, 4), 2)] * hidden
    s["qbar_is_the_mean_of_each_group_of_query_heads"] = [
        ("group_mean", (q, n_kv), f"n_head={q.shape[1]}, n_kv_head={n_kv}")
        for q, n_kv in heads] + [
        ("backward", ("group_mean", (q, 2)), "backward (training), n_kv_head=2")]
    def weights(C, T, scale, what, dtype=torch.float64):
        x = [randn(2, 2, T, 3, scale=scale, dtype=dtype) for _ in range(C + 1)]  # qbar, C keys
        return "softmax_weights", (x[0], x[1:]), f"{what}{C} candidates, T={T}, scale {scale}"
    wide = [weights(C, T, scale, "") for C, T, scale in  # T = C; scores that overflow
            [(1, 5, 2.0), (3, 5, 2.0)] + [(4, 4, 2.0), (3, 5, 40.0)] * hidden]
    bf16 = [weights(C, T, scale, "bf16, ", torch.bfloat16)  # bf16 scores past exp's range
            for C, T, scale in [(4, 5, 2.0)] + [(3, 3, 12.0)] * hidden]
    s["the_weights_are_a_softmax_over_the_candidates"] = wide + [
        ("backward", ("softmax_weights", wide[1][1]), "backward (training), 3 candidates")]
    s["the_softmax_runs_in_float32_for_bf16_activations"] = bf16

    sums = []
    for C, dtype in [(1, torch.float64), (3, torch.float64)] + [(3, torch.bfloat16)] * hidden:
        alpha = randn(2, 2, C, 5).softmax(2).to(torch.float32 if dtype == torch.bfloat16 else None)
        sums.append(("weighted_sum", (alpha, [randn(2, 2, 5, 3, dtype=dtype) for _ in range(C)]),
                     f"{C} candidates, {str(dtype).split('.')[1]}"))
    s["the_weighted_sum_of_the_candidates"] = sums
    mixes, ones = [], []
    for mode in ("value", "key", "kv", "uniform"):
        for n_src, T, B in [(1, 5, 1), (3, 5, 1), (2, 1, 1)] + [(2, 3, 2), (2, 1, 3)] * hidden:
            args = (randn(B, 4, T, 3), randn(B, 2, T, 3), randn(B, 2, T, 3),
                    [randn(B, 2, T, 3) for _ in range(n_src)],
                    [randn(B, 2, T, 3) for _ in range(n_src)])
            what = f"depth_mode={mode}, {n_src} sources, B={B}, T={T}"
            mixes.append(("depth_mix", (mode, args), what))
            if T == 1 and model.DEPTH_MODES[mode].decode_kernel:
                ones.append(("depth_mix_one", (mode, args), what))
    s["depth_mix_mixes_what_each_mode_says"] = mixes + [
        ("backward", ("depth_mix", m[1]), f"backward (training), {m[2]}") for m in mixes
        if m[2].startswith(("depth_mode=value, 3", "depth_mode=key, 3"))]
    s["one_new_token_in_one_attention_call"] = ones

    idx = torch.randint(0, TINY["vocab_size"], (1, 6), generator=g)
    wide_idx = torch.randint(0, TINY["vocab_size"], (2, 7), generator=g)
    models = {**MODELS, **(HIDDEN_MODELS if hidden else {})}
    configs = {name: {**TINY, **m} for name, m in models.items()}
    states = {name: state_of(model, c, seed) for name, c in configs.items()}
    runs = [(name, idx) for name in models] + [("value", wide_idx), ("kv", wide_idx)] * hidden
    s["the_model_gives_the_reference_logits"] = [
        ("logits", (configs[name], states[name], x), f"{name}, batch {x.shape[0]}")
        for name, x in runs] + [("gradients", (configs[name], states[name], idx),
                                 f"backward (training), {name}") for name in ("value", "kv")]
    s["a_bf16_model_runs_in_bf16"] = [
        ("logits", (configs[name], states[name], idx, torch.bfloat16), f"{name}, bf16")
        for name in ("value", "kv", "uniform")]
    def held(name, x):
        """A cache the decoding starts from, of random records: no tokens give them."""
        c = model.ModelConfig(**configs[name])
        pos = c.block_size - x.shape[1]
        shape = (c.n_eff_layer, x.shape[0], c.n_kv_head, pos, c.head_dim)
        return {"k": randn(*shape), "v": randn(*shape), "pos": pos}
    decodes = [(name, idx) for name in CACHED] + \
        [("own stride", idx), ("looped, stride 3", idx), ("value", wide_idx)] * hidden
    s["each_layer_stores_its_mixed_record_and_decoding_reads_it"] = [
        ("decode", (configs[name], states[name], x, held(name, x)), f"{name}, batch {x.shape[0]}")
        for name, x in decodes]
    s["together"] = [("together", (configs[name], states[name], idx, held(name, idx)), name)
                     for name in MODELS]

    attention = []
    for B, n_head, n_kv, T, S in [(1, 4, 2, 8, 8), (1, 4, 2, 3, 8)] + \
            [(3, 6, 2, 5, 5), (2, 2, 2, 1, 6), (2, 4, 1, 4, 9)] * hidden:
        attention.append(("causal_attention", (randn(B, n_head, T, 4), randn(B, n_kv, S, 4),
                                               randn(B, n_kv, S, 4)),
                          f"B={B}, {n_head} heads over {n_kv}, T={T} of S={S}"))
    s["causal_attention_over_a_whole_sequence"] = attention + [
        ("backward", ("causal_attention", attention[1][1]),
         "backward (training), " + attention[1][2])]
    chunked = []  # the parent drives the cache: each call on the reference's state so far
    for B, chunks in [(1, [4, 1, 2, 1])] + [(3, [1, 3, 1, 2, 2]), (2, [9])] * hidden:
        T, start = sum(chunks), 0
        layers = [[randn(B, 4, T, 4), randn(B, 2, T, 4), randn(B, 2, T, 4)] for _ in range(3)]
        state = {"k": torch.zeros(3, B, 2, T, 4, dtype=torch.float64), "pos": 0,
                 "v": torch.zeros(3, B, 2, T, 4, dtype=torch.float64)}
        for n in chunks:
            where, end = f"batch {B}, chunks {chunks}, chunk [{start}, {start + n}]", start + n
            for e, (q, k, v) in enumerate(layers):
                args = {"self": {"KVCache": state}, "e": e, "k": k[:, :, start:end].clone(),
                        "v": v[:, :, start:end].clone()}
                (K, V), state = ops.call(model, "model.py:KVCache.update", args)
                chunked += [("call", ("model.py:KVCache.update", args), f"{where}, layer {e}"),
                            ("causal_attention", (q[:, :, start:end].clone(), K.clone(),
                                                  V.clone()), f"{where}, layer {e}: attention")]
            args = {"self": {"KVCache": state}, "T": n}
            chunked.append(("call", ("model.py:KVCache.advance", args), f"{where}: advance"))
            state, start = ops.call(model, "model.py:KVCache.advance", args)[1], end
    s["a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence"] = chunked
    return s


def expected(model, tests):
    """tests with the reference's outputs: {test: [(op, args, what, output)]}. The paper's count
    is kept as a count: its sources are nowhere in the fixtures."""
    with torch.no_grad():
        return {name: [(op, args, what, (candidates if name == PAPER_TEST else ops.freeze)(
                    ops.OPS[op](model, *args))) for op, args, what in cases]
                for name, cases in tests.items()}


PAPER_TEST = "the_paper_counts_117_candidates_at_48_layers"


def candidates(sources) -> int:
    """C: the candidates of every layer, its sources plus itself, over layers 1 .. L-1."""
    return sum(len(s) + 1 for s in sources[1:])


def stubbed(number) -> list:
    """The functions that answer from the reference while problem `number` is graded: the other
    problems', where this problem's functions call them (problem 3 calls those of 1, 2 and 4)."""
    return [f for p in PROBLEMS if p.number != number for f in p.functions] if number == 3 else []


def record(model) -> dict:
    """The practice fixtures: scenarios(0), the reference's outputs, and every call problem 3's
    functions made to the others' ({function: [(arguments, answer)]}), for a student copy."""
    ops.prepare(model)
    tests = scenarios(model, 0)
    calls = {}

    def recorder(function, fn):
        def recording(*args, **kwargs):
            arguments = ops.bound(fn, args, kwargs)
            reply = ops.answer(model, function, arguments, fn)  # on copies: the call goes on
            out = fn(*args, **kwargs)
            seen = calls.setdefault(function, [])
            if not any(same(arguments, a) for a, _ in seen):
                seen.append((arguments, reply))
            return out
        return recording
    problem3 = {name for p in PROBLEMS if p.number == 3 for name, _ in p.tests}
    undo = ops.replace(model, stubbed(3), recorder)
    try:
        third = expected(model, {k: v for k, v in tests.items() if k in problem3})
    finally:
        ops.restore(model, undo)
    rest = expected(model, {k: v for k, v in tests.items() if k not in problem3})
    return {"format": FORMAT, "tests": {**rest, **third}, "calls": calls}


def same(a, b) -> bool:
    """Whether a call's arguments are a recorded call's: tensors to float64 rounding, the rest
    equal, in the same containers."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-7, atol=1e-10)
    if isinstance(a, (list, dict)) and type(a) is type(b) and len(a) == len(b):
        pairs = zip(a, b) if isinstance(a, list) else ((a[k], b.get(k, ...)) for k in a)
        return all(same(x, y) for x, y in pairs)
    plain = (bool, int, float, str, type(None))
    return isinstance(a, plain) and isinstance(b, plain) and type(a) is type(b) and a == b
