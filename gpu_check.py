"""
The GPU check, ready for the few minutes a GPU is lent (docs/gpu_check.md): at the paper's 1.5B shape in bf16,
training throughput and peak memory of vanilla and value, eager and compiled (with its graph breaks);
bench_cache.py's prefill, decode and cache comparison; whether training, prefill and decode can run on flash
attention alone, and which attention kernels PyTorch picks for them when left to itself. One JSON, rewritten
(atomically) after every section, so a run cut off by a time limit keeps what it finished; a SIGTERM (an outer
`timeout`) records the section it cut off, with what that section had finished, before the script stops.

    timeout -k 15 570 python gpu_check.py                # one CUDA GPU: 5-9 minutes on an H200 (an unmeasured guess)
    python gpu_check.py --json=out/h200.json             # the result elsewhere (default out/gpu_check.json)
    python gpu_check.py --only=train_compile --steps=3 --json=out/gpu_check_2.json  # rerun what a limit cut off
    python gpu_check.py --device=cpu --n_layer=2 --n_embd=64 ...   # a tiny model on the CPU: tries every path

Sections (--only, run in the order given): flash, bench, train_eager, train_compile, the cheapest and most telling
first, so a run cut off by a time limit loses the compiled figures, not the rest. The model keys default to
configs/paper_1p5b_value.py's (the modes are vanilla and value); --key=value changes the shape. Training uses
random tokens, block_size of them per sequence. A section that fails is recorded with its error and the others
still run; the exit status is 1 when any failed.
"""
import gc
import inspect
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from baselines import build_model, make_config
from configurator import (ConfigError, check_ranges, fail, output_file, parse_config, read_config_file, reason,
                          resolve_device, table, write_atomically)
from memory import plan
from model import GPT, ModelConfig
from parallel import Parallel

ROOT = Path(__file__).resolve().parent
# The paper's 1.5B run: its shape, micro batch and optimizer settings. bench_cache.py's preset of the same name
# reads the same file, so the bench section measures this shape too.
PRESET = "paper_1p5b"
PAPER = read_config_file(ROOT / "configs" / "paper_1p5b_value.py")
MODEL_KEYS = [f.name for f in fields(ModelConfig) if f.name != "depth_mode"]  # the shape; the modes set depth_mode
MODES = ("vanilla", "value")  # value = Depth-Attention; every figure is compared with vanilla's
SECTIONS = ("flash", "bench", "train_eager", "train_compile")
CHECK_KEYS = dict(
    only=",".join(SECTIONS),  # sections to run, comma-separated, in this order
    device="cuda",        # cuda (the current GPU); cpu only tries the script, on a small model
    micro_batch=PAPER["micro_batch"],  # sequences of block_size tokens per training step (the 1.5B config's)
    warmup=2,             # untimed training steps per run; the first one compiles in train_compile
    steps=10,             # timed training steps per run; tokens/s is from their median
    compile_backend="inductor",  # torch.compile's backend; eager or aot_eager only trace (quick: tries the path)
    bench_batch=4,        # bench_cache.py --batch: sequences per prefill, decode and training step
    prompt_len=1024,      # bench_cache.py --prompt_len: prefill length, also its training sequence length
    new_tokens=64,        # bench_cache.py --new_tokens: decode steps after the prefill
    repeats=5,            # bench_cache.py --repeats: timed rounds after one warm-up round
    seed=0,               # weights and tokens
    json="out/gpu_check.json",  # the result, rewritten after each section
)
DEFAULTS = {**{k: v for k, v in asdict(ModelConfig()).items() if k in MODEL_KEYS},
            **{k: v for k, v in PAPER.items() if k in MODEL_KEYS}, **CHECK_KEYS}
KEY_RANGES = {"micro_batch": ">= 1", "warmup": ">= 1", "steps": ">= 1", "bench_batch": ">= 1",
              "prompt_len": ">= 1", "new_tokens": ">= 1", "repeats": ">= 1", "seed": ">= 0"}

