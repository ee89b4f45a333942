"""
Multi-query associative recall (MQAR): does Keyless Attention learn it, with one head and with
several? A sequence lists `pairs` key-value pairs, k1 v1 k2 v2 ..., with distinct keys drawn from
the first n_keys tokens and values from the next n_values, then asks every key again in a shuffled
order; the target at each query is the value paired with that key, every other target -1 (no
loss). Two layers solve it with an induction circuit: the first copies each key into its value's
position, the second matches the query there and reads the value. A run that has not found it
sits near 0.2, a value of its sequence but not the paired one (loss ~ln(pairs)).

    python -m experiments.recall --steps=1000 --heads=1,4 --seeds=0,1 --json=out/recall.json

trains vanilla, value (Depth-Attention), keyless and keyless+value (baselines.py's Keyless
Attention, alone and with the depth step) for the same steps on the same batches from each seed,
2 layers of width 64 (head_dim = 64 / heads, MHA), AdamW on the CPU, and prints markdown tables of
the final query accuracy (greedy over the whole vocabulary, on 256 held-out sequences) per variant
and head count, mean and each seed, and of the first step (evaluated every 50) at which each seed
reached 0.9. The default (two seeds) takes about 9 minutes on one core of a busy 2-core
machine, about 35 s a run.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import json
import sys
import time

import torch

from support.variants import build_model, make_config
from support.argparser import ArgumentParser
from support.cli import check_ranges
from support.atomic import write_atomically
from support.outputs import mark, output_file
from support.errors import ConfigError, run_main

VARIANTS = {"vanilla": ("vanilla", "standard"), "value": ("value", "standard"),
            "keyless": ("vanilla", "keyless"), "keyless+value": ("value", "keyless")}
WIDTH, EVAL_SEQS, EVAL_EVERY, SOLVED = 64, 256, 50, 0.9
EVAL_SEED = 2**40  # one held-out set for every run, drawn apart from the training seeds' streams
KEY_RANGES = {"steps": ">= 1", "lr": "> 0", "warmup": ">= 0", "batch_size": ">= 1",
              "pairs": ">= 1", "n_keys": ">= 1", "n_values": ">= 1"}


def recall_batch(batch, pairs, n_keys, n_values, generator):
    """(idx, targets), each (batch, 3 * pairs): the pairs, then every key again in a new order;
    keys are tokens [0, n_keys), values [n_keys, n_keys + n_values)."""
    keys = torch.rand(batch, n_keys, generator=generator).argsort(1)[:, :pairs]  # distinct keys
    values = torch.randint(n_values, (batch, pairs), generator=generator) + n_keys
    order = torch.rand(batch, pairs, generator=generator).argsort(1)
    idx = torch.cat([torch.stack([keys, values], 2).flatten(1), keys.gather(1, order)], 1)
    targets = torch.cat([torch.full((batch, 2 * pairs), -1), values.gather(1, order)], 1)
    return idx, targets


def accuracy(model, idx, targets) -> float:
    """The share of query positions whose most likely next token is the paired value."""
    with torch.no_grad():
        logits, _ = model(idx)
    asked = targets >= 0
    return (logits.argmax(-1)[asked] == targets[asked]).float().mean().item()


def train(variant, heads, seed, args, held_out):
    """One run: {"accuracy": final, "solved_at": first evaluated step >= SOLVED or None}."""
    depth_mode, attention = VARIANTS[variant]
    torch.manual_seed(seed)  # the init; the batches come from their own generator, the same
    model = build_model(make_config(  # for every variant of this seed
        vocab_size=args.n_keys + args.n_values, block_size=3 * args.pairs, n_layer=2,
        n_head=heads, n_kv_head=heads, head_dim=WIDTH // heads, n_embd=WIDTH,
        mlp_hidden=2 * WIDTH, depth_mode=depth_mode, attention=attention, depth_stride=None))
    params = list(model.parameters())  # train.py's groups: decay on matrices only
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                   {"params": [p for p in params if p.dim() < 2],
                                    "weight_decay": 0.0}], weight_decay=0.1, betas=(0.9, 0.95))
    data = torch.Generator().manual_seed(seed)
    solved_at = None
    for step in range(1, args.steps + 1):
        # a long warmup, then constant: a fast start leaves every variant on the plateau of
        # "some value of this sequence" (loss ~ln(pairs)) for far longer than these runs
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
        _, loss = model(*recall_batch(args.batch_size, args.pairs, args.n_keys, args.n_values,
                                      data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % EVAL_EVERY == 0 or step == args.steps:
            acc = accuracy(model, *held_out)
            solved_at = solved_at or (step if acc >= SOLVED else None)
    return {"accuracy": acc, "solved_at": solved_at}


def numbers(text, flag) -> list:
    try:
        found = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        found = []
    if not found or min(found) < 0:
        raise ConfigError(f"{flag}={text}: give comma-separated integers >= 0, e.g. {flag}=0,1")
    return list(dict.fromkeys(found))


def parse_args(argv):
    p = ArgumentParser("-m support.recall", description=__doc__.strip().split("\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="training steps of every run")
    p.add_argument("--heads", default="1,4", help="head counts (heads x head_dim = 64)")
    p.add_argument("--seeds", default="0,1", help="seeds: init and batches, shared by variants")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200, help="steps of linear warmup")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs per sequence")
    p.add_argument("--n_keys", type=int, default=32)
    p.add_argument("--n_values", type=int, default=32)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    check_ranges(vars(args), KEY_RANGES)
    args.heads, args.seeds = numbers(args.heads, "--heads"), numbers(args.seeds, "--seeds")
    bad = [h for h in args.heads if not h or WIDTH % h or (WIDTH // h) % 2]
    if bad:
        raise ConfigError(f"--heads={bad[0]}: heads must divide {WIDTH} with an even head_dim")
    if args.pairs > args.n_keys:
        raise ConfigError(f"--pairs={args.pairs} needs as many distinct keys; --n_keys is "
                          f"{args.n_keys}")
    return args


def main(argv):
    args = parse_args(argv)
    out = output_file(args.json, "--json", written_by="support/recall.py") if args.json else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices of width 64 gain nothing from more; the timing is 1 core's
    try:
        held_out = recall_batch(EVAL_SEQS, args.pairs, args.n_keys, args.n_values,
                                torch.Generator().manual_seed(EVAL_SEED))
        runs, start = {}, time.time()
        for heads in args.heads:
            for variant in VARIANTS:
                for seed in args.seeds:
                    run = runs[variant, heads, seed] = train(variant, heads, seed, args, held_out)
                    print(f"{variant}, heads {heads}, seed {seed}: accuracy {run['accuracy']:.3f}"
                          f", >= {SOLVED} at step {run['solved_at']} ({time.time() - start:.0f} s)",
                          file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    for key, title in (("accuracy", "final query accuracy"), ("solved_at", f"first step >= "
                                                                             f"{SOLVED}")):
        print(f"\n{title}, {args.steps} steps, seeds {'/'.join(map(str, args.seeds))}:\n")
        print("| variant | " + " | ".join(f"{h} head{'s' * (h > 1)}" for h in args.heads) + " |")
        print("| --- |" + " --- |" * len(args.heads))
        for variant in VARIANTS:
            cells = []
            for heads in args.heads:
                got = [runs[variant, heads, s][key] for s in args.seeds]
                each = " / ".join("-" if g is None else f"{g:.3f}" if key == "accuracy" else
                                  str(g) for g in got)
                cells.append(f"{sum(got) / len(got):.3f} ({each})" if key == "accuracy" else each)
            print(f"| {variant} | " + " | ".join(cells) + " |")
    if out:
        write_atomically(out, json.dumps({
            "written_by": mark("support/recall.py"), "config": vars(args),
            "runs": [{"variant": v, "heads": h, "seed": s, **r} for (v, h, s), r in runs.items()],
        }, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(run_main(main))
