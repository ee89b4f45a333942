"""
Score a model as the paper's Table 1 does (section 3.1): accuracy on eight downstream tasks through
lm-evaluation-harness (`pip install lm-eval`), zero- or five-shot, and validation perplexity.

    python lab/eval.py --init_from=out/RUN                     # the paper's eight tasks, zero-shot
    python lab/eval.py --init_from=out/RUN --num_fewshot=5 --json=out/RUN/eval_5shot.json
    python lab/eval.py --init_from=out/RUN --tasks= --ppl=pile # perplexity of data/pile/val.bin
    python lab/eval.py --init_from=zeng123/Depth-attention-3B  # a Hugging Face folder or hub id
    python lab/eval.py --init_from=out/RUN --include_path=docs/eval_tasks --tasks=shakespeare_last_word

lm-eval builds the prompts and computes the metrics; EvalLM turns text into token scores. Whatever
can be checked without the model is checked before it loads: the keys, --init_from naming a model,
--json, the --ppl data, every task's file and data. docs/eval.md says the rest.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: the core
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import errno
import glob
import json
import math
import os
import socket
import traceback
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from checkpoint import checkpoint_path, load_model, read_checkpoint
from configurator import (ConfigError, DataError, Key, MissingPackage, UserError, parse,
                          resolve_device, run_main)
from data import load_meta, read_tokens
from lab.hf import is_hf_folder, looks_like_hub_id
from model import fp32_or_wider
from outputs import mark, output_file, write_atomically
from tokenizer import TIKTOKEN, get_tokenizer, same_tokenizer

try:  # optional: only the downstream tasks need it; --ppl works without
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import (get_rolling_token_windows, handle_non_serializable,
                               make_disjoint_window)
except ImportError:
    lm_eval, TemplateLM = None, object

# Table 1's tasks in lm-eval: LAMBADA, PIQA, WinoGrande, SciQ, HellaSwag, ARC-Easy/Challenge, RACE
PAPER_TASKS = ("lambada_openai", "piqa", "winogrande", "sciq", "hellaswag", "arc_easy",
               "arc_challenge", "race")
# Table 1, quoted: the average accuracy (%) over PAPER_TASKS by shots, and the Pile validation
# perplexity (GPT-NeoX tokens), of Qwen3-style models trained on 32B Pile tokens
TABLE1_AVG = {
    0: {"1.5B vanilla": 51.26, "1.5B Depth-Attention": 53.60, "3B vanilla": 53.76, "3B mHC": 54.68,
        "3B AttnRes": 55.01, "3B DenseFormer": 54.70, "3B Depth-Attention": 55.69},
    5: {"1.5B vanilla": 51.65, "1.5B Depth-Attention": 53.72, "3B vanilla": 54.16, "3B mHC": 55.65,
        "3B AttnRes": 55.92, "3B DenseFormer": 55.59, "3B Depth-Attention": 56.17}}
TABLE1_PPL = {"1.5B vanilla": 8.17, "1.5B Depth-Attention": 7.77, "3B vanilla": 7.55,
              "3B Depth-Attention": 7.25}
GLOB_CHARACTERS = set("*?[")  # fnmatch's: a --tasks name with one of them is a pattern
HUB_PROBE_SECONDS = 3  # offline, datasets would retry each download for ~25 s instead
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

KEYS = {
    "init_from": Key(None, "a train.py out_dir or ckpt.pt, a Hugging Face folder or hub id "
                     "(required)", kind=str, path=True),
    "tasks": Key(",".join(PAPER_TASKS), "comma-separated lm-eval task names or globs ('arc_*': "
                 "every single task that matches, not groups); empty: none"),
    "num_fewshot": Key(0, "examples in each prompt (the paper: 0 and 5)", ">= 0"),
    "limit": Key(None, "score this many examples per task (< 1: a fraction) and --ppl windows; "
                 "quick checks only", "> 0", kind=float),
    "batch_size": Key(16, "sequences per forward pass", ">= 1"),
    "device": Key("auto", "auto = cuda, then mps, then cpu"),
    "include_path": Key(None, "a folder of extra lm-eval task YAML files (their relative "
                        "data_files read from beside them)", kind=str, path=True),
    "json": Key(None, "write lm-eval's results here (plus 'ppl'); replaces only an earlier "
                "result", kind=str, path=True),
    "ppl": Key("", "also the perplexity of DATA_ROOT/PPL/val.bin (prepare_data.py, in the "
               "model's tokenizer), e.g. pile"),
    "data_root": Key("data", "the folder that holds the --ppl dataset", path=True),
}


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def token_logprobs(model, rows, batch_size, pad_id, progress=False):
    """For each row of 2 .. block_size + 1 ids, (log p(row[t] | row[:t]), whether row[t] is the
    argmax) for t >= 1, as two CPU tensors. Rows are right-padded longest first: attention is
    causal, so padding after a row's last token changes none of its logits."""
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
    """Our model as an lm-eval language model; every score comes from token_logprobs."""

    def __init__(self, model, tokenizer, batch_size):
        super().__init__()
        self.model, self.enc, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.config.block_size

    @property
    def eot_token_id(self):
        return self.enc.eot_token

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.enc.encode(string, allowed_special="all")

    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        """(log p(continuation | context), whether greedy decoding gives it) per request, on the
        last block_size + 1 tokens (lm-eval's Hugging Face rule)."""
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

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each document's log-likelihood in lm-eval's rolling windows (perplexity tasks)."""
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

    def generate_until(self, requests, disable_tqdm=False):
        """model.generate (greedy unless do_sample), cut at the first stop string or end-of-text;
        the prompt left-truncated to leave room for max_gen_toks."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1)
            temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
            ids = self.tok_encode(context)[-(self.max_length - new):] or [self.prefix_token_id]
            idx = torch.tensor([ids], device=self.model.lm_head.weight.device)  # (1, prompt)
            text = self.enc.decode(
                self.model.generate(idx, new, temperature=temperature)[0, len(ids):].tolist())
            for stop in until + [self.enc.decode([self.eot_token_id])]:
                text = text.split(stop)[0]
            out.append(text)
        return out


