"""
What a graded test asks of a model.py, and the process that asks it of a student's (`serve`): the
same ops run on the reference in the trusted parent for the expected outputs. Messages travel in
torch.save's format and the parent reads them as data. While problem 3 is graded, the functions of
problems 1, 2 and 4 are stubs that ask the parent. All of this runs in the child and is the child's
to change: the parent trusts only the values it gets. It imports only torch: the child runs it
from its source.
"""
import dataclasses
import inspect
import io
import os
import struct
import sys
import traceback

import torch

# A row with its own default stride (as LIMe's 1 in baselines.py), registered by the grader in both
# the student's model and the reference: ModelConfig.stride must read DEFAULT_STRIDES.
OWN_STRIDE_MODE = "own_stride"


def prepare(model):
    """The grader's extra rows of DEPTH_MODES (before any function is replaced)."""
    if OWN_STRIDE_MODE not in model.DEPTH_MODES:
        model.DEPTH_MODES[OWN_STRIDE_MODE] = model.DEPTH_MODES["value"]
        model.DEFAULT_STRIDES[OWN_STRIDE_MODE] = 1


# ------------------------------------------------------------------------------- the ops

def clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    return [clone(i) for i in x] if isinstance(x, (list, tuple)) else x


def sources(model, rule):
    config = model.ModelConfig(**rule)
    return [list(config.sources(e)) for e in range(config.n_eff_layer)]


def build(model, config, state, dtype):
    """A GPT of these settings with these weights (the ones it has), in dtype, in eval mode."""
    torch.manual_seed(0)
    gpt = model.GPT(model.ModelConfig(**config)).to(dtype)
    gpt.load_state_dict({k: v.to(dtype) for k, v in state.items() if k in gpt.state_dict()})
    return gpt.eval()


def logits(model, config, state, idx, dtype=torch.float64):
    return build(model, config, state, dtype)(idx)[0]


def decode(model, config, state, idx, held, prefill=3, dtype=torch.float64):
    """A cached decoding after `held` (a cache's k, v and pos, written by the parent: tokens no one
    sent, so the logits depend on reading them), a prefill, then one token at a time: the logits,
    concatenated, and the cache's keys and values at the end (each layer's record)."""
    gpt = build(model, config, state, dtype)
    pos = held["pos"]
    cache = gpt.new_cache(idx.shape[0], pos + idx.shape[1])
    cache.k[:, :, :, :pos], cache.v[:, :, :, :pos] = held["k"], held["v"]
    cache.pos = pos
    parts = [gpt(idx[:, :prefill], cache=cache)[0]]
    parts += [gpt(idx[:, t:t + 1], cache=cache)[0] for t in range(prefill, idx.shape[1])]
    return [torch.cat(parts, 1), cache.k, cache.v]


def together(model, config, state, idx, held):
    """The full forward and a cached decoding of one model, nothing replaced."""
    return [logits(model, config, state, idx), *decode(model, config, state, idx, held)]


def call(model, function, arguments):
    """A method of KVCache on a cache sent by value (its state): what it returns, and the state it
    leaves; the parent drives problem 4's cache call by call, so only these functions decode."""
    cache, state = object.__new__(model.KVCache), arguments["self"]["KVCache"]
    cache.k, cache.v, cache.pos = state["k"].clone(), state["v"].clone(), state["pos"]
    result = original(model, function)(cache, **{k: clone(v) for k, v in arguments.items()
                                                 if k != "self"})
    return [result, {"k": cache.k, "v": cache.v, "pos": cache.pos}]


def cotangent(out):
    """A fixed, uneven weighting of an output's elements: what a loss sends back through it."""
    return torch.arange(1, out.numel() + 1, dtype=torch.float64).sin().reshape(out.shape).to(
        out.dtype)


def tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else []
    return [t for i in items for t in tensors(i)]


def leaves(x) -> list:
    """x's tensors, each floating one a fresh copy that records its gradient."""
    return [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in tensors(x)]


def through(outputs, inputs, weight=cotangent) -> list:
    """d <outputs, weight> / d input for each floating input (zeros where it does not reach)."""
    inputs = [i for i in inputs if i.requires_grad]
    outs = [o for o in tensors(outputs) if o.requires_grad]
    grads = torch.autograd.grad(sum((o * weight(o)).sum() for o in outs), inputs,
                                allow_unused=True) if outs else [None] * len(inputs)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads)]


def backward(model, op, args):
    """Training's backward through an op's functions: the gradient of <its outputs, cotangent>
    with respect to each of its floating inputs, in order."""
    inputs = leaves(args)
    with torch.enable_grad():
        return through(OPS[op](model, *rebuilt(list(args), iter(inputs))), inputs)


