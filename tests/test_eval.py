"""lab/eval.py: EvalLM's scores against direct forward passes of the model, and the script on a
checkpoint in train.py's format with local task files (lm-eval's `dataset_path: json`), the Hub
never asked. main runs in this process where it can: a subprocess spends seconds on imports."""
import http.server
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import datasets.config
import huggingface_hub.constants
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

import lab.eval as eval_py
from checkpoint import load_model
from configurator import run_main
from conftest import tiny_model
from outputs import save_checkpoint
from tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "docs" / "eval_tasks"
DOCS = [json.loads(line) for line in (SHIPPED / "shakespeare_last_word.jsonl").open()][:4]
MC = [{"question": q, "choices": c, "answer": a} for q, c, a in [
    ("the cat", ["sat", "mat", "log"], 0), ("a dog ran", ["on", "under", "the"], 1),
    ("then the", ["cat", "dog", "and"], 2), ("on the", ["mat", "log", "a"], 0),
    ("the dog sat under", ["a", "the", "then"], 1), ("and then the cat", ["ran", "sat", "on"], 0)]]
TEXTS = ["the cat sat on the mat.", "a dog ran under the log.", "and then the dog sat."]


@pytest.fixture(autouse=True)
def no_hub(tmp_path_factory, monkeypatch):
    """Task data cached under the tests' folder, never ~/.cache, and datasets offline."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE",
                        str(tmp_path_factory.getbasetemp() / "hf_datasets"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    for variable in (*eval_py.OFFLINE_VARIABLES, "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")  # the tests' own Hub, never behind a proxy


@pytest.fixture
def local_tasks_only(monkeypatch):
    """lm-eval's TaskManager without its ~15,000 built-in tasks (indexing them takes ~15 s)."""
    import lm_eval.tasks

    class LocalOnly(lm_eval.tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            super().__init__(include_path=include_path, include_defaults=False, **kwargs)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An out_dir with a ckpt.pt in train.py's format: a byte-level model, 32-token context."""
    out = tmp_path_factory.mktemp("run")
    model = tiny_model(vocab_size=257, block_size=32)
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                     "tokenizer": "bytes", "step": 0}, out / "ckpt.pt")
    return out


def main(*args, capsys=None):
    """`python lab/eval.py args` in this process: its exit status (and stderr's last line)."""
    code = run_main(eval_py.main, [str(a) for a in args])
    if capsys:
        err = capsys.readouterr().err.strip().splitlines()
        return code, err[-1] if err else ""
    return code


def write_task(folder, docs=DOCS, name="shakespeare_last_word", data=None, edit=lambda y: y):
    """A copy of the shipped task in folder, renamed and edited, over docs as JSON lines."""
    folder.mkdir(exist_ok=True)
    data = data or f"{name}.jsonl"
    if docs is not None:
        (folder / data).write_text(docs if isinstance(docs, str)
                                   else "".join(json.dumps(d) + "\n" for d in docs))
    yaml = (SHIPPED / "shakespeare_last_word.yaml").read_text()
    yaml = yaml.replace("test: shakespeare_last_word.jsonl", f"test: {data}")
    (folder / f"{name}.yaml").write_text(edit(yaml.replace("task: shakespeare_last_word",
                                                           f"task: {name}")))
    return folder


@torch.no_grad()
def logprobs(model, ids, n):
    """log p of each of the last n tokens of ids, from one forward pass of ids[:-1] alone."""
    logits, _ = model(torch.tensor([ids[:-1]]))
    logp = F.log_softmax(logits[0, -n:].double(), -1)
    return logp.gather(-1, torch.tensor(ids[-n:])[:, None])[:, 0]


# ----------------------------------------------------------------------------- EvalLM

