"""What tests/test_parallel.py asks of 2 gloo ranks, in one torchrun launch (a launch costs seconds,
the checks less):

1. STEPS optimizer steps of every variant (helpers.contract_variants) and of the cases only training
   has, through train.py's own step (train.train_step, train.Parallel), as one process (rank 0)
   and under FSDP: OUT/variants.json, {case: {layout: {"steps": [[loss, grad_norm], ...],
   "grads": {parameter: the first step's clipped gradient}}}};
2. then PLAN.json's train.py runs in order, [name, args, actions]: each `train.py args` through its
   entry point (configurator.run_main), every rank's stdout and stderr in OUT/name.rankR.{out,err},
   the exit statuses in OUT/status.json. The actions, done by rank 0 before the run: ["copy", src,
   dst], ["flip", file] (one bit mid-file), ["remove", file], ["block", path] (a file there).

    torchrun --standalone --nproc_per_node=2 tests/parallel_driver.py OUT PLAN.json
"""
import contextlib
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402
from baselines import build_model, wrap_units  # noqa: E402
from configurator import run_main  # noqa: E402
from helpers import contract_variants  # noqa: E402
from reference import SOURCE_CASES  # noqa: E402

SHAPE = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_kv_head=1, head_dim=8, n_embd=16,
             mlp_hidden=32, init_std=0.1)
VARIANTS = contract_variants(SOURCE_CASES)
CASES = {**VARIANTS,
         "value+ac": dict(VARIANTS["value"], activation_checkpointing=True),
         "mhc+ac": dict(VARIANTS["mhc"], activation_checkpointing=True),
         "kv-looped": dict(depth_mode="kv", n_loops=2),
         "tied": dict(depth_mode="value", tie_embeddings=True)}
CFG = {**{k: key.default for k, key in train.KEYS.items()}, "learning_rate": 3e-2, "grad_clip": 0.5}
STEPS, ROWS, ACCUM = 2, 4, 1  # a global batch of 4 sequences; accumulation is train.py runs'


def run_case(keys, layout, proc):
    keys = dict(keys)
    ac = keys.pop("activation_checkpointing", False)
    torch.manual_seed(0)
    model = build_model({**SHAPE, **keys})
    if ac:
        wrap_units(model)
    par = train.Parallel(model, layout, proc)
    optimizer = train.make_optimizer(model, CFG, "cpu")
    data = torch.randint(0, SHAPE["vocab_size"], (STEPS, ROWS, SHAPE["block_size"] + 1),
                         generator=torch.Generator().manual_seed(1))
    per_rank = ROWS // proc.world
    mb = per_rank // ACCUM
    out = []
    for step in range(STEPS):
        rows = data[step, proc.rank * per_rank:(proc.rank + 1) * per_rank]
        batches = ((rows[m * mb:(m + 1) * mb, :-1], rows[m * mb:(m + 1) * mb, 1:])
                   for m in range(ACCUM))
        loss, norm = train.train_step(par.forward, par, batches, ACCUM, CFG["grad_clip"], proc)
        if step == 0:  # the whole clipped gradient (FSDP: gathered from the shards, every rank)
            grads = {name: (g.full_tensor() if hasattr(g, "full_tensor") else g).tolist()
                     for name, p in model.named_parameters() if (g := p.grad) is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((loss, norm))
    return {"steps": out, "grads": grads}


def act(op, *paths):
    path = Path(paths[0])
    if op == "copy":
        shutil.copytree(path, paths[1])
    elif op == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(data)
    elif op == "remove":
        path.unlink()
    elif op == "block":
        path.write_text("in the way")


def train_py(out, name, args, rank):
    """train.py args as its entry point runs it, this rank's output in files; a bug (a traceback)
    ends the launch at once, rather than leave the other rank waiting in a collective."""
    with open(out / f"{name}.rank{rank}.out", "w") as o, open(out / f"{name}.rank{rank}.err",
                                                              "w") as e:
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            try:
                return run_main(train.main, args)
            except BaseException:
                traceback.print_exc(file=sys.__stderr__)  # into the launch's output
                sys.__stderr__.flush()
                os._exit(1)


def main(out, plan):
    out = Path(out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, keys in CASES.items():  # DDP: train.py's runs (an all-reduce, alike for every model)
        layouts = [("fsdp", train.Process(rank, world, "cpu", False, True))]
        if rank == 0:
            layouts.insert(0, ("single", train.Process(0, 1, "cpu", False, False)))
        results[name] = {layout: run_case(keys, layout, proc) for layout, proc in layouts}
    if rank == 0:
        (out / "variants.json").write_text(json.dumps(results))
    # train.py's runs join this process group: a second init_process_group under torchrun's store
    # does not reliably connect
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None
    status = {}
    for name, args, *actions in json.loads(Path(plan).read_text()):
        for action in actions if rank == 0 else ():
            act(*action)
        dist.barrier()
        status[name] = train_py(out, name, args, rank)
        dist.barrier()
    if rank == 0:
        (out / "status.json").write_text(json.dumps(status))
    dist.barrier()
    torch.distributed.distributed_c10d.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