def gradients(model, config, state, idx):
    """A model's parameter gradients of <logits, cotangent>, by name."""
    gpt = build(model, config, state, torch.float64)
    with torch.enable_grad():
        return through(gpt(idx)[0], list(gpt.parameters()))


OPS = {"stride": lambda model, rule: model.ModelConfig(**rule).stride, "sources": sources,
       "group_mean": lambda model, q, n_kv: model.group_mean(q.clone(), n_kv),
       "softmax_weights": lambda model, q, keys: model.softmax_weights(q.clone(), clone(keys)),
       "weighted_sum": lambda model, alpha, xs: model.weighted_sum(alpha.clone(), clone(xs)),
       **{f: lambda model, mode, args, f=f: list(getattr(model, f)(*clone(args),
                                                                  model.DEPTH_MODES[mode]))
          for f in ("depth_mix", "depth_mix_one")},
       "causal_attention": lambda model, q, k, v: model.causal_attention(q.clone(), k.clone(),
                                                                        v.clone()),
       **{f.__name__: f for f in (logits, decode, together, call, backward, gradients)}}


# --------------------------------------------------------------- a call, by value, both ways

def owner_and_name(model, function):
    """"model.py:KVCache.update" -> (model.KVCache, "update")."""
    path = function.split(":")[1].split(".")
    owner = model
    for part in path[:-1]:
        owner = getattr(owner, part)
    return owner, path[-1]


def original(model, function):
    value = inspect.getattr_static(*owner_and_name(model, function))
    return value.fget if isinstance(value, property) else value


def freeze(x):
    """A call's argument or result as plain data: tensors copied, a config as its fields, a KV
    cache as its state (what a call depends on besides its arguments)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return [freeze(i) for i in x]
    if type(x).__name__ == "KVCache":
        return {"KVCache": {"k": x.k.clone(), "v": x.v.clone(), "pos": x.pos}}
    if dataclasses.is_dataclass(x):
        return {"ModelConfig": {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}}
    if isinstance(x, dict):
        return {str(k): freeze(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot send a {type(x).__name__}")


def bound(fn, args, kwargs) -> dict:
    """The call's arguments by name, defaults filled in, frozen."""
    call = inspect.signature(fn).bind(*args, **kwargs)
    call.apply_defaults()
    return {k: freeze(v) for k, v in call.arguments.items()}


def answer(model, function, arguments, fn=None, cotangent=None) -> dict:
    """The reference's answer to a call sent by value: its result (a view of the cache's own says
    where it lies) and the state a KV cache is left in; given a cotangent, the gradient of <result,
    cotangent> for each floating argument instead (a stub's backward)."""
    fn, args, cache = fn or original(model, function), {}, None
    if cotangent is not None:
        inputs = leaves(arguments)
        with torch.enable_grad():
            out = fn(**rebuilt(arguments, iter(inputs)))
            return {"grads": through(out, inputs, lambda _: cotangent)}
    for name, value in arguments.items():
        if isinstance(value, dict) and "KVCache" in value:
            state, cache = value["KVCache"], object.__new__(model.KVCache)
            cache.k, cache.v, cache.pos, value = state["k"], state["v"], state["pos"], cache
        elif isinstance(value, dict) and "ModelConfig" in value:
            value = model.ModelConfig(**value["ModelConfig"])
        args[name] = value
    result = fn(**args)
    return {"result": where(result, cache),
            "state": None if cache is None else {"k": cache.k, "v": cache.v, "pos": cache.pos}}


def rebuilt(x, it):
    """The arguments with each tensor replaced, in order, by the next of `it`."""
    if isinstance(x, torch.Tensor):
        return next(it)
    if isinstance(x, (list, tuple)):
        return [rebuilt(i, it) for i in x]
    if isinstance(x, dict):
        return {k: rebuilt(v, it) for k, v in x.items()}
    return x


def where(result, cache):
    if isinstance(result, (list, tuple)):
        return [where(r, cache) for r in result]
    if isinstance(result, torch.Tensor) and cache is not None:
        for name in ("k", "v"):
            if result.untyped_storage().data_ptr() == getattr(cache, name).untyped_storage()\
                    .data_ptr():
                return {"view_of": name, "size": list(result.shape),
                        "stride": list(result.stride()), "offset": result.storage_offset()}
    return freeze(result)


