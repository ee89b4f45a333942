"""
Multi-query associative recall (MQAR): does Keyless Attention learn it, with one head and with
several? A sequence lists `pairs` key-value pairs, k1 v1 k2 v2 ..., then asks every key again in a
shuffled order; the target at each query is the paired value, every other target -1 (no loss). A
run without the induction circuit sits near 0.2: a value of its sequence, not the paired one.

    python lab/recall.py --steps=1000 --heads=1,4 --seeds=0,1 --json=out/recall.json

trains vanilla, value, keyless and keyless+value on the same batches per seed, 2 layers of width 64
(MHA), on one CPU core (~35 s a run), and prints markdown tables of the final query accuracy on 256
held-out sequences and of the first step (evaluated every 50) at which each seed reached 0.9.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: the core
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import json
import time

import torch

from baselines import build_model
from configurator import ConfigError, Key, parse, run_main
from outputs import mark, output_file, write_atomically

VARIANTS = {"vanilla": ("vanilla", "standard"), "value": ("value", "standard"),
            "keyless": ("vanilla", "keyless"), "keyless+value": ("value", "keyless")}
WIDTH, EVAL_SEQS, EVAL_EVERY, SOLVED = 64, 256, 50, 0.9  # SOLVED: the tables' "first step"
EVAL_SEED = 2**40  # one held-out set for every run, apart from the training seeds' streams
SCRIPT = "support/recall.py"  # the mark of its results, as before the move: still replaceable
KEYS = {"steps": Key(1000, "training steps of every run", ">= 1"),
        "heads": Key("1,4", "head counts (heads x head_dim = 64)"),
        "seeds": Key("0,1", "seeds: init and batches, shared by the variants"),
        "lr": Key(1e-3, "peak learning rate", "> 0"),
        "warmup": Key(200, "steps of linear warmup, then constant", ">= 0"),
        "batch_size": Key(64, "sequences per step", ">= 1"),
        "pairs": Key(8, "key-value pairs per sequence (distinct keys)", ">= 1"),
        "n_keys": Key(32, "key tokens", ">= 1"), "n_values": Key(32, "value tokens", ">= 1"),
        "json": Key("", "also write the results here")}


def recall_batch(batch, pairs, n_keys, n_values, generator):
    """(idx, targets), each (batch, 3 * pairs): the pairs, then every key again in a new order."""
    keys = torch.rand(batch, n_keys, generator=generator).argsort(1)[:, :pairs]  # distinct keys
    values = torch.randint(n_values, (batch, pairs), generator=generator) + n_keys
    order = torch.rand(batch, pairs, generator=generator).argsort(1)
    idx = torch.cat([torch.stack([keys, values], 2).flatten(1), keys.gather(1, order)], 1)
    targets = torch.cat([torch.full((batch, 2 * pairs), -1), values.gather(1, order)], 1)
    return idx, targets


def train(variant, heads, seed, a, held_out):
    """One run: {"accuracy": final, "solved_at": first evaluated step >= SOLVED or None}."""
    depth_mode, attention = VARIANTS[variant]
    torch.manual_seed(seed)  # the init; the batches have their own generator, every variant's
    model = build_model(dict(
        vocab_size=a["n_keys"] + a["n_values"], block_size=3 * a["pairs"], n_layer=2,
        n_head=heads, n_kv_head=heads, head_dim=WIDTH // heads, n_embd=WIDTH,
        mlp_hidden=2 * WIDTH, depth_mode=depth_mode, attention=attention, depth_stride=None))
    params = list(model.parameters())  # train.py's groups: decay on matrices only
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]}, {
        "params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], weight_decay=0.1,
        betas=(0.9, 0.95))
    (idx, targets), data, solved_at = held_out, torch.Generator().manual_seed(seed), None
    for step in range(1, a["steps"] + 1):
        # a long warmup: a fast start leaves every variant on the plateau of "some value of
        # this sequence" (loss ~ln(pairs)) for far longer than these runs
        for group in optimizer.param_groups:
            group["lr"] = a["lr"] * min(1.0, step / max(1, a["warmup"]))
        _, loss = model(*recall_batch(a["batch_size"], a["pairs"], a["n_keys"], a["n_values"],
                                      data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % EVAL_EVERY == 0 or step == a["steps"]:  # greedy, over the query positions
            with torch.no_grad():
                acc = (model(idx)[0].argmax(-1) == targets)[targets >= 0].float().mean().item()
            solved_at = solved_at or (step if acc >= SOLVED else None)
    return {"accuracy": acc, "solved_at": solved_at}


def numbers(a, key) -> list:
    found = [x.strip() for x in a[key].split(",") if x.strip()]
    if not found or not all(x.isdecimal() for x in found):
        raise ConfigError(f"--{key}={a[key]}: give comma-separated integers >= 0, e.g. --{key}=0,1")
    return list(dict.fromkeys(map(int, found)))


def main(argv):
    a = parse(argv, KEYS, __doc__)
    a["heads"], a["seeds"] = numbers(a, "heads"), numbers(a, "seeds")
    if bad := [h for h in a["heads"] if not h or WIDTH % h or (WIDTH // h) % 2]:
        raise ConfigError(f"--heads={bad[0]}: heads must divide {WIDTH} with an even head_dim")
    if a["pairs"] > a["n_keys"]:
        raise ConfigError(f"--pairs={a['pairs']} needs as many keys; --n_keys is {a['n_keys']}")
    out = output_file(a["json"], "--json", SCRIPT) if a["json"] else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # width 64 gains nothing from more; the timing is one core's
    try:
        held_out = recall_batch(EVAL_SEQS, a["pairs"], a["n_keys"], a["n_values"],
                                torch.Generator().manual_seed(EVAL_SEED))
        runs, start = {}, time.time()
        for job in [(v, h, s) for h in a["heads"] for v in VARIANTS for s in a["seeds"]]:
            run = runs[job] = train(*job, a, held_out)
            print("{}, heads {}, seed {}: ".format(*job) + f"accuracy {run['accuracy']:.3f}, "
                  f"solved at {run['solved_at']} ({time.time() - start:.0f} s)", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)
    for key, title in ("accuracy", "final query accuracy"), ("solved_at", "first step >= 0.9"):
        print(f"\n{title}, {a['steps']} steps, seeds {'/'.join(map(str, a['seeds']))}:\n")
        print("| variant | " + " | ".join(f"{h} head{'s' * (h > 1)}" for h in a["heads"]) + " |")
        print("| --- |" + " --- |" * len(a["heads"]))
        for variant in VARIANTS:
            got = [[runs[variant, h, s][key] for s in a["seeds"]] for h in a["heads"]]
            cells = [f"{sum(g) / len(g):.3f} ({' / '.join(f'{x:.3f}' for x in g)})"
                     if key == "accuracy" else " / ".join("-" if x is None else str(x) for x in g)
                     for g in got]
            print(f"| {variant} | " + " | ".join(cells) + " |")
    if out:
        write_atomically(out, json.dumps({"written_by": mark(SCRIPT), "config": a, "runs": [
            {"variant": v, "heads": h, "seed": s, **r} for (v, h, s), r in runs.items()]},
            indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(run_main(main))