def open_ppl_data(data_root, name):
    """(folder, meta.json, val.bin memory-mapped) of the --ppl dataset."""
    data_dir = Path(data_root) / name
    meta = load_meta(data_dir)  # checked against the .bin files; val holds 2 tokens or more
    return data_dir, meta, read_tokens(data_dir, "val", meta)


def check_ppl_data(data, loaded, init_from):
    """--ppl data in the model's tokenizer (else its perplexity means nothing) with no id beyond
    its vocabulary (else an IndexError, or a device-side assert on CUDA)."""
    data_dir, meta, tokens = data
    vocab, enc = loaded.model.config.vocab_size, loaded.tokenizer
    if meta["vocab_size"] > vocab or not same_tokenizer(get_tokenizer(meta["tokenizer"]), enc):
        flag = (f"--tokenizer={enc.name}" if enc.name in TIKTOKEN or Path(enc.name).exists()
                else f"--tokenizer=DIR after `python lab/export.py {init_from} DIR`")
        raise DataError(f"{data_dir} was tokenized with {meta['tokenizer']}, but {init_from} uses "
                        f"{enc.name}, so its perplexity would mean nothing; prepare the data with "
                        f"the model's tokenizer (prepare_data.py SOURCE {flag} --name NAME)")
    if (top := int(tokens.max())) >= vocab:
        raise DataError(f"{data_dir / 'val.bin'} holds token id {top}, beyond the model's "
                        f"vocab_size {vocab}: the file does not match its meta.json; rebuild it "
                        f"with prepare_data.py --force")


def perplexity(model, data, batch_size, pad_id, limit=None):
    """exp(mean NLL) over val.bin in non-overlapping windows of block_size predicted tokens, each
    token after the first predicted once (window w's first input is window w-1's last target)."""
    data_dir, _, tokens = data
    T = model.config.block_size
    starts = range(0, len(tokens) - 1, T)
    if limit is not None:
        starts = starts[:limit if limit >= 1 else math.ceil(limit * len(starts))]
    nll, count = 0.0, 0
    for s in tqdm(range(0, len(starts), batch_size), desc=f"perplexity of {data_dir / 'val.bin'}"):
        rows = [tokens[i:i + T + 1].astype(np.int64).tolist() for i in starts[s:s + batch_size]]
        for logp, _ in token_logprobs(model, rows, batch_size, pad_id):
            nll, count = nll - logp.double().sum().item(), count + len(logp)
    return {"dataset": str(data_dir), "windows": len(starts), "tokens": count, "nll": nll / count,
            "ppl": math.exp(nll / count)}


