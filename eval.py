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
import argparse
import errno
import functools
import glob
import json
import math
import os
import socket
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import fp32_or_wider
from support import paper
from support.checkpoint import check_source, load_model
from support.cli import ArgumentParser, MissingPackage, mark, output_file, resolve_device, write_atomically
from support.config import check_ranges
from support.data import NotPrepared, load_meta
from support.errors import USER_ERRORS, ConfigError, DataError, run_main
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
GLOB_CHARACTERS = set("*?[")  # fnmatch's: a --tasks name with one of them is a pattern
# Before tasks that may download are built, the Hub has this long to answer (hub_access).
HUB_PROBE_SECONDS = 3
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@torch.no_grad()
def token_logprobs(model, rows, batch_size, pad_id, progress=False):
    """Score token lists of 2 .. block_size + 1 ids: for each row, (log p(row[t] | row[:t]), row[t]
    is the argmax) for t = 1 .. len - 1, as two 1-D CPU tensors, in the order given.

    Rows are sorted longest first and batched by right-padding: the model has no padding mask, but
    attention is causal, so the padding after a row's last real token changes none of its logits;
    only real positions are read.
    """
    device = model.lm_head.weight.device
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out = [None] * len(rows)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="scoring"):
        batch = order[start:start + batch_size]
        x = torch.full((len(batch), len(rows[batch[0]]) - 1), pad_id,  # (B, longest input)
                       dtype=torch.long)
        for b, i in enumerate(batch):
            x[b, :len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
        logits, _ = model(x.to(device))                                           # (B, T, vocab)
        for b, i in enumerate(batch):
            y = torch.tensor(rows[i][1:], device=device)
            row_logits = fp32_or_wider(logits[b, :len(y)])                       # (len(y), vocab)
            out[i] = (-F.cross_entropy(row_logits, y, reduction="none").cpu(),
                      (row_logits.argmax(-1) == y).cpu())
    return out


def ours(method):
    """An EvalLM method lm-eval calls: what it raises is marked as raised here, so lm_eval_says lets
    it through (a UserError as its line, anything else as the bug it is, with its traceback)."""
    @functools.wraps(method)
    def marked(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as e:
            e.raised_in_eval_py = True
            raise
    return marked


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
            if len(continuation) > self.max_length:  # a task this model cannot score:
                                                     # no truncation is right
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


# ---------------------------------------------------------------------- the tasks, built by lm-eval

@contextmanager
def lm_eval_says(what):
    """The one boundary around lm-eval: what it raises for a task (a file it cannot build, missing
    data, a template field the data lacks, a document its metrics cannot take) becomes one
    ConfigError, its own message and the error under it. What EvalLM raised (`ours`) passes
    through as it is: a UserError is its own line, anything else a bug with its traceback."""
    try:
        yield
    except USER_ERRORS:
        raise
    except ConnectionError as e:  # datasets raises this when the Hub is out of reach
        raise DataError(f"{what}: its data could not be downloaded ({one_line(e)}); run once with "
                        f"network access (it is cached), or use local task files with "
                        f"--include_path") from e
    # lm-eval has no error type of its own: a bad task file or data reaches us as a ValueError, a
    # KeyError, a jinja2 or datasets error... So this one catch takes any Exception, and only
    # those that did not come out of our code.
    except Exception as e:
        if getattr(e, "raised_in_eval_py", False):
            raise
        root = e
        while root.__cause__ or root.__context__:  # datasets may fail again wording its own error
            root = root.__cause__ or root.__context__
        raise ConfigError(f"{what}: {one_line(e)}"
                          + (f", from {one_line(root)}" if root is not e else "")) from e


def build_tasks(names, include_path):
    """(lm-eval's TaskManager, the tasks to run), built before the model loads: lm-eval reads each
    task's file and data (downloading it on first use). A glob selects every single task whose name
    matches (not groups or tags, whose tasks it matches too: lm-eval refuses a task that would run
    twice). Indexing lm-eval's ~15,000 built-in task files takes ~15 s, so names that --include_path
    defines (no glob) index that folder alone. Where the Hub is out of reach (hub_access), tasks
    whose data is cached still build and the others are named together in one error."""
    from lm_eval.tasks import TaskManager
    manager = None
    if include_path and not any(GLOB_CHARACTERS & set(n) for n in names):
        local = TaskManager(include_path=include_path, include_defaults=False)
        manager = local if set(names) <= set(local.all_subtasks) | set(local.all_tags) else None
    manager = manager or TaskManager(include_path=include_path)
    if include_path:
        read_data_beside_task_files(manager, include_path)
    single = set(manager.all_subtasks)
    selected = {n: [t for t in manager.match_tasks([n]) if t in single] if GLOB_CHARACTERS & set(n)
                else [n] * (n in manager.all_tasks) for n in names}
    missing = [n for n, found in selected.items() if not found]
    if missing:
        left_out = []  # the --include_path files lm-eval could not read (none looked for without)
        if include_path:
            indexed = {e.yaml_path.resolve() for e in manager.task_index.values() if e.yaml_path}
            left_out = [str(p) for p in sorted(Path(include_path).rglob("*.yaml"))
                        if p.resolve() not in indexed]
        raise ConfigError(f"unknown task(s) {', '.join(missing)}" + (
            f"; lm-eval left out these task files of --include_path, which it could not read: "
            f"{', '.join(left_out)}" if left_out
            else ": list lm-eval's tasks with `lm-eval ls tasks`, or "
            "give a folder of task YAML files with --include_path (a glob selects single tasks, "
            "not groups or tags)"))
    todo = list(dict.fromkeys(t for found in selected.values() for t in found))
    offline = hub_access([manager.task_index.get(name) for name in todo])
    built, uncached = [], []
    with hub_offline() if offline else nullcontext():
        for name in todo:
            entry = manager.task_index.get(name)
            where = f" ({entry.yaml_path})" if entry and entry.yaml_path else ""
            with lm_eval_says(f"task {name}{where}"):
                try:
                    loaded = manager.load([name])
                except ConnectionError:  # offline, datasets fails at once on data it has not cached
                    if not offline:
                        raise
                    uncached.append(name)  # the next tasks may be cached: name every one missing
                    continue
            built += ([loaded["groups"][name]] if name in loaded["groups"]
                      else list(loaded["tasks"].values()))
    if uncached:
        import datasets.config
        raise DataError(
            f"task(s) {', '.join(uncached)}: their data is on the Hugging Face Hub, but {offline}, "
            f"and it is not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}): run once "
            f"with network access (the data is then cached, and HF_DATASETS_OFFLINE=1 runs on the "
            f"cache alone), or use local task files with --include_path (docs/eval.md)")
    with lm_eval_says("--tasks"):
        manager.load(built)  # lm-eval's own check that no task runs twice (alone and in a group)
    return manager, built


def read_data_beside_task_files(manager, include_path):
    """Make lm-eval read the relative data_files (or data_dir) of a task file in --include_path
    from that file's own folder: lm-eval hands them to datasets as they are, which reads them from
    the current folder, so a folder of tasks would run from one folder only. A path that is not
    beside the file is left as it is (a task written against the current folder still runs), and so
    are absolute paths, URLs and a Hub dataset's files (paths in its repository). lm-eval 0.4.13
    reads every task's config in one private method (also for a group's tasks), wrapped here on
    this manager alone; an lm-eval without it keeps its own rule."""
    factory = getattr(manager, "_factory", None)
    read = getattr(factory, "_load_full_config", None)
    if read is None:
        return
    folder = Path(include_path).resolve()

    def read_beside(entry, overrides=None):
        cfg = read(entry, overrides)
        yaml = Path(entry.yaml_path).resolve() if getattr(entry, "yaml_path", None) else None
        if yaml and folder in yaml.parents and local_builder(cfg) \
                and isinstance(cfg.get("dataset_kwargs"), dict):
            cfg["dataset_kwargs"] = beside(yaml.parent, cfg["dataset_kwargs"])
        return cfg
    factory._load_full_config = read_beside


def local_builder(cfg):
    """Whether a task's dataset_path is one of datasets' builders of files (json, csv, parquet...),
    whose data_files are local paths or URLs, not paths in a Hub repository."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    path = cfg.get("dataset_path")
    return isinstance(path, str) and path in _PACKAGED_DATASETS_MODULES


def beside(folder, kwargs):
    """dataset_kwargs with its relative data_dir, or else its relative data_files (datasets reads
    them in data_dir when there is one), in folder where they exist there (a pattern: where it
    matches a file)."""
    def resolve(p):
        if isinstance(p, (list, tuple)):
            return [resolve(q) for q in p]
        if isinstance(p, dict):
            return {k: resolve(v) for k, v in p.items()}
        if (isinstance(p, str) and "://" not in p and not Path(p).expanduser().is_absolute()
                and glob.glob(p, root_dir=folder, recursive=True)):
            return str(folder / p)
        return p
    key = "data_dir" if kwargs.get("data_dir") else "data_files"
    return {**kwargs, key: resolve(kwargs[key])} if kwargs.get(key) else kwargs


def may_download(entry):
    """Whether building an index entry may fetch data from the Hub: anything but a task whose data
    is local (a builder of files over paths that are no URLs, or a dataset_path that exists here).
    A group, a tag or a Python task may: their tasks are not looked into."""
    cfg = getattr(entry, "cfg", None)
    if (not cfg or "task" not in cfg or "class" in cfg or "group" in cfg
            or cfg.get("custom_dataset")):
        return True
    kwargs = cfg.get("dataset_kwargs") or {}
    if "://" in json.dumps([kwargs.get("data_files"), kwargs.get("data_dir")]):
        return True
    path = cfg.get("dataset_path")
    return not (local_builder(cfg) or (isinstance(path, str) and Path(path).exists()))


def hub_access(entries):
    """None where the tasks may use the Hub, else why not (for the error line): offline by choice
    (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE), or the Hub did not answer a probe. Offline, datasets
    retries each download for ~25 s (longer where a connection hangs instead of failing) before it
    fails, so tasks that may download are built in its offline mode where the Hub is out of reach:
    cached data still loads, data that is not cached fails at once. Tasks on local files probe
    nothing."""
    if not any(may_download(e) for e in entries):
        return None
    import datasets.config
    if datasets.config.HF_HUB_OFFLINE:  # either variable sets it when datasets is imported
        chosen = " and ".join(f"{v}={os.environ[v]}" for v in OFFLINE_VARIABLES
                              if os.environ.get(v))
        return f"datasets is in offline mode ({chosen or 'set in code'}; unset to download)"
    endpoint = datasets.config.HF_ENDPOINT
    silent = hub_unreachable(endpoint)
    if silent is None:
        return None
    print(f"warning: {endpoint} is out of reach ({silent}): the tasks read their data from the "
          f"datasets cache alone (its offline mode)", file=sys.stderr)
    return f"{endpoint} is out of reach ({silent})"


def hub_unreachable(endpoint, timeout=HUB_PROBE_SECONDS):
    """None where the Hub answers at all, else why not: one HEAD request to its endpoint, through
    the environment's proxies as datasets' own requests go. Any answer counts, an HTTP error or a
    TLS failure too: only a name that does not resolve, a connection refused or without a route, or
    no connection within `timeout` seconds is out of reach, so the probe stops no run that could
    download."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:  # no answer to the request; the socket's error is its reason
        if isinstance(e.reason, TimeoutError):
            return f"no connection within {timeout} s"
        if (isinstance(e.reason, (socket.gaierror, ConnectionError))
                or getattr(e.reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH)):
            return one_line(e.reason)
    except (OSError, ValueError):  # an answer, if slow or strange: datasets will say what is wrong
        pass
    return None


@contextmanager
def hub_offline():
    """datasets' and huggingface_hub's offline mode within the block, as HF_HUB_OFFLINE=1 sets it
    when they are imported; restored after, as eval.main runs in the tests' process too."""
    import datasets.config
    import huggingface_hub.constants as hub
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def one_line(e):
    """An exception as one line: its class and its message, every run of white space one space."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


# -------------------------------------------------------------------------- perplexity of a val.bin

def open_ppl_data(data_root, name):
    """(folder, meta.json, val.bin memory-mapped) of the --ppl dataset, checked before anything is
    loaded."""
    data_dir = Path(data_root) / name
    try:
        meta = load_meta(data_dir)  # meta.json, and the .bin sizes it promises
    except NotPrepared as e:
        raise NotPrepared(f"{e}; or set --data_root to the folder that holds {name}/") from e
    val = data_dir / "val.bin"
    if not val.is_file() or val.stat().st_size < 4:  # two uint16 ids: one input, one target
        raise DataError(f"{val} holds fewer than 2 tokens: rebuild {data_dir} with "
                        f"prepare_data.py --force")
    return data_dir, meta, np.memmap(val, dtype=np.uint16, mode="r")


def check_ppl_data(data, loaded, init_from):
    """--ppl data this model can score: in its tokenizer (else the perplexity measures nothing) and
    with no id beyond its vocabulary (else the embedding raises an IndexError, or a device-side
    assert on CUDA)."""
    data_dir, meta, tokens = data
    vocab = loaded.model.config.vocab_size
    data_enc = get_tokenizer(meta["tokenizer"])  # a DataError if its folder is gone
    if meta["vocab_size"] > vocab or not same_tokenizer(data_enc, loaded.tokenizer):
        raise DataError(f"{data_dir} was tokenized with {meta['tokenizer']}, "
             f"but {init_from} uses {loaded.tokenizer.name}, so "
             f"its perplexity would mean nothing; prepare the data with the model's tokenizer "
             f"(prepare_data.py SOURCE {tokenizer_flag(loaded.tokenizer, init_from)} --name NAME)")
    top = int(tokens.max())
    if top >= vocab:
        raise DataError(f"{data_dir / 'val.bin'} holds token id {top}, "
             f"beyond the model's vocab_size {vocab}: the file does not "
             f"match its meta.json; rebuild it with prepare_data.py --force")


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
    """acc and acc_norm per task (x100, as in the paper), two averages, and the paper's Table 1
    beside them."""
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
        if Path(p["dataset"]).name.startswith("pile"):  # prepare_data.py's pile
                                                        # source, in any tokens
            print("paper, Table 1, Pile validation perplexity (GPT-NeoX tokens): "
                  + ", ".join(f"{k} {v}" for k, v in paper.TABLE1_PPL.items()))


# ----------------------------------------------------------------------------- the command line

def parse_args(argv):
    """The command line, checked (flags, types, ranges, something to evaluate) without reading a
    file or loading anything."""
    p = ArgumentParser("eval.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init_from", required=True,
                   help="a train.py out_dir (its ckpt.pt), a checkpoint file, "
                        "a Hugging Face folder or hub id")
    p.add_argument("--tasks", default=",".join(PAPER_TASKS),
                   help="comma-separated lm-eval task names or globs (quoted: 'arc_*' runs every "
                        "single task whose name matches, not the groups); default: the paper's "
                        "eight; empty: none")
    p.add_argument("--num_fewshot", type=int, default=0,
                   help="examples in each prompt (the paper: 0 and 5); default 0")
    p.add_argument("--limit", type=float,
                   help="score only this many examples per task (< 1: a fraction) and "
                        "this many --ppl windows; for quick checks, not for reported numbers")
    p.add_argument("--batch_size", type=int, default=16,
                   help="sequences per forward pass; default 16")
    p.add_argument("--device", default="auto", help="default auto: cuda, then mps, then cpu")
    p.add_argument("--include_path",
                   help="a folder of extra lm-eval task YAML files (lm-eval's own option; "
                        "relative data_files are read from the YAML's folder)")
    p.add_argument("--json",
                   help="write lm-eval's results dictionary here (plus 'ppl' with --ppl); "
                        "an existing file is replaced only if it holds an earlier result")
    p.add_argument("--ppl", metavar="DATASET",
                   help="also report the perplexity of <data_root>/DATASET/val.bin "
                        "(a prepare_data.py output in the model's tokenizer), e.g. pile")
    p.add_argument("--data_root", default="data",
                   help="the folder that holds the --ppl dataset; default data")
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
    json_path = (output_file(args.json, "--json", written_by="eval.py") if args.json
                 else None)
    if args.names and lm_eval is None:
        raise MissingPackage("the downstream tasks need lm-evaluation-harness: pip install lm-eval "
                             "(or --tasks= with --ppl only)")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path {args.include_path} is not a folder of task YAML files")
    return device, json_path


def evaluate(model, enc, tasks, manager, data, args):
    """lm-eval's results for the tasks (already built), plus 'ppl' for --ppl data (already
    checked)."""
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