def applied(reply, args):
    """The parent's answer in the child: the cache's state written in place, views rebuilt."""
    cache = args[0] if args and type(args[0]).__name__ == "KVCache" else None
    if reply["state"] is not None:
        cache.k.copy_(reply["state"]["k"])
        cache.v.copy_(reply["state"]["v"])
        cache.pos = reply["state"]["pos"]

    def thaw(x):
        if isinstance(x, dict) and "view_of" in x:
            return getattr(cache, x["view_of"]).as_strided(x["size"], x["stride"], x["offset"])
        return [thaw(i) for i in x] if isinstance(x, list) else x
    result = thaw(reply["result"])
    return tuple(result) if isinstance(result, list) and cache is not None else result


def replace(model, functions, wrap):
    """Each named function replaced by wrap(function, original) wherever it is held (module, class,
    property, a DEPTH_MODES row's weights); the undo list for restore()."""
    undo = []
    for function in functions:
        owner, name = owner_and_name(model, function)
        static, old = inspect.getattr_static(owner, name), original(model, function)
        new = wrap(function, old)
        setattr(owner, name, property(new) if isinstance(static, property) else new)
        undo.append((owner, name, static))
        for row in model.DEPTH_MODES.values():
            if row.weights is old:
                object.__setattr__(row, "weights", new)
                undo.append((row, "weights", old))
    return undo


def restore(model, undo):
    for owner, name, value in reversed(undo):
        (object.__setattr__ if isinstance(owner, model.DepthMode) else setattr)(owner, name, value)


# ------------------------------------------------------------------------- the pipes

def packed(message) -> bytes:
    """A message as it travels: its length, then torch.save's bytes."""
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return struct.pack("<Q", buffer.tell()) + buffer.getvalue()


def send(f, message):
    f.write(packed(message))
    f.flush()


def receive(f):
    """The parent's next message, or EOFError (the parent reads the child's as data only)."""
    head = f.read(8)
    body = f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b""
    if not body:
        raise EOFError
    return torch.load(io.BytesIO(body), weights_only=False)


def serve(read_fd, write_fd):
    """The child: import the student's model.py from the current folder, say so, then run each op
    the parent sends ({"op", "args", "stubs"}) and send back {"result"} or {"error"}. A stub's call
    is {"call", "arguments"}, answered {"result", "state"} or {"own": True}."""
    inbox, outbox = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    sys.path.insert(0, os.getcwd())
    try:
        import model
        prepare(model)
    except BaseException as e:  # a SystemExit at import is the code's too
        send(outbox, {"error": describe(e, import_time=True)})
        return
    send(outbox, {"ready": True})

    def stub(function, fn):
        def asking(*args, **kwargs):
            arguments = bound(fn, args, kwargs)
            send(outbox, {"call": function, "arguments": arguments})
            reply = receive(inbox)
            if reply.get("own"):
                return fn(*args, **kwargs)
            result = applied(reply, args)
            inputs = [t for t in tensors(inspect.signature(fn).bind(*args, **kwargs).arguments)
                      if t.is_floating_point()]
            if isinstance(result, torch.Tensor) and any(t.requires_grad for t in inputs):
                return Answered.apply(result, (function, fn, arguments), *inputs)
            return result
        return asking

    class Answered(torch.autograd.Function):
        """A stub's answer in a backward pass: the parent's gradient of the reference."""
        @staticmethod
        def forward(ctx, result, call, *inputs):
            ctx.call = call
            return result.clone()

        @staticmethod
        def backward(ctx, grad):
            function, fn, arguments = ctx.call
            send(outbox, {"call": function, "arguments": arguments, "cotangent": grad})
            reply = receive(inbox)
            if "grads" not in reply:  # the student's own function's backward
                reply = answer(model, function, arguments, fn, cotangent=grad)
            return (None, None, *reply["grads"])
    while True:
        try:
            task = receive(inbox)
        except EOFError:
            return
        undo = replace(model, task["stubs"], stub)
        try:
            with torch.no_grad():
                result = {"result": freeze(OPS[task["op"]](model, *task["args"]))}
        except BaseException as e:
            result = {"error": describe(e)}
        finally:
            restore(model, undo)
        send(outbox, result)


def describe(e, import_time=False):
    """An exception as one line, with the student's file and line where it was raised."""
    lines = [n for frame, n in traceback.walk_tb(e.__traceback__)
             if frame.f_code.co_filename.endswith("model.py")]
    if isinstance(e, SyntaxError):  # its message names the whole path: the line is enough
        return f"SyntaxError: {e.msg} (model.py, line {e.lineno})"
    if isinstance(e, SystemExit):
        return f"model.py called sys.exit({e.code!r})"[:300] + " at import" * import_time
    first = str(e).splitlines()[0] if str(e).strip() else ""
    where = f" (model.py, line {lines[-1]})" if lines else ""
    return (f"{type(e).__name__}: {first}".rstrip(": ") + where)[:300]