# The flash check runs the 1.5B heads at few layers: which kernel SDPA picks depends on the head shape, the dtype
# and the mask, not on the depth. The prompt is a quarter of block_size, the chunk after it an eighth.
FLASH_LAYERS, FLASH_BATCH = 4, 2
FLASH_PATHS = ("train", "prefill", "decode")  # each must be able to run on flash alone
BACKENDS = [b for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH") if hasattr(SDPBackend, b)]
# How the attention aten ops name their SDPA backend, for the printed summary: _scaled_dot_product_flash_attention
# (and its _for_cpu, _backward), _efficient_attention_forward, _scaled_dot_product_attention_math, ...
KERNEL_NAMES = ("cudnn", "flash", "efficient", "math")
SDPA_ENTRY = "aten::scaled_dot_product_attention"  # the public op every plain SDPA call enters: not a kernel
GiB = 2 ** 30


# ----------------------------------------------------------------------------- configuration

def resolve(argv):
    """The checked config; every error is one line naming the fix, before any model is built."""
    try:
        cfg = parse_config(DEFAULTS, argv, __doc__, [__file__, inspect.getfile(GPT)])
        check_ranges(cfg, KEY_RANGES)
        sections = list(dict.fromkeys(s.strip() for s in cfg["only"].split(",") if s.strip()))
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown or not sections:
            raise ConfigError(f"--only={cfg['only']}: choose comma-separated sections from {', '.join(SECTIONS)}")
        cfg["only"] = ",".join(sections)
        if cfg["device"] == "cuda" and not torch.cuda.is_available():
            fail("gpu_check.py needs a CUDA GPU and torch sees none here; run it where a GPU is lent (--device=cpu "
                 "with a small model, e.g. --n_layer=2 --n_embd=64, only tries the script)")
        cfg["device"] = resolve_device(cfg["device"], allowed=("cpu", "cuda"))
        if cfg["device"] == "cuda" and not torch.cuda.is_bf16_supported():
            fail("gpu_check.py measures bf16 and this GPU has none; run it on an Ampere or newer GPU")
        for mode in MODES:  # a bad shape is caught here, not minutes later
            make_config(**model_keys(cfg), depth_mode=mode)
        if "flash" in sections and cfg["block_size"] < 16:
            raise ConfigError(f"the flash section needs --block_size >= 16 (a prompt of a quarter and a chunk of an "
                              f"eighth of it), got {cfg['block_size']}; raise it or leave out flash")
        output_file(cfg["json"], "--json", replaces=("sections",))
    except (ConfigError, ValueError) as e:
        fail(e)
    return cfg


def model_keys(cfg) -> dict:
    return {k: cfg[k] for k in MODEL_KEYS}


# ----------------------------------------------------------------------------- shared pieces

def build(cfg, mode, **shape) -> GPT:
    """The seeded model of `mode` at cfg's shape (shape: keys to change), float32 weights on cfg's device."""
    torch.manual_seed(cfg["seed"])
    with torch.device(cfg["device"]):
        return build_model(make_config(**{**model_keys(cfg), **shape, "depth_mode": mode}))


def random_tokens(cfg, batch, length):
    g = torch.Generator().manual_seed(cfg["seed"])
    return torch.randint(cfg["vocab_size"], (batch, length), generator=g).to(cfg["device"])


def autocast(device):
    """train.py's precision: bf16 autocast over float32 weights on CUDA, plain float32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()


def release(device):
    """Free what the last run left (its tensors must be unreferenced by now), so the next run's peak is its own."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------- flash

def attempt(work, backend) -> dict:
    """Run work() with SDPA restricted to one backend: torch raises when that backend cannot take the call.
    On failure, the error's first line and the reasons torch warns about (why each kernel was refused)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                work()
        except RuntimeError as e:
            why = list(dict.fromkeys(reason(w.message) for w in caught))
            return {"ok": False, "error": reason(e), "why": why}
    return {"ok": True}


def default_kernels(work) -> list:
    """The attention kernels work() runs when SDPA picks for itself (no sdpa_kernel restriction): the aten ops named
    for attention in a profile of the CPU side, where the ops are dispatched on CUDA too, less SDPA_ENTRY. A
    chunk's causal_lower_right mask calls its kernel's op directly, without SDPA_ENTRY."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    return sorted({e.name for e in prof.events() if e.name.startswith("aten::") and e.name != SDPA_ENTRY
                   and ("scaled_dot_product" in e.name or "attention" in e.name)})


