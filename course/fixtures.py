"""
The graded tests' reference outputs, recorded from the living model.py by course/make.py, so they
never drift from it, and replayed by the tests.

Every scenario is small and in float64: its inputs, the reference's outputs, and for problem 3,
whose functions call those of problems 1, 2 and 4, every call the reference made to those (arguments
and result). While problem 3 is graded, those functions answer from the record (`replaying`): a call
with arguments the reference passed gets the reference's result, any other call fails naming the
function. So a stub or a bug in problem 2 costs problem 3 nothing, and the record holds outputs,
never code.
"""
import dataclasses
import inspect
from contextlib import contextmanager

import torch

import model
from course.problems import PROBLEMS
from support.depth_weights import capture

FORMAT = 1  # bumped when the scenarios change: make.py rewrites the fixtures,
            # grade.py checks the number
TOL = dict(rtol=1e-7, atol=1e-10)  # float64 on both sides: a correct solution
                                   # differs by rounding only
# The tiny decoder of problem 3's scenarios; init_std is large so a wrong rule cannot hide behind
# nearly uniform depth weights.
TINY = dict(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_kv_head=1, head_dim=4, n_embd=8,
            mlp_hidden=16, init_std=0.3, depth_stride=2)
MODELS = {"value": dict(depth_mode="value"), "key": dict(depth_mode="key", depth_stride=1),
          "kv": dict(depth_mode="kv", depth_stride=3, depth_recent_window=1),
          "uniform": dict(depth_mode="uniform"),
          "vanilla": dict(depth_mode="vanilla", depth_stride=None),
          "looped": dict(depth_mode="value", n_layer=2, n_loops=2, depth_stride=None)}
CACHED = ("value", "kv", "looped")  # also decoded: a prefill of 3 tokens, then one at a time
SOURCE_RULES = [dict(n_layer=4, depth_stride=2), dict(n_layer=12), dict(n_layer=12, depth_stride=1),
                dict(n_layer=12, depth_stride=5, depth_recent_window=2),
                dict(n_layer=48, depth_stride=24),
                dict(n_layer=6, depth_stride=100), dict(n_layer=3, n_loops=4),
                dict(n_layer=3, n_loops=4, depth_stride=4, depth_recent_window=1),
                dict(n_layer=5, depth_mode="vanilla"), dict(n_layer=5, depth_mode="uniform")]


# ---------------------------------------------------------------------------- the functions by name

def owner_and_name(function):
    """"model.py:KVCache.update" -> (model.KVCache, "update")."""
    path = function.split(":")[1].split(".")
    owner = model
    for part in path[:-1]:
        owner = getattr(owner, part)
    return owner, path[-1]


def original(function):
    owner, name = owner_and_name(function)
    value = inspect.getattr_static(owner, name)
    return value.fget if isinstance(value, property) else value


@contextmanager
def patched(functions, wrap):
    """Each named function replaced by wrap(function_name, original) for the block: module globals,
    class attributes and properties, and the DEPTH_MODES rows that hold a function (a row's
    weights)."""
    undo = []
    for function in functions:
        owner, name = owner_and_name(function)
        static, old = inspect.getattr_static(owner, name), original(function)
        new = wrap(function, old)
        setattr(owner, name, property(new) if isinstance(static, property) else new)
        undo.append((owner, name, static))
        for row in model.DEPTH_MODES.values():
            if row.weights is old:
                object.__setattr__(row, "weights", new)
                undo.append((row, "weights", old))
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            restore = object.__setattr__ if isinstance(owner, model.DepthMode) else setattr
            restore(owner, name, value)


def others(number):
    """The functions of every problem but `number`."""
    return [f for p in PROBLEMS if p.number != number for f in p.functions]


# -------------------------------------------------------------------------- recording and replaying

def freeze(x):
    """A call's argument or result as plain data: tensors detached and copied, a config as its
    fields, a KV cache as its position (what a call depends on besides its arguments)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return [freeze(i) for i in x]
    if dataclasses.is_dataclass(x):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if type(x).__name__ == "KVCache":
        return {"KVCache.pos": x.pos}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot record a {type(x).__name__}")


def bound(function, fn, args, kwargs) -> dict:
    """The call's arguments by name, defaults filled in, frozen."""
    try:
        call = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise AssertionError(f"{function.split(':')[1]} called with the wrong "
                             f"arguments: {e}") from None
    call.apply_defaults()
    return {k: freeze(v) for k, v in call.arguments.items()}


def after(args):
    """The state a method leaves behind that the caller reads: a KV cache's position."""
    first = args[0] if args else None
    return {"pos": first.pos} if type(first).__name__ == "KVCache" else {}


