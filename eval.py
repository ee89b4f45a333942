"""
Score a trained model the way the paper does (Table 1, section 3.1): accuracy on eight downstream tasks through
lm-evaluation-harness (`pip install lm-eval`), zero-shot or five-shot, and validation perplexity.

    python eval.py --init_from=out/RUN                          # the paper's eight tasks, zero-shot
    python eval.py --init_from=out/RUN --num_fewshot=5 --json=out/RUN/eval_5shot.json
    python eval.py --init_from=out/RUN --tasks= --ppl=pile      # perplexity of data/pile/val.bin only
    python eval.py --init_from=zeng123/Depth-attention-3B       # a Hugging Face folder or hub id
    python eval.py --init_from=out/RUN --include_path=my_tasks --tasks=my_task   # task YAMLs on disk
    python eval.py --init_from=out/RUN --tasks='arc_*'          # a glob: every task whose name matches

The model is an lm-eval language model here (`EvalLM`): lm-eval builds the prompts, asks for
log-likelihoods or generations and computes the metrics; this file only turns text into token
scores. Inputs longer than the context are left-truncated, as lm-eval's Hugging Face models do. Task
data downloads from the Hugging Face Hub on first use (then cached). Where the Hub does not answer a
3 s probe, or HF_DATASETS_OFFLINE=1 is set, the tasks read the datasets cache alone, and those not
in it are named in one error at once. Tasks on local files (--include_path) need no network; their
relative data_files are read from the task file's folder, so they run from any folder.

Bad input stops with one `error:` line: the flags, the --json path and the --ppl data are checked first,
then lm-eval builds the tasks (reading their files and data) and what it raises is one line too, then the
model is loaded and the --ppl data checked against its tokenizer; only then does scoring start. A failure
in this file's code, even one lm-eval called, is a bug and a traceback.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from model import fp32_or_wider
from support import paper
from support.checkpoint import check_source, load_model
from support.argparser import ArgumentParser, path
from support.cli import MissingPackage, check_ranges, resolve_device
from support.atomic import write_atomically
from support.outputs import mark, output_file
from support.data import NotPrepared, load_meta, read_tokens
from support.errors import ConfigError, DataError, run_main
from support.eval_tasks import build_tasks, lm_eval_says, ours
from support.tokenizer import get_tokenizer, same_tokenizer, tokenizer_flag

try:  # optional: only the downstream tasks need it; --ppl works without
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import (get_rolling_token_windows, handle_non_serializable,
                               make_disjoint_window)
except ImportError:
    lm_eval, TemplateLM = None, object

# lm-evaluation-harness names of the paper's tasks: LAMBADA, PIQA, WinoGrande, SciQ, HellaSwag,
# ARC-Easy, ARC-Challenge, RACE (Table 1).
PAPER_TASKS = ("lambada_openai", "piqa", "winogrande", "sciq", "hellaswag", "arc_easy",
               "arc_challenge", "race")
KEY_RANGES = {"batch_size": ">= 1", "num_fewshot": ">= 0", "limit": "> 0"}


@torch.no_grad()
def token_logprobs(model, rows, batch_size, pad_id, progress=False):
    """Score token lists of 2 .. block_size + 1 ids: for each row, (log p(row[t] | row[:t]), row[t]
    is the argmax) for t = 1 .. len - 1, as two 1-D CPU tensors, in the order given.

    Rows are sorted longest first and batched by right-padding: the model has no padding mask, but
    attention is causal, so the padding after a row's last real token changes none of its logits;
    only real positions are read."""
    device = model.lm_head.weight.device
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out = [None] * len(rows)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="scoring"):
        batch = order[start:start + batch_size]
        x = pad_sequence([torch.tensor(rows[i][:-1]) for i in batch], batch_first=True,
                         padding_value=pad_id)                             # (B, longest input)
        logits, _ = model(x.to(device))                                           # (B, T, vocab)
        for b, i in enumerate(batch):
            y = torch.tensor(rows[i][1:], device=device)
            row_logits = fp32_or_wider(logits[b, :len(y)])                       # (len(y), vocab)
            out[i] = (-F.cross_entropy(row_logits, y, reduction="none").cpu(),
                      (row_logits.argmax(-1) == y).cpu())
    return out


class EvalLM(TemplateLM):
    """Our model as an lm-eval language model. lm-eval's TemplateLM tokenizes (context,
    continuation) pairs and hands us token ids; every score comes from `token_logprobs`."""

    def __init__(self, model, tokenizer, batch_size):
        super().__init__()
        self.model, self.enc, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.config.block_size

    # The tokenizer's one interface here: encode(text, allowed_special=...), decode(ids), eot_token.
    @property
    @ours
    def eot_token_id(self):
        return self.enc.eot_token

    @ours
    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.enc.encode(string, allowed_special="all")

    @ours
    def tok_decode(self, ids):
        return self.enc.decode(ids)

    @ours
    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        """requests: (strings, context ids, continuation ids). Returns (log p(continuation |
        context), whether greedy decoding gives the continuation) per request. Context +
        continuation is cut to its last block_size + 1 tokens, exactly lm-eval's Hugging Face rule;
        the continuation must fit whole."""
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:  # no truncation is right: refuse the task
                raise ConfigError(f"a task's answer of {len(continuation)} tokens does not fit "
                                  f"the model's context of {self.max_length} tokens (block_size); "
                                  f"leave that task out of --tasks")
            rows.append((context + continuation)[-(self.max_length + 1):])
        scored = token_logprobs(self.model, rows, self.batch_size, self.eot_token_id,
                                progress=not disable_tqdm)
        return [(logp[-len(cont):].sum().item(), bool(greedy[-len(cont):].all()))
                for (_, _, cont), (logp, greedy) in zip(requests, scored)]

    @ours
    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """The log-likelihood of each whole document (perplexity tasks), in lm-eval's rolling
        windows of block_size tokens: every token is predicted once, the first one after the
        end-of-text token."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logp
        return totals

    @ours
    def generate_until(self, requests, disable_tqdm=False):
        """Greedy (or, with do_sample, sampled) continuations through model.generate and its KV
        cache, cut at the first stop string or end-of-text. The prompt is left-truncated to leave
        room for max_gen_toks."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = (([until] if isinstance(until, str) else list(until))
                     + [self.tok_decode([self.eot_token_id])])
            new = min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1)
            temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
            ids = self.tok_encode(context)[-(self.max_length - new):] or [self.prefix_token_id]
            idx = torch.tensor([ids], device=self.model.lm_head.weight.device)  # (1, prompt tokens)
            text = self.tok_decode(
                self.model.generate(idx, new, temperature=temperature)[0, len(ids):].tolist())
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


# -------------------------------------------------------------------------- perplexity of a val.bin

def open_ppl_data(data_root, name):
    """(folder, meta.json, val.bin memory-mapped) of the --ppl dataset, checked before loading."""
    data_dir = Path(data_root) / name
    try:
        meta = load_meta(data_dir)  # meta.json, and the .bin sizes it promises
    except NotPrepared as e:
        raise NotPrepared(f"{e}; or set --data_root to the folder that holds {name}/") from e
    val = read_tokens(data_dir, "val", meta)
    if len(val) < 2:  # one input, one target
        raise DataError(f"{data_dir / 'val.bin'} holds fewer than 2 tokens: rebuild {data_dir} "
                        f"with prepare_data.py --force")
    return data_dir, meta, val


def check_ppl_data(data, loaded, init_from):
    """--ppl data this model can score: in its tokenizer (else the perplexity measures nothing) and
    with no id beyond its vocabulary (else the embedding raises an IndexError, or a device-side
    assert on CUDA)."""
    data_dir, meta, tokens = data
    vocab = loaded.model.config.vocab_size
    data_enc = get_tokenizer(meta["tokenizer"])  # a DataError if its folder is gone
    if meta["vocab_size"] > vocab or not same_tokenizer(data_enc, loaded.tokenizer):
        raise DataError(f"{data_dir} was tokenized with {meta['tokenizer']}, but {init_from} uses "
                        f"{loaded.tokenizer.name}, so its perplexity would mean nothing; prepare "
                        f"the data with the model's tokenizer (prepare_data.py SOURCE "
                        f"{tokenizer_flag(loaded.tokenizer, init_from)} --name NAME)")
    top = int(tokens.max())
    if top >= vocab:
        raise DataError(f"{data_dir / 'val.bin'} holds token id {top}, beyond the model's "
                        f"vocab_size {vocab}: the file does not match its meta.json; rebuild it "
                        f"with prepare_data.py --force")


def perplexity(model, data, batch_size, pad_id, limit=None):
    """exp(mean NLL) over val.bin in non-overlapping windows of block_size predicted tokens: every
    token after the first is predicted once, window w from the tokens of window w alone (its first
    input is the previous window's last target). The paper's Pile validation perplexity when the
    data is the Pile (Table 1). data: open_ppl_data's (folder, meta.json, val.bin memory-mapped)."""
    data_dir, _, tokens = data
    T = model.config.block_size
    starts = range(0, len(tokens) - 1, T)
    if limit is not None:
        starts = starts[:int(limit) if limit >= 1 else math.ceil(limit * len(starts))]
    nll, count = 0.0, 0
    for s in tqdm(range(0, len(starts), batch_size), desc=f"perplexity of {data_dir / 'val.bin'}"):
        rows = [tokens[i:i + T + 1].astype(np.int64).tolist() for i in starts[s:s + batch_size]]
        for logp, _ in token_logprobs(model, rows, batch_size, pad_id):
            nll, count = nll - logp.double().sum().item(), count + len(logp)
    return {"dataset": str(data_dir), "windows": len(starts), "tokens": count, "nll": nll / count,
            "ppl": math.exp(nll / count)}


def print_table(results, num_fewshot, limited):
    """acc and acc_norm per task (x100, as in the paper), two averages, and Table 1 beside."""
    rows = {t: m for t, m in results.get("results", {}).items()
            if t not in results.get("groups", {})}
    if rows:
        print(f"\n{'task':<20}{'acc':>8}{'acc_norm':>10}  other metrics ({num_fewshot}-shot)")
    accs, norm_or_acc = [], []
    for task, m in rows.items():
        acc, norm = m.get("acc,none"), m.get("acc_norm,none")
        other = ", ".join(f"{k.split(',')[0]} {v:.4g}" for k, v in m.items() if k.endswith(",none")
                          and "stderr" not in k and k.split(",")[0] not in ("acc", "acc_norm"))
        print(f"{task:<20}{'-' if acc is None else f'{100 * acc:.2f}':>8}"
              f"{'-' if norm is None else f'{100 * norm:.2f}':>10}  {other}")
        if acc is not None:
            accs.append(100 * acc)
            norm_or_acc.append(100 * (norm if norm is not None else acc))
    if accs:
        print(f"{'average, acc':<20}{sum(accs) / len(accs):>8.2f}{'':>10}  over {len(accs)} tasks")
        mean = sum(norm_or_acc) / len(norm_or_acc)
        print(f"{'average, acc_norm':<20}{'':>8}{mean:>10.2f}  acc_norm where a task has it, "
              f"else acc (the paper does not say which it averages)")
        if sorted(rows) == sorted(PAPER_TASKS) and num_fewshot in paper.TABLE1_AVG:
            print(f"paper, Table 1, {num_fewshot}-shot average"
                  f"{' (this run: --limit, a subset)' if limited else ''}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in paper.TABLE1_AVG[num_fewshot].items()))
    if "ppl" in results:
        p = results["ppl"]
        print(f"\nperplexity {p['ppl']:.4f} (mean NLL {p['nll']:.4f} over {p['tokens']:,} "
              f"tokens of {p['dataset']}/val.bin, {p['windows']:,} windows)")
        if Path(p["dataset"]).name.startswith("pile"):  # prepare_data.py's pile, any tokens
            print("paper, Table 1, Pile validation perplexity (GPT-NeoX tokens): "
                  + ", ".join(f"{k} {v}" for k, v in paper.TABLE1_PPL.items()))


# ----------------------------------------------------------------------------- the command line

def parse_args(argv):
    """The command line, checked (flags, types, ranges, something to evaluate) without reading a
    file or loading anything."""
    p = ArgumentParser("eval.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init_from", required=True, type=path, help="a train.py out_dir (its ckpt.pt), a "
                   "checkpoint file, a Hugging Face folder or hub id")
    p.add_argument("--tasks", default=",".join(PAPER_TASKS), help="comma-separated lm-eval task "
                   "names or globs (quoted: 'arc_*' runs every single task whose name matches, not "
                   "the groups); default: the paper's eight; empty: none")
    p.add_argument("--num_fewshot", type=int, default=0,
                   help="examples in each prompt (the paper: 0 and 5); default 0")
    p.add_argument("--limit", type=float,
                   help="score only this many examples per task (< 1: a fraction) and "
                        "this many --ppl windows; for quick checks, not for reported numbers")
    p.add_argument("--batch_size", type=int, default=16,
                   help="sequences per forward pass; default 16")
    p.add_argument("--device", default="auto", help="default auto: cuda, then mps, then cpu")
    p.add_argument("--include_path", type=path, help="a folder of extra lm-eval task YAML files (lm-eval's "
                   "own option; relative data_files are read from the YAML's folder)")
    p.add_argument("--json", type=path, help="write lm-eval's results dictionary here (plus 'ppl' with "
                   "--ppl); an existing file is replaced only if it holds an earlier result")
    p.add_argument("--ppl", metavar="DATASET", type=path, help="also report the perplexity of "
                   "<data_root>/DATASET/val.bin (a prepare_data.py output in the model's "
                   "tokenizer), e.g. pile")
    p.add_argument("--data_root", default="data", type=path, help="the folder that holds the --ppl dataset; "
                   "default data")
    args = p.parse_args(argv)
    args.names = list(dict.fromkeys(t.strip() for t in args.tasks.split(",") if t.strip()))
    if not args.names and not args.ppl:
        raise ConfigError("nothing to evaluate: give --tasks, --ppl=DATASET, or both")
    check_ranges(vars(args), KEY_RANGES)
    if args.limit is not None and args.limit >= 1 and args.limit != int(args.limit):
        raise ConfigError(f"--limit={args.limit:g}: give a whole number of examples, "
                          f"or a fraction below 1")
    return args


def check_flags(args):
    """Every check that needs neither the model nor the tasks, so that a typo costs no loading:
    (device, the --json path or None)."""
    device = resolve_device(args.device)
    json_path = output_file(args.json, "--json", written_by="eval.py") if args.json else None
    if args.names and lm_eval is None:
        raise MissingPackage("the downstream tasks need lm-evaluation-harness: pip install lm-eval "
                             "(or --tasks= with --ppl only)")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path {args.include_path} is not a folder of task YAML files")
    return device, json_path


def evaluate(model, enc, tasks, manager, data, args):
    """lm-eval's results for the built tasks, plus 'ppl' for the checked --ppl data."""
    results = {}
    try:
        if tasks:
            limit = (None if args.limit is None
                     else int(args.limit) if args.limit >= 1 else args.limit)
            with lm_eval_says(f"lm-eval stopped on --tasks (--num_fewshot={args.num_fewshot})"):
                results = lm_eval.simple_evaluate(EvalLM(model, enc, args.batch_size), tasks=tasks,
                                                  num_fewshot=args.num_fewshot, limit=limit,
                                                  task_manager=manager, log_samples=False)
        if data:
            results["ppl"] = perplexity(model, data, args.batch_size, enc.eot_token, args.limit)
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA, MPS) is one; the CPU allocator's too
        if "out of memory" in str(e) or "can't allocate memory" in str(e):
            raise ConfigError(f"out of memory scoring {args.batch_size} sequences of up to "
                              f"{model.config.block_size} tokens at once; lower --batch_size") from e
        raise
    return results


def main(argv):
    args = parse_args(argv)
    device, json_path = check_flags(args)
    check_source(args.init_from)  # before the tasks: offline, their download retries for minutes
    data = open_ppl_data(args.data_root, args.ppl) if args.ppl else None
    manager, tasks = build_tasks(args.names, args.include_path) if args.names else (None, [])

    loaded = load_model(args.init_from, device)
    model, enc = loaded.model, loaded.tokenizer
    print(f"{loaded.source}: step {loaded.step}, {model.num_params() / 1e6:.2f}M parameters, "
          f"depth_mode={model.config.depth_mode}, block_size {model.config.block_size}, {device}",
          file=sys.stderr)
    if data:
        check_ppl_data(data, loaded, args.init_from)

    results = evaluate(model, enc, tasks, manager, data, args)
    print_table(results, args.num_fewshot, args.limit is not None)
    if json_path:
        write_atomically(json_path, json.dumps({"written_by": mark("eval.py"), **results}, indent=2,
                                               default=str if lm_eval is None
                                               else handle_non_serializable))
        print(f"wrote {json_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_main(main))