def flash_mode(cfg, mode) -> dict:
    """(a) a training forward and backward, (b) a prefill into an empty cache, (c) a one-token decode step, each
    on flash alone; (d) a chunk continuing a filled cache, on each backend alone. For each path, also the kernels
    that run when SDPA picks for itself."""
    device = cfg["device"]
    B, T, C = FLASH_BATCH, cfg["block_size"] // 4, cfg["block_size"] // 8
    model = build(cfg, mode, n_layer=FLASH_LAYERS)
    toks = random_tokens(cfg, B, T + C + 1)  # (B, T + C + 1): prompt, chunk, and the shifted training targets

    def train():
        with autocast(device):
            _, loss = model(toks[:, :T], targets=toks[:, 1:T + 1])
        loss.backward()
    res = {"train": attempt(train, "FLASH_ATTENTION")}
    model.zero_grad(set_to_none=True)
    res["train"]["default_kernels"] = default_kernels(train)
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        model.to(torch.bfloat16)  # weights and cache in bf16 for inference, as bench_cache.py measures it

    def after_prompt(n):  # n tokens continuing a fresh cache that holds the prompt (prefilled on SDPA's choice)
        cache = model.new_cache(B, T + C)
        model(toks[:, :T], cache=cache)
        return lambda: model(toks[:, T:T + n], cache=cache)

    def prefill():
        model(toks[:, :T], cache=model.new_cache(B, T))
    with torch.no_grad():
        res["prefill"] = {**attempt(prefill, "FLASH_ATTENTION"), "default_kernels": default_kernels(prefill)}
        res["decode"] = {**attempt(after_prompt(1), "FLASH_ATTENTION"),
                         "default_kernels": default_kernels(after_prompt(1))}
        # The chunk's mask is causal_lower_right; with grouped KV heads (every paper config) the memory-efficient
        # kernel does not apply to it, so CUDA runs it on flash in bf16/fp16 and on math, mask materialised, in fp32.
        res["chunk"] = {"default_kernels": default_kernels(after_prompt(C)),
                        "backends": {b: attempt(after_prompt(C), b) for b in BACKENDS}}
    return res


def flash(cfg, out):
    """Training, prefill and decode must be able to run on flash alone; a chunk after a filled cache (a mask:
    speculative decoding, chunked prefill) is informational: the backends that can run it are listed. Which kernels
    run unrestricted (default_kernels) is recorded, not judged: PyTorch may prefer cuDNN's attention on a GPU."""
    out.update({"batch": FLASH_BATCH, "prompt": cfg["block_size"] // 4, "chunk": cfg["block_size"] // 8,
                "n_layer": FLASH_LAYERS, "modes": {}})
    for mode in MODES:
        out["modes"][mode] = flash_mode(cfg, mode)
        release(cfg["device"])
    out["chunk_runs_on"] = {mode: [b for b, a in r["chunk"]["backends"].items() if a["ok"]]
                            for mode, r in out["modes"].items()}
    out["ok"] = all(r[path]["ok"] for r in out["modes"].values() for path in FLASH_PATHS)


# ----------------------------------------------------------------------------- bench