# ----------------------------------------------------------------------------- lm-eval's tasks

def one_line(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def raised_by_us(e) -> bool:
    """Whether e comes from this file's code that lm-eval called (EvalLM), not lm-eval's own."""
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(e.__traceback__)]
    theirs = [i for i, f in enumerate(files) if f"{os.sep}lm_eval{os.sep}" in f]
    mine = [i for i, f in enumerate(files) if f == __file__]
    return bool(theirs) and max(mine, default=-1) > theirs[-1]


@contextmanager
def lm_eval_says(what):
    """What lm-eval raises (it has no error type of its own: a bad task file or data is a
    ValueError, a KeyError, a jinja2 or datasets error...) as one line naming `what`; ours (a
    UserError its line, a bug its traceback) as it is."""
    try:
        yield
    except Exception as e:
        if isinstance(e, UserError) or raised_by_us(e):
            raise
        root = e
        while root.__cause__ or root.__context__:  # datasets may fail again wording its error
            root = root.__cause__ or root.__context__
        raise ConfigError(f"{what}: {one_line(e)}"
                          + (f", from {one_line(root)}" if root is not e else "")) from e


def build_tasks(names, include_path):
    """(lm-eval's TaskManager, the tasks), each built (file and data read) before the model loads.
    A glob selects single tasks: its groups' tasks would run twice, which lm-eval refuses."""
    from lm_eval.tasks import TaskManager
    manager = None
    if include_path and not any(GLOB_CHARACTERS & set(n) for n in names):
        local = TaskManager(include_path=include_path, include_defaults=False)
        # names all defined there skip indexing lm-eval's ~15,000 built-in task files (~15 s)
        manager = local if set(names) <= set(local.all_subtasks) | set(local.all_tags) else None
    manager = manager or TaskManager(include_path=include_path)
    if include_path:
        read_data_beside_task_files(manager, include_path)
    single = set(manager.all_subtasks)
    selected = {n: [t for t in manager.match_tasks([n]) if t in single] if GLOB_CHARACTERS & set(n)
                else [n] * (n in manager.all_tasks) for n in names}
    if missing := [n for n, found in selected.items() if not found]:
        indexed = {e.yaml_path.resolve() for e in manager.task_index.values() if e.yaml_path}
        left_out = [str(p) for p in sorted(Path(include_path).rglob("*.yaml"))
                    if p.resolve() not in indexed] if include_path else []
        raise ConfigError(f"unknown task(s) {', '.join(missing)}" + (
            f"; lm-eval left out these task files of --include_path, which it could not read: "
            f"{', '.join(left_out)}" if left_out else ": list lm-eval's tasks with `lm-eval ls "
            "tasks`, or give a folder of task YAML files with --include_path (a glob selects "
            "single tasks, not groups or tags)"))
    todo = list(dict.fromkeys(t for found in selected.values() for t in found))
    with hub_offline():  # local and cached data load at once; the rest fails at once
        built = {name: build(manager, name, cached_only=True) for name in todo}
    if uncached := [name for name, tasks in built.items() if tasks is None]:
        if why := hub_out_of_reach():
            import datasets.config
            raise DataError(
                f"task(s) {', '.join(uncached)}: their data is on the Hugging Face Hub, but "
                f"{why}, and it is not in the datasets cache "
                f"({datasets.config.HF_DATASETS_CACHE}): run once with network access (the data "
                f"is then cached, and HF_DATASETS_OFFLINE=1 runs on the cache alone), or use "
                f"local task files with --include_path (docs/eval.md)")
        built.update({name: build(manager, name) for name in uncached})  # downloaded
    tasks = [t for name in todo for t in built[name]]
    with lm_eval_says("--tasks"):
        manager.load(tasks)  # lm-eval's own check that no task runs twice (alone and in a group)
    return manager, tasks


def build(manager, name, cached_only=False):
    """The tasks lm-eval builds for name; None for cached_only and data that is not cached."""
    entry = manager.task_index.get(name)
    with lm_eval_says(f"task {name}" + (f" ({entry.yaml_path})" if entry and entry.yaml_path
                                        else "")):
        try:
            loaded = manager.load([name])
        except ConnectionError:  # datasets' offline mode, for data not in its cache
            if cached_only:
                return None
            raise
    return [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())