@pytest.fixture(scope="module")
def lm():
    """A float64 byte-level model with a 32-token context, as lm-eval sees it."""
    model = tiny_model(vocab_size=257, block_size=32, dtype=torch.float64).eval()
    return eval_py.EvalLM(model, get_tokenizer("bytes"), batch_size=4)


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_is_the_models_own_batched_and_truncated(lm):
    """At any batch size, the continuation's log p and greedy match from one unpadded forward pass
    of the pair alone (an empty context is end-of-text; a long one keeps its last block_size + 1
    tokens)."""
    pairs = [("the cat", " sat"), ("a dog ran on the", " mat and then"), ("", "the log"),
             ("then the dog sat under a", " log"), ("the mat", " "),
             ("the dog ran under the log and then the cat sat on a mat", " then")]
    want = []
    for context, continuation in pairs:
        ids = ((lm.tok_encode(context) or [lm.eot_token_id]) + lm.tok_encode(continuation))[-33:]
        n = len(continuation)  # bytes: a token a character
        with torch.no_grad():
            logits = lm.model(torch.tensor([ids[:-1]]))[0][0, -n:].double()
        target = torch.tensor(ids[-n:])
        want.append((F.log_softmax(logits, -1)[range(n), target].sum().item(),
                     bool((logits.argmax(-1) == target).all())))
    for batch_size in (1, 4, 64):
        lm.batch_size = batch_size
        got = lm.loglikelihood(requests("loglikelihood", pairs))
        assert [g for _, g in got] == [w for _, w in want]
        assert max(abs(g - w) for (g, _), (w, _) in zip(got, want)) < 1e-10, batch_size
    lm.batch_size = 4


def test_rolling_loglikelihood_scores_every_token_once_in_lm_evals_windows(lm):
    text = "the cat sat on the mat and then the dog ran under a log. " * 2  # 116 tokens
    tokens = lm.tok_encode(text)
    seq = [lm.eot_token_id] + tokens
    # windows predict [0, 32), [32, 64), [64, 96) from their own tokens, [96, 116) from 32 before
    want = sum(logprobs(lm.model, seq[a:a + 33], 32).sum().item() for a in (0, 32, 64))
    want += logprobs(lm.model, seq[-33:], len(tokens) - 96).sum().item()
    (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert abs(got - want) < 1e-10, (got, want)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(lm):
    prompt = "the cat sat"
    full = lm.model.generate(torch.tensor([lm.tok_encode(prompt)]), 10, temperature=0)
    text = lm.enc.decode(full[0, len(prompt):].tolist())
    stop = text[3:5]
    (got,) = lm.generate_until(requests("generate_until", [(prompt, {"until": [stop],
                                                                     "max_gen_toks": 10})]))
    assert got == text.split(stop)[0] and len(got) < 10, (got, text)


# ----------------------------------------------------------------------------- the script

def test_the_script_from_any_folder_gives_the_perplexity_of_val_bin(trained, data_root, tmp_path):
    """`python lab/eval.py` run from another folder; --ppl is exp(mean NLL) of every token of
    val.bin but the first, once, in windows of block_size (here the first 4, --limit)."""
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, ROOT / "lab" / "eval.py", f"--init_from={trained}",
                           "--tasks=", "--limit=4", "--ppl=tiny", f"--data_root={data_root}",
                           "--batch_size=3", f"--json={out}"], cwd=tmp_path, capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["written_by"] == "eval.py, Depth-Attention"
    model = load_model(trained).model
    tokens = np.fromfile(data_root / "tiny" / "val.bin", dtype=np.uint16).astype(np.int64)
    windows = [tokens[i:i + 33].tolist() for i in range(0, len(tokens) - 1, 32)]
    assert len(tokens) - 1 == sum(len(w) - 1 for w in windows)  # every token but the first, once
    nll = -torch.cat([logprobs(model, w, len(w) - 1) for w in windows[:4]])  # --limit=4
    assert results["ppl"]["tokens"] == len(nll) == 128
    assert results["ppl"]["ppl"] == pytest.approx(nll.mean().exp().item(), rel=1e-5)
    assert f"perplexity {results['ppl']['ppl']:.4f}" in proc.stdout


