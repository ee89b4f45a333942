"""A few training steps of several tiny models through train.py's own step (train_step,
parallel.Parallel), as one process or under torchrun with --parallel=ddp|fsdp, writing {case:
{"steps": [(loss, grad_norm), ...], "grads": {parameter: the first step's gradient}}} as JSON.
tests/test_parallel.py runs it both ways and compares: one torchrun launch covers every case.

    python tests/parallel_driver.py OUT.json single
    torchrun --standalone --nproc_per_node=2 tests/parallel_driver.py OUT.json fsdp
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.variants import build_model, make_config  # noqa: E402
from support.parallel import Parallel, Process, checkpoint_activations  # noqa: E402
from support.run_config import DEFAULTS  # noqa: E402
import train  # noqa: E402
from helpers import contract_variants  # noqa: E402
from reference import SOURCE_CASES  # noqa: E402

SHAPE = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_kv_head=1, head_dim=8, n_embd=16,
             mlp_hidden=32, init_std=0.1)
# Every variant the contract holds (helpers.contract_variants, tests/test_contract.py's VARIANTS:
# the rows, the source rules, a looped model, the baselines, so a fork's too), and the cases only
# training has.
VARIANTS = contract_variants(SOURCE_CASES)
CASES = {**VARIANTS,
         "value+ac": dict(VARIANTS["value"], activation_checkpointing=True),
         "kv-looped": dict(depth_mode="kv", n_loops=2),
         "tied": dict(depth_mode="value", tie_embeddings=True),
         "mhc+ac": dict(VARIANTS["mhc"], activation_checkpointing=True)}
CFG = {**DEFAULTS, "learning_rate": 3e-2, "grad_clip": 0.5}
STEPS, ROWS, ACCUM = 3, 8, 2  # a global batch of 8 sequences, 2 micro-steps on every rank


def run_case(keys, mode, proc):
    keys = dict(keys)
    ac = keys.pop("activation_checkpointing", False)
    torch.manual_seed(0)
    model = build_model(make_config(**{**SHAPE, **keys}))
    if ac:
        checkpoint_activations(model)
    par = Parallel(model, mode, proc.distributed, "cpu", False)
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
        if step == 0:  # the whole clipped gradient (FSDP: gathered from the shards, by every rank)
            grads = {name: (p.grad.full_tensor() if hasattr(p.grad,
                                                            "full_tensor") else p.grad).tolist()
                     for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((loss, norm))
    return {"steps": out, "grads": grads}


def main(out_path, mode):
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    proc = Process(rank, world, "cpu", False, distributed)
    results = {name: run_case(keys, mode, proc) for name, keys in CASES.items()}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