def read_data_beside_task_files(manager, include_path):
    """A relative data_files (or data_dir) of a task in --include_path read from beside its YAML
    where it exists there, else (lm-eval's rule) from the current folder; a Hub dataset's files
    are paths in its repository. lm-eval 0.4.13 reads configs in one private method, wrapped."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES  # json, csv, parquet...
    read = getattr(getattr(manager, "_factory", None), "_load_full_config", None)
    if read is None:
        return
    folder = Path(include_path).resolve()

    def resolve(p, beside):
        if isinstance(p, dict):
            return {k: resolve(v, beside) for k, v in p.items()}
        if isinstance(p, (list, tuple)):
            return [resolve(q, beside) for q in p]
        if (isinstance(p, str) and "://" not in p and not Path(p).expanduser().is_absolute()
                and glob.glob(p, root_dir=beside, recursive=True)):
            return str(beside / p)
        return p

    def read_beside(entry, overrides=None):
        cfg = read(entry, overrides)
        yaml = Path(entry.yaml_path).resolve() if getattr(entry, "yaml_path", None) else None
        kwargs = cfg.get("dataset_kwargs")
        if (yaml and folder in yaml.parents and isinstance(kwargs, dict)
                and cfg.get("dataset_path") in _PACKAGED_DATASETS_MODULES):
            key = "data_dir" if kwargs.get("data_dir") else "data_files"  # data_files lie in it
            if kwargs.get(key):
                cfg["dataset_kwargs"] = {**kwargs, key: resolve(kwargs[key], yaml.parent)}
        return cfg
    manager._factory._load_full_config = read_beside


def hub_out_of_reach(timeout=HUB_PROBE_SECONDS):
    """Why the tasks may not download (offline by choice, or no answer to one HEAD request), else
    None. Any answer counts, an HTTP error or a TLS failure too: a run that could download runs."""
    import datasets.config
    if datasets.config.HF_HUB_OFFLINE:  # either variable sets it when datasets is imported
        chosen = " and ".join(f"{v}={os.environ[v]}" for v in OFFLINE_VARIABLES
                              if os.environ.get(v))
        return f"datasets is in offline mode ({chosen or 'set in code'}; unset to download)"
    endpoint = datasets.config.HF_ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:  # no answer; the socket's error is its reason
        if isinstance(e.reason, TimeoutError):
            return f"{endpoint} is out of reach (no connection within {timeout} s)"
        if (isinstance(e.reason, (socket.gaierror, ConnectionError))
                or getattr(e.reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH)):
            return f"{endpoint} is out of reach ({one_line(e.reason)})"
    except (OSError, ValueError):  # an answer, if slow or strange: datasets says what is wrong
        pass
    return None


@contextmanager
def hub_offline():
    """datasets' offline mode within the block (cached data loads, the rest fails at once instead
    of retrying), restored after: main runs in the tests' process too."""
    import datasets.config
    import huggingface_hub.constants as hub
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


# ----------------------------------------------------------------------------- the command

