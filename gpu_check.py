"""
The GPU check, ready for the few minutes a GPU is lent (docs/gpu_check.md): at the paper's 1.5B shape in bf16,
training throughput and peak memory of vanilla and value, eager and compiled; bench_cache.py's prefill, decode
and cache comparison; and whether training, prefill and decode run on the flash attention kernel. One JSON,
rewritten after every section, so a run cut off by a time limit keeps what it finished.

    python gpu_check.py                                  # one CUDA GPU: planned for ~4 minutes on an H200
    python gpu_check.py --json=out/h200.json             # the result elsewhere (default out/gpu_check.json)
    python gpu_check.py --only=train_compile --steps=3 --json=out/gpu_check_2.json  # rerun what a limit cut off
    python gpu_check.py --device=cpu --n_layer=2 --n_embd=64 ...   # a tiny model on the CPU: tries every path

Sections (--only, run in the order given): flash, bench, train_eager, train_compile. The model keys default to
configs/paper_1p5b_value.py's (the modes are vanilla and value); --key=value changes the shape. Training uses
random tokens, block_size of them per sequence. A section that fails is recorded with its error and the others
still run; the exit status is 1 when any failed.
"""
import gc
import inspect
import json
import math
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
from torch.nn.attention import SDPBackend, sdpa_kernel

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
FLASH_PATHS = ("train", "prefill", "decode")  # each must run on flash alone
BACKENDS = [b for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH") if hasattr(SDPBackend, b)]
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


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


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


def flash_mode(cfg, mode) -> dict:
    """(a) a training forward and backward, (b) a prefill into an empty cache, (c) a one-token decode step, each
    on flash alone; (d) a chunk continuing a filled cache, on each backend alone."""
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
    if device == "cuda":
        model.to(torch.bfloat16)  # weights and cache in bf16 for inference, as bench_cache.py measures it

    def filled():  # a cache holding the prompt, prefilled on whatever backend SDPA picks
        cache = model.new_cache(B, T + C)
        model(toks[:, :T], cache=cache)
        return cache
    with torch.no_grad():
        res["prefill"] = attempt(lambda: model(toks[:, :T], cache=model.new_cache(B, T)), "FLASH_ATTENTION")
        cache = filled()
        res["decode"] = attempt(lambda: model(toks[:, T:T + 1], cache=cache), "FLASH_ATTENTION")
        res["chunk"] = {}
        for backend in BACKENDS:
            cache = filled()
            res["chunk"][backend] = attempt(lambda: model(toks[:, T:T + C], cache=cache), backend)
    return res


def flash(cfg) -> dict:
    """Training, prefill and decode must run on flash alone; a chunk after a filled cache (a mask: speculative
    decoding, chunked prefill) is informational: the backends that run it are listed."""
    out = {"batch": FLASH_BATCH, "prompt": cfg["block_size"] // 4, "chunk": cfg["block_size"] // 8,
           "n_layer": FLASH_LAYERS, "modes": {}}
    for mode in MODES:
        out["modes"][mode] = flash_mode(cfg, mode)
        release(cfg["device"])
    out["ok"] = all(r[path]["ok"] for r in out["modes"].values() for path in FLASH_PATHS)
    out["chunk_runs_on"] = {mode: [b for b, a in r["chunk"].items() if a["ok"]] for mode, r in out["modes"].items()}
    return out


# ----------------------------------------------------------------------------- bench

def bench(cfg) -> dict:
    """bench_cache.py at this shape in its own process (a script is run, never imported; it spawns fresh processes
    for peak memory anyway), its JSON folded in."""
    changed = [f"--{k}={cfg[k]}" for k in MODEL_KEYS if cfg[k] != DEFAULTS[k]]
    args = [f"--preset={PRESET}", *changed, f"--modes={','.join(MODES)}", f"--device={cfg['device']}",
            f"--batch={cfg['bench_batch']}", f"--prompt_len={cfg['prompt_len']}", f"--new_tokens={cfg['new_tokens']}",
            f"--repeats={cfg['repeats']}", "--warmup=1", f"--seed={cfg['seed']}"]
    command = "python bench_cache.py " + " ".join(args)
    print(command, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        proc = subprocess.run([sys.executable, str(ROOT / "bench_cache.py"), *args, f"--json={path}"], cwd=ROOT,
                              capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            return {"ok": False, "command": command, "error": f"bench_cache.py: {last}"}
        res = json.loads(path.read_text())
    measured = ("cache_bytes", "prefill_peak_bytes", "train_peak_bytes", "prefill_s", "decode_s_per_token",
                "train_step_s")
    return {"ok": True, "command": command, "num_params": res["num_params"],
            **{mode: {m: res["modes"][mode][m] for m in measured} for mode in MODES},
            "value_vs_vanilla": res["modes"]["value"]["ratios"], "bench_cache": res}


# ----------------------------------------------------------------------------- training

def train_run(cfg, mode, compiled) -> dict:
    """A few training steps of `mode` on random tokens. The step mirrors train.py's (train_step, then the
    optimizer): bf16 autocast on CUDA, the loss read back, the global-norm clip, fused AdamW on CUDA."""
    device, B, T = cfg["device"], cfg["micro_batch"], cfg["block_size"]
    release(device)
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
        value = loss.item()
        sync(device)
        return value, time.perf_counter() - t0

    try:
        first_s = step()[1]  # compiles, under train_compile
        for _ in range(cfg["warmup"] - 1):
            step()
        timed = [step() for _ in range(cfg["steps"])]
    finally:
        if compiled:
            torch._dynamo.reset()  # drop the compiled graphs: they hold this model's buffers
    step_s = statistics.median(t for _, t in timed)
    peak = torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None
    # memory.py's plan of this eager step (docs/memory.md), traced on the meta device: the GPU checks it
    planned = None if compiled else plan(model.config, B, T, 1, "ddp", False, device == "cuda")["total"] / GiB
    return {"num_params": model.num_params(), "tokens_per_s": B * T / step_s, "step_s": step_s,
            "first_step_s": first_s, "peak_gib": peak, "planned_gib": planned, "loss": timed[-1][0]}


def train(cfg, compiled) -> dict:
    """Vanilla then value, one at a time on the device; value's tokens/s and peak memory as ratios to vanilla's.
    peak_gib: weights, gradients, AdamW's state and the activations (CUDA only; None on the CPU); planned_gib:
    memory.py's plan of the same eager step (None when compiled: the plan is of the eager graph)."""
    out = {"compile": compiled, "compile_backend": cfg["compile_backend"] if compiled else None,
           "micro_batch": cfg["micro_batch"], "seq_len": cfg["block_size"], "warmup": cfg["warmup"],
           "steps": cfg["steps"], "modes": {}}
    for mode in MODES:
        out["modes"][mode] = train_run(cfg, mode, compiled)
        print(f"  {mode}: {out['modes'][mode]['tokens_per_s']:,.0f} tokens/s", flush=True)
    van, val = out["modes"]["vanilla"], out["modes"]["value"]
    out["value_vs_vanilla"] = {"tokens_per_s": val["tokens_per_s"] / van["tokens_per_s"],
                               "peak_gib": val["peak_gib"] / van["peak_gib"] if van["peak_gib"] else None}
    out["ok"] = all(r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) for r in out["modes"].values())
    return out


RUN = {"flash": flash, "bench": bench, "train_eager": lambda cfg: train(cfg, False),
       "train_compile": lambda cfg: train(cfg, True)}


# ----------------------------------------------------------------------------- report

def headline(name, sec) -> str:
    """One line of figures per section for the printed summary."""
    if not sec["ok"] and "error" in sec:
        return sec["error"][:160]
    if name == "flash":
        paths = "; ".join(mode + "".join(f" {p} {'ok' if r[p]['ok'] else 'REFUSED'}" for p in FLASH_PATHS)
                          for mode, r in sec["modes"].items())
        chunk = ", ".join(sec["chunk_runs_on"]["value"])
        return f"on flash alone: {paths}; value's chunk after a filled cache runs on {chunk}"
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
    return f"{', '.join(runs)}; value/vanilla tokens/s {ratio['tokens_per_s']:.3f}x{memory}"


def header(cfg) -> dict:
    cuda = cfg["device"] == "cuda"
    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_gib": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB if cuda
            else None, "device": cfg["device"], "config": cfg, "sections": {}}


def main(argv):
    cfg = resolve(argv)
    result = header(cfg)
    print(f"gpu_check: torch {result['torch']} on {result['gpu'] or cfg['device']}; sections {cfg['only']}",
          flush=True)
    start = time.perf_counter()
    for name in cfg["only"].split(","):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            sec = RUN[name](cfg)
        except Exception as e:  # recorded, and the next section runs: a lent GPU's minutes are too few to lose
            traceback.print_exc()
            sec = {"ok": False, "error": f"{type(e).__name__}: {reason(e)}"}
        release(cfg["device"])
        sec["seconds"] = time.perf_counter() - t0
        result["sections"][name] = sec
        result["seconds"] = time.perf_counter() - start
        result["ok"] = all(s["ok"] for s in result["sections"].values())
        write_atomically(cfg["json"], json.dumps(result, indent=1))
        print(f"== {name}: {'ok' if sec['ok'] else 'FAILED'} in {sec['seconds']:.0f} s (total "
              f"{result['seconds']:.0f} s)", flush=True)
    rows = [[name, "ok" if s["ok"] else "FAILED", f"{s['seconds']:.0f}", headline(name, s)]
            for name, s in result["sections"].items()]
    print("\n" + table(rows, ["section", "result", "seconds", "figures"]))
    print(f"wrote {cfg['json']}")
    failed = [name for name, s in result["sections"].items() if not s["ok"]]
    if failed:
        fail(f"section(s) {', '.join(failed)} failed (see {cfg['json']}); fix them and rerun with "
             f"--only={','.join(failed)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