def test_task_metrics_are_the_models_own_loglikelihoods(trained, tmp_path, monkeypatch, capsys):
    """Multiple choice (acc, acc_norm) and a perplexity task; a relative data_files is read from
    beside the YAML where it is there (the shipped task's), else from the current folder."""
    folder = shutil.copytree(SHIPPED, tmp_path / "tasks")
    (tmp_path / "data").mkdir()
    for where in (folder / "mc.jsonl", tmp_path / "data" / "mc.jsonl"):
        where.write_text("".join(json.dumps(x) + "\n" for x in MC))
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))

    def metrics(*names, aggregation=None):
        return [{"metric": m, "aggregation": aggregation or m, "higher_is_better": True}
                for m in names]

    def task(name, data, **config):  # JSON is YAML
        (folder / f"{name}.yaml").write_text(json.dumps(
            {"task": name, "dataset_path": "json", "test_split": "test",
             "dataset_kwargs": {"data_files": {"test": data}}, **config}))
    mc = dict(output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="choices",
              doc_to_target="answer", metric_list=metrics("acc", "acc_norm", aggregation="mean"))
    task("beside", "mc.jsonl", **mc)
    task("from_cwd", "data/mc.jsonl", **mc)
    task("tiny_ppl", "ppl.jsonl", output_type="loglikelihood_rolling", doc_to_text="",
         doc_to_target="{{text}}", metric_list=metrics("word_perplexity", "byte_perplexity",
                                                       aggregation="weighted_perplexity"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval.json"
    assert main(f"--init_from={trained}", f"--include_path={folder}", f"--limit={len(MC)}",
                "--tasks=beside,from_cwd,tiny_ppl,shakespeare_last_word", f"--json={out}") == 0
    results, stdout = json.loads(out.read_text())["results"], capsys.readouterr().out
    model, enc = load_model(trained).model, get_tokenizer("bytes")
    acc = acc_norm = 0
    for doc in MC:
        ctx = enc.encode(doc["question"])
        lls = [logprobs(model, ctx + enc.encode(" " + c), len(c) + 1).sum().item()
               for c in doc["choices"]]
        acc += int(np.argmax(lls)) == doc["answer"]
        acc_norm += int(np.argmax([ll / len(c) for ll, c in zip(lls, doc["choices"])])) == \
            doc["answer"]
    for name in ("beside", "from_cwd"):
        assert (results[name]["acc,none"], results[name]["acc_norm,none"]) == \
            pytest.approx((acc / len(MC), acc_norm / len(MC)), abs=1e-12)
    assert 0 <= results["shakespeare_last_word"]["acc_norm,none"] <= 1
    line = next(line for line in stdout.splitlines() if line.startswith("beside"))
    assert line.split()[1:3] == [f"{100 * acc / len(MC):.2f}", f"{100 * acc_norm / len(MC):.2f}"]
    ll = sum(logprobs(model, [enc.eot_token] + enc.encode(t), len(t)).sum().item() for t in TEXTS)
    assert results["tiny_ppl"]["word_perplexity,none"] == pytest.approx(
        math.exp(-ll / sum(len(t.split()) for t in TEXTS)), rel=1e-5)
    assert results["tiny_ppl"]["byte_perplexity,none"] == pytest.approx(
        math.exp(-ll / sum(map(len, TEXTS))), rel=1e-5)


def test_a_hub_datasets_files_are_paths_in_its_repository_not_beside_the_yaml(tmp_path):
    from lm_eval.tasks import TaskManager
    (tmp_path / "x.jsonl").write_text("{}\n")
    for name, path in [("hub", "someone/dataset"), ("files", "json")]:
        (tmp_path / f"{name}.yaml").write_text(json.dumps(
            {"task": name, "dataset_path": path, "test_split": "test",
             "dataset_kwargs": {"data_files": {"test": "x.jsonl"}}}))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    eval_py.read_data_beside_task_files(manager, str(tmp_path))
    read = manager._factory._load_full_config  # private in lm-eval 0.4.13: fails if renamed
    assert read(manager.task_index["hub"])["dataset_kwargs"]["data_files"] == {"test": "x.jsonl"}
    assert read(manager.task_index["files"])["dataset_kwargs"]["data_files"] == \
        {"test": str(tmp_path / "x.jsonl")}


def test_the_papers_eight_tasks_go_to_lm_eval_and_their_table_beside_table_1(
        trained, tmp_path, monkeypatch, capsys):
    """The default --tasks, --num_fewshot and --limit reach lm-eval as given (its results made up
    here: the real tasks download); two averages, the paper's beside them, and --json."""
    asked = {}
    accs = dict(zip(eval_py.PAPER_TASKS, (0.4, 0.6, 0.5, 0.8, 0.3, 0.55, 0.25, 0.33)))
    norm = {"piqa": 0.62, "sciq": 0.7, "hellaswag": 0.35, "arc_easy": 0.5, "arc_challenge": 0.28}
    made_up = {"results": {t: {"alias": t, "acc,none": a, "acc_stderr,none": 0.01,
                               **({"acc_norm,none": norm[t]} if t in norm else {})}
                           for t, a in accs.items()}}
    made_up["results"]["lambada_openai"]["perplexity,none"] = 20.5
    monkeypatch.setattr(eval_py, "build_tasks", lambda names, path: ("manager", names))
    monkeypatch.setattr(eval_py.lm_eval, "simple_evaluate",
                        lambda lm, **kwargs: asked.update(kwargs) or made_up)
    out = tmp_path / "eval.json"
    assert main(f"--init_from={trained}", "--num_fewshot=5", "--limit=0.5", f"--json={out}") == 0
    assert (asked["tasks"], asked["num_fewshot"], asked["limit"], asked["task_manager"]) == \
        (list(eval_py.PAPER_TASKS), 5, 0.5, "manager")
    assert json.loads(out.read_text()) == {"written_by": "eval.py, Depth-Attention", **made_up}
    stdout = capsys.readouterr().out
    mean_acc = 100 * sum(accs.values()) / 8
    mean_norm = 100 * sum(norm.get(t, a) for t, a in accs.items()) / 8
    assert f"average, acc{mean_acc:>16.2f}" in stdout
    assert f"average, acc_norm{mean_norm:>21.2f}" in stdout
    assert "lambada_openai         40.00         -  perplexity 20.5" in stdout
    assert "5-shot average (this run: --limit, a subset): 1.5B vanilla 51.65" in stdout
    eval_py.print_table({"ppl": {"dataset": "data/pile", "windows": 3, "tokens": 6141,
                                 "nll": 2.0, "ppl": math.exp(2.0)}}, 0, False)
    stdout = capsys.readouterr().out
    assert "perplexity 7.3891 (mean NLL 2.0000 over 6,141 tokens of data/pile/val.bin" in stdout
    assert "Pile validation perplexity (GPT-NeoX tokens): 1.5B vanilla 8.17" in stdout


def test_globs_select_every_single_task_that_matches(trained, tmp_path, local_tasks_only):
    """A group the glob matches too is left out: its task would run twice, which lm-eval
    refuses."""
    folder = write_task(tmp_path / "tasks")
    write_task(folder, DOCS[:2], name="shakespeare_short")
    (folder / "shakespeare_group.yaml").write_text(
        "group: shakespeare_group\ntask: [shakespeare_last_word]\n")
    out = tmp_path / "eval.json"
    assert main(f"--init_from={trained}", f"--include_path={folder}", "--tasks=shakespeare_*",
                f"--json={out}") == 0
    assert sorted(json.loads(out.read_text())["results"]) == ["shakespeare_last_word",
                                                              "shakespeare_short"]


# ----------------------------------------------------------------------------- --json, Ctrl-C

def test_json_replaces_only_an_earlier_result_and_an_interrupt_keeps_it_whole(
        trained, data_root, tmp_path, monkeypatch, capsys):
    """--json=out/RUN/ckpt.pt, a slip of tab completion, would have overwritten the checkpoint;
    another program's JSON is kept, whatever its keys; an earlier result is replaced, and an
    interrupted run (scoring, or half the file written) leaves it whole: one line, exit 130."""
    args = [f"--init_from={trained}", "--tasks=", "--ppl=tiny", f"--data_root={data_root}"]
    theirs = tmp_path / "theirs.json"
    theirs.write_text('{"results": {"arc_easy": 0.5}, "ppl": 3.0}')
    for foreign in (trained / "ckpt.pt", theirs):
        before = foreign.read_bytes()
        code, line = main(*args, f"--json={foreign}", capsys=capsys)
        assert code == 2 and "exists and was not written by eval.py" in line, line
        assert foreign.read_bytes() == before
    out = tmp_path / "eval.json"
    for limit in (1, 3):
        assert main(*args, f"--limit={limit}", f"--json={out}") == 0
        assert json.loads(out.read_text())["ppl"]["windows"] == limit
    before = out.read_text()
    write_bytes = Path.write_bytes

    def torn(self, data):  # the interrupt lands once half of the text is on disk
        write_bytes(self, data[:len(data) // 2])
        raise KeyboardInterrupt

    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    for target, name, interrupt in [(eval_py, "perplexity", stop), (Path, "write_bytes", torn)]:
        with monkeypatch.context() as m:
            m.setattr(target, name, interrupt)
            assert main(*args, f"--json={out}", capsys=capsys) == (130, "interrupted")
        assert out.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "theirs.json"]


# ----------------------------------------------------------------------------- bad input

def break_task(case, folder):
    """A copy of the shipped task with one fault."""
    if case == "malformed jsonl":
        return write_task(folder, json.dumps(DOCS[0]) + '\n{"context": "To be", "choices": [\n')
    if case == "missing field":
        return write_task(folder, edit=lambda y: y.replace("{{context}}", "{{prompt}}"))
    if case == "malformed yaml":
        return write_task(folder, edit=lambda y: y.replace("multiple_choice", "[multiple"))
    if case == "bad document":  # every line JSON, one's choices numbers: lm-eval's metrics stop
        return write_task(folder, [*DOCS[:2], {**DOCS[2], "choices": [1, 2, 3, 4]}])
    if case == "long answer":
        return write_task(folder, [{**DOCS[0], "choices": ["x" * 40, "to", "be", "or"]}])
    return write_task(folder)


def other_tokenizer(tmp_path):
    """A checkpoint whose tokenizer.json is not the data's bytes, with ids within its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, **{
        f"w{i}": i for i in range(2, 300)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    model = tiny_model(vocab_size=300, block_size=32)
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0,
                     "tokenizer": str(tmp_path / "tokenizer.json")}, tmp_path / "ckpt.pt")
    return tmp_path


def damaged_data(data_root, tmp_path, damage):
    shutil.copytree(data_root / "tiny", tmp_path / "tiny")
    damage(tmp_path / "tiny")
    return tmp_path


def id_beyond_the_vocabulary(folder):
    tokens = np.fromfile(folder / "val.bin", dtype=np.uint16)
    tokens[len(tokens) // 2] = 300  # the file no longer matches its meta.json (bytes: 257 ids)
    tokens.tofile(folder / "val.bin")


def out_of_memory(*args, **kwargs):
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8e11 "
                       "bytes")


TASK = ["--tasks=shakespeare_last_word"]
PPL = ["--tasks=", "--ppl=tiny"]
# (case, its arguments and any (target, name, value) to patch, the error line's fragment, whether
# it shows before the model loads). In the arguments and the fragment {trained} is the checkpoint,
# {tmp} the test's folder, {data} conftest's data_root, {tasks} the folder break_task writes,
# {other} other_tokenizer's checkpoint, {big_id} and {bad_meta} a damaged copy of data_root.
BAD = [
    ("no init_from", ["--tasks="], "give --init_from", True),
    ("nothing to do", ["--init_from={trained}", "--tasks="], "nothing to evaluate", True),
    ("out of range", ["--init_from={trained}", *PPL, "--limit=0"],
     "--limit must be a finite number > 0, got 0.0", True),
    ("not whole", ["--init_from={trained}", *PPL, "--limit=2.5"],
     "--limit=2.5: give a whole number of examples, or a fraction below 1", True),
    ("wrong type", ["--init_from={trained}", *PPL, "--num_fewshot=1e3"],
     "--num_fewshot: expected int like the default 0, got 1000.0", True),
    ("unknown key", ["--init_from={trained}", *PPL, "--num_fewshots=5"],
     "unknown key 'num_fewshots'; did you mean --num_fewshot?", True),
    ("no gpu", ["--init_from={trained}", *PPL, "--device=cuda", (torch.cuda, "is_available",
                                                                 lambda: False)],
     "--device=cuda is not a choice", True),
    ("json a folder", ["--init_from={trained}", *PPL, "--json={tmp}"], "--json={tmp} is a folder",
     True),
    ("no lm-eval", ["--init_from={trained}", (eval_py, "lm_eval", None)],
     "the downstream tasks need lm-evaluation-harness: pip install lm-eval", True),
    ("no include_path", ["--init_from={trained}", *TASK, "--include_path={tmp}/none"],
     "--include_path {tmp}/none is not a folder of task YAML files", True),
    ("no checkpoint", ["--init_from={tmp}/none", "--tasks=no_such_task"],
     "no checkpoint at {tmp}/none; train one with `python train.py`", True),
    ("not a checkpoint", ["--init_from={data}/tiny/val.bin", *PPL], "is not a readable checkpoint",
     False),
    ("no data", ["--init_from={trained}", *PPL, "--data_root={tmp}"],
     "{tmp}/tiny/meta.json not found: run `python prepare_data.py", True),
    ("bad meta.json", ["--init_from={trained}", *PPL, "--data_root={bad_meta}"],
     "{bad_meta}/tiny/meta.json is not a valid prepare_data.py output", True),
    ("ids beyond the vocabulary", ["--init_from={trained}", *PPL, "--data_root={big_id}"],
     "val.bin holds token id 300, beyond the model's vocab_size 257", False),
    ("another tokenizer", ["--init_from={other}", *PPL], "tiny was tokenized with bytes, but "
     "{other} uses {other}/tokenizer.json, so its perplexity would mean nothing; prepare the data "
     "with the model's tokenizer (prepare_data.py SOURCE --tokenizer={other}/tokenizer.json",
     False),
    ("unknown task", ["--init_from={trained}", "--tasks=shakespeare_last_word,no_such_task",
                      "--include_path={tasks}"], "unknown task(s) no_such_task: list lm-eval's",
     True),
    ("no glob match", ["--init_from={trained}", "--tasks=nothing_*", "--include_path={tasks}"],
     "unknown task(s) nothing_*", True),
    ("malformed yaml", ["--init_from={trained}", *TASK, "--include_path={tasks}"],
     "unknown task(s) shakespeare_last_word; lm-eval left out these task files of "
     "--include_path, which it could not read: {tasks}/shakespeare_last_word.yaml", True),
    ("malformed jsonl", ["--init_from={trained}", *TASK, "--include_path={tasks}"],
     "error: task shakespeare_last_word ({tasks}/shakespeare_last_word.yaml): "
     "DatasetGenerationError: An error occurred while generating the dataset", True),
    ("missing field", ["--init_from={trained}", *TASK, "--include_path={tasks}"],
     "({tasks}/shakespeare_last_word.yaml): UndefinedError: 'prompt' is undefined", True),
    ("bad document", ["--init_from={trained}", *TASK, "--include_path={tasks}"],
     "lm-eval stopped on --tasks (--num_fewshot=0): TypeError", False),
    ("too many shots", ["--init_from={trained}", *TASK, "--include_path={tasks}",
                        "--num_fewshot=5"],
     "(--num_fewshot=5): ValueError: Sample larger than population", False),
    ("long answer", ["--init_from={trained}", *TASK, "--include_path={tasks}"],
     "a task's answer of 41 tokens does not fit the model's context of 32 tokens", False),
    ("out of memory", ["--init_from={trained}", *PPL, "--batch_size=100000",
                       (eval_py, "token_logprobs", out_of_memory)],
     "out of memory scoring 100000 sequences of up to 32 tokens at once; lower --batch_size",
     False),
]


@pytest.mark.parametrize("case, argv, fragment, before_loading", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_error_line(case, argv, fragment, before_loading, trained, data_root,
                                     tmp_path, monkeypatch, capsys, local_tasks_only):
    """Our line naming the fix, or lm-eval's words after the task and its file; before the model
    loads wherever the fault shows without it. Never a traceback."""
    if before_loading:
        monkeypatch.setattr(eval_py, "load_model", lambda *a: pytest.fail("loaded the model"))
    for patch in [a for a in argv if isinstance(a, tuple)]:
        monkeypatch.setattr(*patch)
    made = {"tasks": lambda: break_task(case, tmp_path / "tasks"),
            "other": lambda: other_tokenizer(tmp_path),
            "big_id": lambda: damaged_data(data_root, tmp_path, id_beyond_the_vocabulary),
            "bad_meta": lambda: damaged_data(data_root, tmp_path, lambda d: (
                d / "meta.json").write_text('{"tokenizer": '))}
    args = [a for a in argv if isinstance(a, str)]
    names = {"trained": trained, "tmp": tmp_path, "data": data_root,
             **{k: make() for k, make in made.items() if f"{{{k}}}" in " ".join(args)}}
    args = [a.format(**names) for a in args]
    if "--data_root" not in str(args):
        args.append(f"--data_root={data_root}")
    code, line = main(*args, capsys=capsys)
    assert code == 2 and line.startswith("error: ") and fragment.format(**names) in line, line


def test_a_bug_of_ours_under_lm_eval_stays_a_traceback(trained, tmp_path, monkeypatch):
    """lm-eval's errors are one line; what EvalLM's code raises (not a user error) is not."""
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(eval_py, "token_logprobs", bug)
    with pytest.raises(ZeroDivisionError):
        main(f"--init_from={trained}", f"--include_path={write_task(tmp_path / 'tasks')}", *TASK)


# ----------------------------------------------------------------------------- offline

def cache_as_hub_dataset(repo, docs, tmp_path):
    """docs in the datasets cache as a Hub dataset's test split downloaded earlier: the layout
    datasets reads offline (<owner>___<name>/<config>/<version>/<commit>/<name>-test.arrow)."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    datasets.load_dataset("json", data_files={"test": str(data)}, cache_dir=str(tmp_path / "build"))
    built, = (d for d in (tmp_path / "build" / "json").glob("*/0.0.0/*") if d.is_dir())
    owner, name = repo.split("/")
    commit = Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{name}" / "default" / \
        "0.0.0" / "0123456789abcdef"
    commit.mkdir(parents=True)
    for f in built.iterdir():
        if f.suffix in (".arrow", ".json"):
            shutil.copy(f, commit / f.name.replace("json-", f"{name}-"))


def test_offline_cached_tasks_run_and_the_rest_are_named_at_once_with_the_fix(
        trained, tmp_path, monkeypatch, capsys, local_tasks_only):
    """Offline by choice (HF_DATASETS_OFFLINE=1), or the Hub refusing the one probe: the tasks
    whose data is cached run, the others are named together in one line, no download tried
    (datasets retries each for ~25 s)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    cache_as_hub_dataset("eval_py_test/cached", DOCS, tmp_path)
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name in ("cached", "gone", "lost"):  # the shipped task's fields over a Hub dataset
        (folder / f"{name}.yaml").write_text(json.dumps(
            {"task": name, "dataset_path": f"eval_py_test/{name}", "test_split": "test",
             "output_type": "multiple_choice", "doc_to_text": "{{context}}",
             "doc_to_choice": "choices", "doc_to_target": "answer", "metric_list": [
                 {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    out = tmp_path / "eval.json"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(f"--init_from={trained}", f"--include_path={folder}", "--tasks=cached",
                f"--json={out}") == 0
    assert json.loads(out.read_text())["results"]["cached"]["acc,none"] >= 0
    code, line = main(f"--init_from={trained}", f"--include_path={folder}",
                      "--tasks=gone,cached,lost", capsys=capsys)
    assert code == 2 and line.startswith(
        "error: task(s) gone, lost: their data is on the Hugging Face Hub, but datasets is in "
        "offline mode (HF_DATASETS_OFFLINE=1; unset to download), and it is not in the datasets "
        f"cache ({tmp_path / 'hf'}): run once with network access"), line
    assert "--include_path" in line

    knocks = []

    def knock(sock, address):  # refused, as by a Hub out of reach
        knocks.append(address)
        raise ConnectionRefusedError(address)
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(socket.socket, "connect", knock)
    code, line = main(f"--init_from={trained}", f"--include_path={folder}", "--tasks=gone,cached",
                      capsys=capsys)
    assert knocks == [("127.0.0.1", 9)], f"more than the probe: {knocks}"
    assert line.startswith("error: task(s) gone: their data is on the Hugging Face Hub, but "
                           "http://127.0.0.1:9 is out of reach (ConnectionRefusedError"), line
    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE


def test_the_probe_calls_out_of_reach_only_what_has_no_answer(monkeypatch):
    """Any HTTP answer, an error status too, means try the Hub; a refused or silent connection
    does not: the probe must never stop a run that could download."""
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT",
                            f"http://127.0.0.1:{server.server_port}")
        assert eval_py.hub_out_of_reach(timeout=300) is None  # late under load, but an answer
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    assert "out of reach (ConnectionRefusedError" in eval_py.hub_out_of_reach()

    def silent(*args, **kwargs):
        raise urllib.error.URLError(TimeoutError("timed out"))
    monkeypatch.setattr(urllib.request, "urlopen", silent)
    assert eval_py.hub_out_of_reach().endswith("out of reach (no connection within 3 s)")