def print_table(results, num_fewshot, limited):
    """acc and acc_norm per task (x100, as in the paper), two averages, Table 1 beside."""
    rows = {t: m for t, m in results.get("results", {}).items()
            if t not in results.get("groups", {})}
    if rows:
        print(f"\n{'task':<20}{'acc':>8}{'acc_norm':>10}  other metrics ({num_fewshot}-shot)")
    for task, m in rows.items():
        acc, norm = (m.get(f"{k},none") for k in ("acc", "acc_norm"))
        other = ", ".join(f"{k.split(',')[0]} {v:.4g}" for k, v in m.items() if k.endswith(",none")
                          and "stderr" not in k and k.split(",")[0] not in ("acc", "acc_norm"))
        print(f"{task:<20}{'-' if acc is None else f'{100 * acc:.2f}':>8}"
              f"{'-' if norm is None else f'{100 * norm:.2f}':>10}  {other}")
    if scored := [(m["acc,none"], m.get("acc_norm,none", m["acc,none"])) for m in rows.values()
                  if "acc,none" in m]:
        acc, norm = (100 * sum(column) / len(scored) for column in zip(*scored))
        print(f"{'average, acc':<20}{acc:>8.2f}{'':>10}  over {len(scored)} tasks")
        print(f"{'average, acc_norm':<20}{'':>8}{norm:>10.2f}  acc_norm where a task has it, else "
              f"acc (the paper does not say which it averages)")
        if sorted(rows) == sorted(PAPER_TASKS) and num_fewshot in TABLE1_AVG:
            print(f"paper, Table 1, {num_fewshot}-shot average"
                  f"{' (this run: --limit, a subset)' if limited else ''}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in TABLE1_AVG[num_fewshot].items()))
    if p := results.get("ppl"):
        print(f"\nperplexity {p['ppl']:.4f} (mean NLL {p['nll']:.4f} over {p['tokens']:,} "
              f"tokens of {p['dataset']}/val.bin, {p['windows']:,} windows)")
        if Path(p["dataset"]).name.startswith("pile"):  # prepare_data.py's pile, any tokenizer
            print("paper, Table 1, Pile validation perplexity (GPT-NeoX tokens): "
                  + ", ".join(f"{k} {v}" for k, v in TABLE1_PPL.items()))


def main(argv):
    a = parse(argv, KEYS, __doc__)
    names = list(dict.fromkeys(t.strip() for t in a["tasks"].split(",") if t.strip()))
    if not a["init_from"]:
        raise ConfigError("give --init_from: a train.py out_dir or ckpt.pt, a Hugging Face folder "
                          "or hub id")
    if not names and not a["ppl"]:
        raise ConfigError("nothing to evaluate: give --tasks, --ppl=DATASET, or both")
    limit = a["limit"]
    if limit is not None and limit >= 1:
        if limit != int(limit):
            raise ConfigError(f"--limit={limit:g}: give a whole number of examples, or a fraction "
                              f"below 1")
        limit = int(limit)
    device = resolve_device(a["device"])
    json_path = output_file(a["json"], "--json", written_by="eval.py") if a["json"] else None
    if names and lm_eval is None:
        raise MissingPackage("the downstream tasks need lm-evaluation-harness: pip install lm-eval "
                             "(or --tasks= with --ppl only)")
    if a["include_path"] and not Path(a["include_path"]).is_dir():
        raise ConfigError(f"--include_path {a['include_path']} is not a folder of task YAML files")
    init_from, path = a["init_from"], checkpoint_path(a["init_from"])
    if not (path.exists() or is_hf_folder(init_from) or looks_like_hub_id(init_from)):
        read_checkpoint(path)  # its "no checkpoint at" line now: offline, tasks retry for minutes
    data = open_ppl_data(a["data_root"], a["ppl"]) if a["ppl"] else None
    manager, tasks = build_tasks(names, a["include_path"]) if names else (None, [])

    loaded = load_model(init_from, device)
    model, enc = loaded.model, loaded.tokenizer
    print(f"{loaded.source}: step {loaded.step}, {model.num_params() / 1e6:.2f}M parameters, "
          f"depth_mode={model.config.depth_mode}, block_size {model.config.block_size}, {device}",
          file=sys.stderr)
    if data:
        check_ppl_data(data, loaded, init_from)
    results = {}
    try:
        if tasks:
            with lm_eval_says(f"lm-eval stopped on --tasks (--num_fewshot={a['num_fewshot']})"):
                results = lm_eval.simple_evaluate(
                    EvalLM(model, enc, a["batch_size"]), tasks=tasks, num_fewshot=a["num_fewshot"],
                    limit=limit, task_manager=manager, log_samples=False)
        if data:
            results["ppl"] = perplexity(model, data, a["batch_size"], enc.eot_token, limit)
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA, MPS) is one; the CPU allocator's too
        if "out of memory" in str(e) or "can't allocate memory" in str(e):
            raise ConfigError(f"out of memory scoring {a['batch_size']} sequences of up to "
                              f"{model.config.block_size} tokens at once; lower --batch_size") from e
        raise
    print_table(results, a["num_fewshot"], limit is not None)
    if json_path:
        write_atomically(json_path, json.dumps(
            {"written_by": mark("eval.py"), **results}, indent=2,
            default=str if lm_eval is None else handle_non_serializable))
        print(f"wrote {json_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_main(main))