def bench(cfg, out):
    """bench_cache.py at this shape in its own process (a script is run, never imported; it spawns fresh processes
    for peak memory anyway), its JSON folded in."""
    changed = [f"--{k}={cfg[k]}" for k in MODEL_KEYS if cfg[k] != DEFAULTS[k]]
    args = [f"--preset={PRESET}", *changed, f"--modes={','.join(MODES)}", f"--device={cfg['device']}",
            f"--batch={cfg['bench_batch']}", f"--prompt_len={cfg['prompt_len']}", f"--new_tokens={cfg['new_tokens']}",
            f"--repeats={cfg['repeats']}", "--warmup=1", f"--seed={cfg['seed']}"]
    command = "python bench_cache.py " + " ".join(args)
    out["command"] = command
    print(command, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        proc = subprocess.run([sys.executable, str(ROOT / "bench_cache.py"), *args, f"--json={path}"], cwd=ROOT,
                              capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            out.update(ok=False, error=f"bench_cache.py: {last}")
            return
        res = json.loads(path.read_text())
    measured = ("cache_bytes", "prefill_peak_bytes", "train_peak_bytes", "prefill_s", "decode_s_per_token",
                "train_step_s")
    out.update({"num_params": res["num_params"], **{m: {k: res["modes"][m][k] for k in measured} for m in MODES},
                "value_vs_vanilla": res["modes"]["value"]["ratios"], "bench_cache": res, "ok": True})


# ----------------------------------------------------------------------------- training

def train_run(cfg, mode, compiled) -> dict:
    """A few training steps of `mode` on random tokens. The step mirrors train.py's (train_step, then the
    optimizer): bf16 autocast on CUDA, the loss read back, the global-norm clip, fused AdamW on CUDA. Compiled, also
    what dynamo counted over the run: graph breaks (with their reasons) and graphs compiled (1 when the step's
    forward is one graph that nothing recompiled)."""
    device, B, T = cfg["device"], cfg["micro_batch"], cfg["block_size"]
    release(device)
    counters.clear()  # dynamo's tallies, this run's alone
    model = build(cfg, mode)
    par = Parallel(model, "ddp", False, device, device == "cuda")  # one process: the model itself, as train.py
    fwd = torch.compile(par.forward, backend=cfg["compile_backend"]) if compiled else par.forward
    opt = torch.optim.AdamW(model.parameters(), lr=PAPER["learning_rate"], weight_decay=PAPER["weight_decay"],
                            fused=device == "cuda")
    toks = random_tokens(cfg, B, T + 1)  # (B, T + 1): inputs and the shifted targets

    def step():
        t0 = time.perf_counter()
        with autocast(device):
            _, loss = fwd(toks[:, :-1], toks[:, 1:])
        loss.backward()
        par.clip(PAPER["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the device: the optimizer's kernels were queued before this copy
        return value, time.perf_counter() - t0

    try:
        first_s = step()[1]  # compiles, under train_compile
        for _ in range(cfg["warmup"] - 1):
            step()
        timed = [step() for _ in range(cfg["steps"])]
        breaks = dict(counters["graph_break"])  # reason -> times
        graphs = counters["stats"]["unique_graphs"]
    finally:
        if compiled:
            torch._dynamo.reset()  # drop the compiled graphs: they hold this model's buffers
    step_s = statistics.median(t for _, t in timed)
    peak = torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None
    # memory.py's plan of this eager step (docs/memory.md), traced on the meta device: the GPU checks it
    planned = None if compiled else plan(model.config, B, T, 1, "ddp", False, device == "cuda")["total"] / GiB
    return {"num_params": model.num_params(), "tokens_per_s": B * T / step_s, "step_s": step_s,
            "first_step_s": first_s, "peak_gib": peak, "planned_gib": planned, "loss": timed[-1][0],
            "graph_breaks": sum(breaks.values()) if compiled else None,
            "graph_break_reasons": breaks if compiled else None, "graphs": graphs if compiled else None}


def train(cfg, compiled, out):
    """Vanilla then value, one at a time on the device; value's tokens/s and peak memory as ratios to vanilla's.
    peak_gib: weights, gradients, AdamW's state and the activations (CUDA only; None on the CPU); planned_gib:
    memory.py's plan of the same eager step (None when compiled: the plan is of the eager graph). A graph break
    is recorded, not failed: the figures stand, with the break beside them."""
    out.update({"compile": compiled, "compile_backend": cfg["compile_backend"] if compiled else None,
                "micro_batch": cfg["micro_batch"], "seq_len": cfg["block_size"], "warmup": cfg["warmup"],
                "steps": cfg["steps"], "modes": {}})
    for mode in MODES:
        r = out["modes"][mode] = train_run(cfg, mode, compiled)
        dynamo = f", {r['graph_breaks']} graph breaks, {r['graphs']} graph(s)" if compiled else ""
        print(f"  {mode}: {r['tokens_per_s']:,.0f} tokens/s{dynamo}", flush=True)
        for why, n in (r["graph_break_reasons"] or {}).items():
            print(f"    graph break x{n}: {why}", flush=True)
    van, val = out["modes"]["vanilla"], out["modes"]["value"]
    out["value_vs_vanilla"] = {"tokens_per_s": val["tokens_per_s"] / van["tokens_per_s"],
                               "peak_gib": val["peak_gib"] / van["peak_gib"] if van["peak_gib"] else None}
    out["ok"] = all(r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) for r in out["modes"].values())


# Each section fills the dict it is given as it goes, so a section that fails or is cut off keeps what it finished.
RUN = {"flash": flash, "bench": bench, "train_eager": lambda cfg, out: train(cfg, False, out),
       "train_compile": lambda cfg, out: train(cfg, True, out)}


# ----------------------------------------------------------------------------- report

def kernel_names(ops) -> str:
    """A path's default_kernels in short: the SDPA backends its ops name ("flash+math"); an op naming none, as is."""
    names = [next((k for k in KERNEL_NAMES if k in op), op.removeprefix("aten::")) for op in ops]
    return "+".join(dict.fromkeys(names)) or "none"


def headline(name, sec) -> str:
    """One line of figures per section for the printed summary."""
    if not sec["ok"] and "error" in sec:
        return sec["error"][:160]
    if name == "flash":
        alone = "; ".join(mode + "".join(f" {p} {'ok' if r[p]['ok'] else 'REFUSED'}" for p in FLASH_PATHS)
                          for mode, r in sec["modes"].items())
        chunk = ", ".join(sec["chunk_runs_on"]["value"])
        paths = (*FLASH_PATHS, "chunk")
        picked = "; ".join(mode + ",".join(f" {p} {kernel_names(r[p]['default_kernels'])}" for p in paths)
                           for mode, r in sec["modes"].items())
        return (f"can run on flash alone: {alone}; value's chunk after a filled cache can run on {chunk}; "
                f"unrestricted, SDPA runs: {picked}")
    ratio = sec["value_vs_vanilla"]
    if name == "bench":
        return (f"value/vanilla: prefill {ratio['prefill_s']:.3f}x, decode {ratio['decode_s_per_token']:.3f}x, train "
                f"step {ratio['train_step_s']:.3f}x, prefill peak {ratio['prefill_peak_bytes']:.3f}x, cache "
                f"{ratio['cache_bytes']:.3f}x")
    runs = []
    for mode, r in sec["modes"].items():
        memory = f" {r['peak_gib']:.1f} GiB" if r["peak_gib"] else ""
        memory += f" (plan {r['planned_gib']:.1f})" if memory and r["planned_gib"] else ""
        runs.append(f"{mode} {r['tokens_per_s']:,.0f} tok/s{memory}")
    memory = f", memory {ratio['peak_gib']:.3f}x" if ratio["peak_gib"] else ""
    breaks = ""
    if sec["compile"]:
        breaks = "; graph breaks " + ", ".join(f"{mode} {r['graph_breaks']}" for mode, r in sec["modes"].items())
    return f"{', '.join(runs)}; value/vanilla tokens/s {ratio['tokens_per_s']:.3f}x{memory}{breaks}"


def summary(name, sec) -> str:
    """headline, or why there is none: the JSON is written by then, and the table and exit status must follow."""
    try:
        return headline(name, sec)
    except (KeyError, TypeError, ValueError) as e:
        return f"(no summary: {type(e).__name__}: {reason(e)})"


def header(cfg) -> dict:
    cuda = cfg["device"] == "cuda"
    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_gib": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB if cuda
            else None, "device": cfg["device"], "config": cfg, "cut_off": None, "sections": {}}


class CutOff(BaseException):
    """SIGTERM (an outer `timeout`) in the main thread. Not an Exception, so no handler on the way swallows it."""


def cut_off(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # once: a second signal must not cut off the recording of the first
    raise CutOff(signal.Signals(signum).name)


def main(argv):
    cfg = resolve(argv)
    result = header(cfg)
    print(f"gpu_check: torch {result['torch']} on {result['gpu'] or cfg['device']}; sections {cfg['only']}",
          flush=True)
    sections = cfg["only"].split(",")
    start = time.perf_counter()

    def write():  # the whole result so far; write_atomically renames a finished file, so a kill never leaves half
        result["seconds"] = time.perf_counter() - start
        result["ok"] = all(s["ok"] for s in result["sections"].values()) and not result["cut_off"]
        write_atomically(cfg["json"], json.dumps(result, indent=1))

    cut = None
    before = signal.signal(signal.SIGTERM, cut_off)
    try:
        for name in sections:
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            sec = result["sections"][name] = {}
            try:
                RUN[name](cfg, sec)
            except Exception as e:  # recorded, and the next section runs: a lent GPU's minutes are too few to lose
                traceback.print_exc()
                sec.update(ok=False, error=f"{type(e).__name__}: {reason(e)}")
            release(cfg["device"])
            sec["seconds"] = time.perf_counter() - t0
            write()
            print(f"== {name}: {'ok' if sec['ok'] else 'FAILED'} in {sec['seconds']:.0f} s (total "
                  f"{result['seconds']:.0f} s)", flush=True)
    except CutOff as e:  # the section it cut off keeps what it had finished, marked as cut off
        unfinished = [n for n in sections if "seconds" not in result["sections"].get(n, {})]
        running = result["sections"].get(unfinished[0]) if unfinished else None
        if running is not None:
            running.update(ok=False, error=f"cut off by {e} after {time.perf_counter() - t0:.0f} s",
                           seconds=time.perf_counter() - t0)
        if unfinished:
            cut = result["cut_off"] = f"cut off by {e} in {unfinished[0]}; --only={','.join(unfinished)} runs the rest"
        write()
    finally:
        signal.signal(signal.SIGTERM, before)
    rows = [[name, "ok" if s["ok"] else "FAILED", f"{s['seconds']:.0f}", summary(name, s)]
            for name, s in result["sections"].items()]
    print("\n" + table(rows, ["section", "result", "seconds", "figures"]))
    print(f"wrote {cfg['json']}")
    if cut:
        fail(f"{cut} (with its own --json: {cfg['json']} keeps the sections finished)")
    failed = [name for name, s in result["sections"].items() if not s["ok"]]
    if failed:
        fail(f"section(s) {', '.join(failed)} failed (see {cfg['json']}); fix them and rerun with "
             f"--only={','.join(failed)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