def distance(a, b) -> float:
    """0 when a and b agree to TOL, else how far apart (inf when they differ in kind or shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return float("inf")
        a, b = a.double(), b.double()
        return 0.0 if torch.allclose(a, b, **TOL) else (a - b).abs().max().item()
    if isinstance(a, list) or isinstance(b, list):
        if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b):
            return float("inf")
        return max([distance(x, y) for x, y in zip(a, b)], default=0.0)
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return float("inf")
        return max([distance(a[k], b[k]) for k in a], default=0.0)
    return 0.0 if a == b else float("inf")


def recorder(calls):
    """wrap() for patched: run the original, append (arguments, result, state after) to calls[name]
    unless a call with the same arguments is there already."""
    def wrap(function, fn):
        def recording(*args, **kwargs):
            asked, seen = bound(function, fn, args, kwargs), calls.setdefault(function, [])
            out = fn(*args, **kwargs)
            if all(distance(asked, arguments) > 0 for arguments, _, _ in seen):
                seen.append((asked, freeze(out), after(args)))
            return out
        return recording
    return wrap


def replayer(calls):
    """wrap() for patched: answer from the record, or fail naming the function and how far the
    nearest recorded call's arguments are."""
    def wrap(function, fn):
        name = function.split(":")[1]

        def replaying(*args, **kwargs):
            asked = bound(function, fn, args, kwargs)
            recorded = calls.get(function, [])
            gaps = [distance(asked, arguments) for arguments, _, _ in recorded]
            if 0.0 not in gaps:
                nearest = (f"{min(gaps):.3g}" if gaps and min(gaps) < float("inf")
                           else "no call alike")
                raise AssertionError(f"{name} was called with arguments the reference never "
                                     f"passed it (nearest recorded call: {nearest}): check what "
                                     f"your code hands it")
            _, out, state = recorded[gaps.index(0.0)]
            for key, value in state.items():
                setattr(args[0], key, value)
            return thaw(out)
        return replaying
    return wrap


def thaw(x):
    """A recorded result as the code expects it back: tensors fresh, lists as they were returned."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [thaw(i) for i in x]
    return x


@contextmanager
def replaying(number, calls):
    """Every function of the other problems answers from the record while problem `number` is
    graded."""
    with patched(others(number), replayer(calls)):
        yield


# ----------------------------------------------------------------------------- the scenarios

def build(name, state):
    """Problem 3's model `name` with the recorded weights, in float64."""
    config = model.ModelConfig(**{**TINY, **MODELS[name]})
    torch.manual_seed(0)
    gpt = model.GPT(config).double()
    gpt.load_state_dict({k: v for k, v in state.items() if k in gpt.state_dict()})
    return gpt.eval()


def decode(gpt, idx, prefill=3):
    """Logits of a cached decoding: a prefill, then one token at a time, concatenated."""
    cache = gpt.new_cache(idx.shape[0], idx.shape[1])
    parts = [gpt(idx[:, :prefill], cache=cache)[0]]
    parts += [gpt(idx[:, t:t + 1], cache=cache)[0] for t in range(prefill, idx.shape[1])]
    return torch.cat(parts, 1)


def make(seed=0) -> dict:
    """Every scenario's inputs and the living code's outputs (course/make.py saves them)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    ref = {"format": FORMAT, "calls": {}}
    ref["sources"] = [(rule, (c := model.ModelConfig(**rule)).stride,
                       [c.sources(e) for e in range(c.n_eff_layer)])
                      for rule in SOURCE_RULES]

    q = randn(2, 4, 5, 3)
    ref["group_mean"] = [(q, n_kv, model.group_mean(q, n_kv)) for n_kv in (1, 2, 4)]
    ref["softmax"] = []
    for C, dtype in ((1, torch.float64), (3, torch.float64), (4, torch.bfloat16)):
        qbar, keys = 2 * randn(2, 2, 5, 3), [2 * randn(2, 2, 5, 3) for _ in range(C)]
        qbar, keys = qbar.to(dtype), [k.to(dtype) for k in keys]
        ref["softmax"].append((qbar, keys, model.softmax_weights(qbar, keys)))
    # the bf16 case's weights from float32 scores: a float32 softmax of either scores is right
    ref["softmax_wide"] = model.softmax_weights(qbar.float(), [k.float() for k in keys])

    ref["weighted_sum"] = []
    for C in (1, 3):
        alpha, xs = randn(2, 2, C, 5).softmax(2), [randn(2, 2, 5, 3) for _ in range(C)]
        ref["weighted_sum"].append((alpha, xs, model.weighted_sum(alpha, xs)))
    with patched(others(3), recorder(ref["calls"])):
        ref["depth_mix"], ref["depth_mix_one"] = [], []
        for mode in ("value", "key", "kv", "uniform"):
            row = model.DEPTH_MODES[mode]
            for n_src, T in ((1, 5), (3, 5), (2, 1)):
                args = (randn(1, 4, T, 3), randn(1, 2, T, 3), randn(1, 2, T, 3),
                        [randn(1, 2, T, 3) for _ in range(n_src)],
                        [randn(1, 2, T, 3) for _ in range(n_src)])
                ref["depth_mix"].append((mode, args, model.depth_mix(*args, row, fast=False)))
                if T == 1 and row.decode_kernel:
                    ref["depth_mix_one"].append((mode, args, model.depth_mix_one(*args, row)))
        torch.manual_seed(seed)
        state = model.GPT(model.ModelConfig(**{**TINY, "depth_mode": "vanilla"})).state_dict()
        for key in state:  # norm weights off their init of one, so a missing or swapped norm shows
            if key.endswith("norm.weight"):
                state[key] = state[key] + 0.2 * randn(*state[key].shape).float()
        ref["state"], ref["models"] = state, {}
        idx = torch.randint(0, TINY["vocab_size"], (1, 6), generator=g)
        for name in MODELS:
            gpt = build(name, state)
            with torch.no_grad():
                logits = gpt(idx)[0]
                ref["models"][name] = (idx, logits)
                if name in CACHED:
                    decode(gpt, idx)
                    with capture(gpt):  # the decode steps without the fast path, too
                        decode(gpt, idx)

    T, L = 8, 3
    layers = [(randn(1, 4, T, 4), randn(1, 2, T, 4), randn(1, 2, T, 4)) for _ in range(L)]
    ref["attention"] = {"chunks": [4, 1, 2, 1], "layers": layers,
                        "outputs": [model.causal_attention(*qkv) for qkv in layers]}
    return ref
