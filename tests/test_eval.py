"""eval.py: the lm-eval adapter's scores against direct forward passes of the model, and eval.py end
to end on a checkpoint in train.py's format with task files written by the test (lm-eval's
`dataset_path: json`), offline. lm-eval is optional for users; requirements-dev.txt (and so .ci/run)
installs it."""
import http.server
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from conftest import tiny_model
import eval as eval_py
from support import eval_tasks
from support.checkpoint import load_model
from support.tokenizer import get_tokenizer
from support.errors import USER_ERRORS
from helpers import ROOT, WORDS, local_tasks_only, trained  # noqa: F401 (fixtures)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@torch.no_grad()
def logprobs(model, ids, n):
    """Direct: log p of each of the last n tokens of ids, from one forward pass of ids[:-1]
    alone."""
    logits, _ = model(torch.tensor([ids[:-1]]))
    return F.log_softmax(logits[0, -n:].double(), -1).gather(-1, torch.tensor(ids[-n:])[:, None])[:,
                                                                                                  0]


# ----------------------------------------------------------------------------- the adapter, in
# process

@pytest.fixture(scope="module")
def lm():
    """A float64 byte-level model with a 32-token context, wrapped as lm-eval sees it."""
    model = tiny_model(vocab_size=257, block_size=32, dtype=torch.float64).eval()
    return eval_py.EvalLM(model, get_tokenizer("bytes"), batch_size=4)


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [("the cat", " sat"), ("a dog ran on the", " mat and then"), ("x", " y"), ("", "the log"),
         ("then the dog sat under a", " log"), ("on", " the mat"), ("the mat", " ")]


def test_loglikelihood_equals_the_model_token_by_token(lm):
    """Each continuation token scored alone: a forward pass of exactly the tokens before it."""
    enc = lm.enc
    for (context, continuation), (got, greedy) in zip(PAIRS,
                                                      lm.loglikelihood(requests("loglikelihood",
                                                                                PAIRS))):
        # lm-eval conditions an empty context on end-of-text
        ctx = enc.encode(context) or [enc.eot_token]
        ids = ctx + enc.encode(continuation)
        steps = [lm.model(torch.tensor([ids[:t]]))[0][0, -1].double() for t in range(len(ctx),
                                                                                     len(ids))]
        want = sum(F.log_softmax(s, -1)[ids[t + len(ctx)]].item() for t, s in enumerate(steps))
        assert abs(got - want) < 1e-10, f"{context!r} + {continuation!r}: {got} vs {want}"
        assert greedy == all(s.argmax().item() == ids[t + len(ctx)] for t, s in enumerate(steps))


def test_batching_and_padding_change_no_score(lm):
    rng = random.Random(0)
    pairs = [(" ".join(rng.choices(WORDS, k=rng.randint(1, 4))), " " + rng.choice(WORDS))
             for _ in range(23)]
    alone = [logprobs(lm.model, lm.tok_encode(c + x), len(lm.tok_encode(x))).sum().item() for c,
             x in pairs]
    for batch_size in (1, 5, 64):
        lm.batch_size = batch_size
        got = [ll for ll, _ in lm.loglikelihood(requests("loglikelihood", pairs))]
        diff = max(abs(a - b) for a, b in zip(got, alone))
        assert diff < 1e-12, f"batch_size {batch_size}: scores differ from one unpadded pass by up to {diff:.2e}"
    lm.batch_size = 4


def test_an_over_long_context_is_left_truncated_exactly(lm):
    context, continuation = "the dog ran under the log and then the cat sat on a mat", " then"
    ids = lm.tok_encode(context + continuation)
    assert len(ids) > 33
    (got, _), = lm.loglikelihood(requests("loglikelihood", [(context, continuation)]))
    # the last block_size + 1 tokens, 5 of them scored
    want = logprobs(lm.model, ids[-33:], 5).sum().item()
    assert abs(got - want) < 1e-12, (got, want)


def test_rolling_loglikelihood_scores_every_token_once_in_lm_evals_windows(lm):
    # 116 tokens: 4 windows of 32
    text = "the cat sat on the mat and then the dog ran under a log. " * 2
    tokens = lm.tok_encode(text)
    seq = [lm.eot_token_id] + tokens
    # Windows predict tokens [0, 32), [32, 64), [64, 96) from their own 32 tokens; the last one,
    # [96, 116), from a full context of 32 (lm-eval's rolling rule).
    want = sum(logprobs(lm.model, seq[a:a + 33], 32).sum().item() for a in (0, 32, 64))
    want += logprobs(lm.model, seq[-33:], len(tokens) - 96).sum().item()
    (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert abs(got - want) < 1e-10, (got, want)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(lm):
    prompt = "the cat sat"
    full = lm.model.generate(torch.tensor([lm.tok_encode(prompt)]), 10, temperature=0)[0,
                                                                                       len(prompt):]
    text = lm.tok_decode(full.tolist())
    stop = text[3:5]
    (got,) = lm.generate_until(requests("generate_until", [(prompt, {"until": [stop],
                                                                     "max_gen_toks": 10})]))
    assert got == text.split(stop)[0] and len(got) < 10, (got, text)


# ----------------------------------------------------------------------------- eval.py end to end

@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two lm-eval tasks on local JSON lines: multiple choice (acc, acc_norm) and a perplexity
    task."""
    d = tmp_path_factory.mktemp("tasks")
    rng = random.Random(1)
    mc = []
    for _ in range(12):
        words = rng.choices(WORDS, k=rng.randint(2, 4))
        choices = [rng.choice(WORDS) for _ in range(3)]
        mc.append({"question": " ".join(words), "choices": choices, "answer": rng.randrange(3)})
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 5))) + "." for _ in range(6)]
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in mc))
    (d / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def metrics(*names, aggregation=None):
        return [{"metric": m, "aggregation": aggregation or m,
                 "higher_is_better": aggregation == "mean"} for m in names]

    def task(name, data, **config):  # JSON is YAML: these files are what a user writes by hand
        (d / f"{name}.yaml").write_text(json.dumps({"task": name, "dataset_path": "json",
                                                    "test_split": "test",
                                                    "dataset_kwargs": {"data_files": {"test": str(d / data)}},
                                                    **config}, indent=1))

    task("tiny_mc", "mc.jsonl", output_type="multiple_choice", doc_to_text="{{question}}",
         doc_to_choice="choices", doc_to_target="answer", metric_list=metrics("acc", "acc_norm",
                                                                              aggregation="mean"))
    task("tiny_ppl", "ppl.jsonl", output_type="loglikelihood_rolling", doc_to_text="",
         doc_to_target="{{text}}", metric_list=metrics("word_perplexity", "byte_perplexity",
                                                       aggregation="weighted_perplexity") + metrics("bits_per_byte"))
    return d, mc, texts


@pytest.fixture(scope="module")
def evaluated(trained, task_dir, data_root, tmp_path_factory):
    """One eval.py run: both local tasks and --ppl, as a user would type it."""
    out = tmp_path_factory.mktemp("eval_out")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(out / "hf"), **OFFLINE}
    proc = subprocess.run([sys.executable, "eval.py", f"--init_from={trained}",
                           "--tasks=tiny_mc,tiny_ppl", f"--include_path={task_dir[0]}",
                           "--ppl=tiny", f"--data_root={data_root}", "--batch_size=5",
                           f"--json={out / 'results.json'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), proc.stdout, load_model(trained).model


def test_multiple_choice_accuracy_equals_the_models_own_loglikelihoods(evaluated, task_dir):
    results, stdout, model = evaluated
    enc = get_tokenizer("bytes")
    acc = acc_norm = 0
    for doc in task_dir[1]:
        ctx = enc.encode(doc["question"])
        lls = [logprobs(model, ctx + enc.encode(" " + c), len(c) + 1).sum().item()
               for c in doc["choices"]]
        acc += int(np.argmax(lls)) == doc["answer"]
        acc_norm += int(np.argmax([ll / len(c) for ll, c in zip(lls,
                                                                doc["choices"])])) == doc["answer"]
    n = len(task_dir[1])
    got = results["results"]["tiny_mc"]
    assert (got["acc,none"], got["acc_norm,none"]) == pytest.approx((acc / n, acc_norm / n),
                                                                    abs=1e-12)
    line = next(l for l in stdout.splitlines() if l.startswith("tiny_mc"))
    assert line.split()[1:3] == [f"{100 * acc / n:.2f}", f"{100 * acc_norm / n:.2f}"], stdout
    assert "average, acc " in stdout and "average, acc_norm" in stdout


def test_perplexity_task_equals_the_models_own_loglikelihoods(evaluated, task_dir):
    results, _, model = evaluated
    enc = get_tokenizer("bytes")
    texts = task_dir[2]
    ll = sum(logprobs(model, [enc.eot_token] + enc.encode(t), len(t)).sum().item() for t in texts)
    n_bytes, n_words = sum(len(t) for t in texts), sum(len(t.split()) for t in texts)
    got = results["results"]["tiny_ppl"]
    assert got["word_perplexity,none"] == pytest.approx(math.exp(-ll / n_words), rel=1e-5)
    assert got["byte_perplexity,none"] == pytest.approx(math.exp(-ll / n_bytes), rel=1e-5)
    assert got["bits_per_byte,none"] == pytest.approx(-ll / n_bytes / math.log(2), rel=1e-5)


def test_ppl_is_exp_mean_token_nll_of_val_bin(evaluated, data_root):
    results, stdout, model = evaluated
    tokens = np.fromfile(data_root / "tiny" / "val.bin", dtype=np.uint16).astype(np.int64)
    T = model.config.block_size
    nll = [-logprobs(model, tokens[i:i + T + 1].tolist(), len(tokens[i:i + T + 1]) - 1)
           for i in range(0, len(tokens) - 1, T)]
    nll = torch.cat(nll)
    assert len(nll) == len(tokens) - 1  # every token but the first, once
    got = results["ppl"]
    assert got["tokens"] == len(nll) and got["ppl"] == pytest.approx(nll.mean().exp().item(),
                                                                     rel=1e-5)
    assert f"perplexity {got['ppl']:.4f}" in stdout


# ----------------------------------------------------------------------------- the command line

def test_help_documents_every_flag(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as e:
            eval_py.main([flag])
        assert e.value.code == 0
    text = capsys.readouterr().out
    for name in ("init_from", "tasks", "num_fewshot", "limit", "batch_size", "device",
                 "include_path", "json", "ppl", "data_root"):
        assert f"--{name}" in text
    # the examples of the docstring
    assert "python eval.py --init_from=out/RUN --num_fewshot=5" in text


@pytest.mark.parametrize("args, message", [
    (["--tasks=tiny_mc,no_such_task"], "unknown task(s) no_such_task: list lm-eval's tasks"),
    (["--tasks=", "--ppl=absent"], "absent/meta.json not found: run `python prepare_data.py"),
    (["--tasks=", "--ppl=tiny", "--init_from=nowhere"], "no checkpoint at nowhere; train one"),
    (["--tasks="], "nothing to evaluate"),
    (["--include_path=nowhere"], "--include_path nowhere is not a folder"),
])
def test_bad_inputs_fail_with_one_line(args, message, trained, task_dir, data_root,
                                       local_tasks_only):
    with pytest.raises(USER_ERRORS) as e:
        eval_py.main([f"--init_from={trained}", f"--include_path={task_dir[0]}",
                      f"--data_root={data_root}", *args])
    assert message in str(e.value) and "\n" not in str(e.value), e.value


def test_missing_lm_eval_names_the_install(monkeypatch, trained):
    monkeypatch.setattr(eval_py, "lm_eval", None)
    with pytest.raises(USER_ERRORS, match="the downstream tasks need lm-evaluation-harness: pip install lm-eval"):
        eval_py.main([f"--init_from={trained}"])


def test_table_gives_both_averages_beside_the_papers(capsys):
    accs = dict(zip(eval_py.PAPER_TASKS, (0.4, 0.6, 0.5, 0.8, 0.3, 0.55, 0.25, 0.33)))
    norm = {"piqa": 0.62, "sciq": 0.7, "hellaswag": 0.35, "arc_easy": 0.5, "arc_challenge": 0.28}
    results = {"results": {t: {"alias": t, "acc,none": a, "acc_stderr,none": 0.01,
                               **({"acc_norm,none": norm[t]} if t in norm else {})} for t,
                           a in accs.items()}}
    results["results"]["lambada_openai"]["perplexity,none"] = 20.5
    results["ppl"] = {"dataset": "data/pile", "windows": 3, "tokens": 6141, "nll": 2.0,
                      "ppl": math.exp(2.0)}
    eval_py.print_table(results, 5, limited=False)
    out = capsys.readouterr().out
    mean_acc = 100 * sum(accs.values()) / 8
    mean_best = 100 * sum(norm.get(t, a) for t, a in accs.items()) / 8
    assert f"average, acc{mean_acc:>16.2f}" in out and f"average, acc_norm{mean_best:>21.2f}" in out, out
    assert "lambada_openai         40.00         -  perplexity 20.5" in out
    assert "paper, Table 1, 5-shot average: 1.5B vanilla 51.65" in out and "3B Depth-Attention 56.17" in out
    assert "perplexity 7.3891 (mean NLL 2.0000 over 6,141 tokens of data/pile/val.bin" in out
    assert "Pile validation perplexity (GPT-NeoX tokens): 1.5B vanilla 8.17" in out


# ----------------------------------------------------------------------------- the task data: local
# files beside their YAML, the Hub out of reach

SHIPPED = ROOT / "docs" / "eval_tasks"


@pytest.mark.parametrize("cwd, include_path", [("elsewhere", str(SHIPPED)), ("docs", "eval_tasks")],
                         ids=["from a temporary folder", "from docs/, a relative --include_path"])
def test_the_shipped_local_task_runs_from_any_folder(cwd, include_path, trained, tmp_path):
    """docs/eval_tasks names its data relative to the YAML; lm-eval alone reads it from the current
    folder, eval.py from the YAML's."""
    out = tmp_path / "eval.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"),
           **OFFLINE}
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), f"--init_from={trained}",
                           f"--include_path={include_path}", "--tasks=shakespeare_last_word",
                           "--limit=4", f"--json={out}"],
                          cwd=tmp_path if cwd == "elsewhere" else ROOT / cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "acc,none" in json.loads(out.read_text())["results"]["shakespeare_last_word"]


def test_relative_data_files_beside_the_yaml_else_in_the_current_folder(
        trained, task_dir, tmp_path, monkeypatch, hub_cache, local_tasks_only):
    """A user's task written against the current folder runs as before; one with its data beside
    it runs from anywhere; neither asks the Hub anything (no probe: the data is local)."""
    monkeypatch.setattr(eval_tasks, "hub_unreachable", lambda *a: pytest.fail("probed the Hub"))
    folder, data = tmp_path / "tasks", tmp_path / "data"
    folder.mkdir()
    data.mkdir()
    (data / "mc.jsonl").write_text((task_dir[0] / "mc.jsonl").read_text())
    (folder / "mc.jsonl").write_text((task_dir[0] / "mc.jsonl").read_text())
    yaml = json.loads((task_dir[0] / "tiny_mc.yaml").read_text())
    for name, path in [("from_cwd", "data/mc.jsonl"), ("beside", "mc.jsonl")]:
        (folder / f"{name}.yaml").write_text(json.dumps(
            {**yaml, "task": name, "dataset_kwargs": {"data_files": {"test": path}}}))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval.json"
    eval_py.main([f"--init_from={trained}", f"--include_path={folder}", "--tasks=from_cwd,beside",
                  "--limit=3", f"--json={out}"])
    results = json.loads(out.read_text())["results"]
    assert results["from_cwd"]["acc,none"] == results["beside"]["acc,none"]


def test_a_hub_datasets_files_are_paths_in_its_repository_not_beside_the_yaml(tmp_path):
    """data_files of a Hub dataset name files in its repository: a file of that name beside the
    YAML changes nothing; a builder of local files (json) reads it from beside the YAML."""
    from lm_eval.tasks import TaskManager
    (tmp_path / "x.jsonl").write_text("{}\n")
    for name, path in [("hub", "someone/dataset"), ("files", "json")]:
        (tmp_path / f"{name}.yaml").write_text(json.dumps(
            {"task": name, "dataset_path": path, "test_split": "test",
             "dataset_kwargs": {"data_files": {"test": "x.jsonl"}}}))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    eval_tasks.read_data_beside_task_files(manager, str(tmp_path))
    # the config step support/eval_tasks.py wraps (private in lm-eval 0.4.13): this fails if
    # lm-eval renames it
    read = manager._factory._load_full_config
    assert read(manager.task_index["hub"])["dataset_kwargs"]["data_files"] == {"test": "x.jsonl"}
    assert read(manager.task_index["files"])["dataset_kwargs"]["data_files"] == \
        {"test": str(tmp_path / "x.jsonl")}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty datasets cache of the test's own, and datasets out of offline mode whatever the
    environment says: what eval.py decides from its probe is what is tested."""
    import datasets.config
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for variable in eval_tasks.OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return tmp_path / "hf"


def test_offline_the_default_tasks_fail_fast_naming_each_and_the_fix(trained, tmp_path):
    """HF_DATASETS_OFFLINE=1 and an empty cache: the paper's eight tasks (all on the Hub) named in
    one line with the fix, not the first one alone."""
    # Fast is no download tried (datasets retries each for ~25 s), counted where it would go and
    # not timed: a loaded machine takes its time over the imports alone.
    hub = socket.create_server(("127.0.0.1", 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"),
           "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}", "NO_PROXY": "127.0.0.1",
           **OFFLINE}
    proc = subprocess.run([sys.executable, "eval.py", f"--init_from={trained}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    hub.setblocking(False)
    with hub, pytest.raises(BlockingIOError):  # the kernel queued any connection tried
        hub.accept()
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert line.startswith(f"error: task(s) {', '.join(eval_py.PAPER_TASKS)}: their data is on "
                           f"the Hugging Face Hub, but datasets is in offline mode "
                           f"(HF_DATASETS_OFFLINE=1"), line
    assert f"not in the datasets cache ({tmp_path / 'hf'})" in line
    assert "run once with network access" in line and "--include_path" in line
    assert "Retrying" not in proc.stderr


def hub_task(folder, name, repo):
    """A task YAML over a Hub dataset `repo` (multiple choice, the shipped task's fields)."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(json.dumps(
        {"task": name, "dataset_path": repo, "test_split": "test", "output_type": "multiple_choice",
         "doc_to_text": "{{context}}", "doc_to_choice": "choices", "doc_to_target": "answer",
         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    return folder


def cache_as_hub_dataset(cache, repo, docs, tmp_path):
    """docs in the datasets cache as a Hub dataset's test split downloaded earlier: the layout
    datasets reads offline (<owner>___<name>/<config>/<version>/<commit>/<name>-test.arrow)."""
    import datasets
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    datasets.load_dataset("json", data_files={"test": str(data)}, cache_dir=str(tmp_path / "build"))
    built, = (d for d in (tmp_path / "build" / "json").glob("*/0.0.0/*") if d.is_dir())
    owner, name = repo.split("/")
    commit = cache / f"{owner}___{name}" / "default" / "0.0.0" / "0123456789abcdef"
    commit.mkdir(parents=True)
    for f in built.iterdir():
        if f.suffix in (".arrow", ".json"):
            shutil.copy(f, commit / f.name.replace("json-", f"{name}-"))


def test_out_of_reach_the_hub_is_probed_once_and_cached_data_still_loads(
        trained, tmp_path, hub_cache, local_tasks_only, monkeypatch, capsys):
    """The probe decides only between trying the Hub and datasets' offline mode: a cached dataset
    runs as online, one not cached is one line within seconds, not after datasets' retries."""
    probes = []
    monkeypatch.setattr(eval_tasks, "hub_unreachable", lambda endpoint: probes.append(endpoint)
                        or "simulated")
    docs = [json.loads(line) for line in (SHIPPED / "shakespeare_last_word.jsonl").open()][:4]
    cache_as_hub_dataset(hub_cache, "eval_py_test/cached", docs, tmp_path)
    folder = hub_task(hub_task(tmp_path / "tasks", "cached", "eval_py_test/cached"), "gone",
                      "eval_py_test/gone")
    out = tmp_path / "eval.json"
    eval_py.main([f"--init_from={trained}", f"--include_path={folder}", "--tasks=cached",
                  f"--json={out}"])
    assert json.loads(out.read_text())["results"]["cached"]["acc,none"] >= 0
    assert "is out of reach (simulated): the tasks read their data from the datasets cache" in \
        capsys.readouterr().err
    import datasets.config
    import huggingface_hub.constants
    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE

    # one line at once, not after datasets' retries: no connection tried (not a time, which load
    # stretches)
    knocks = []

    def knock(sock, address):  # refused, as by a Hub out of reach
        knocks.append(address)
        raise ConnectionRefusedError(address)
    monkeypatch.setattr(socket.socket, "connect", knock)
    with pytest.raises(USER_ERRORS) as e:
        eval_py.main([f"--init_from={trained}", f"--include_path={folder}",
                      "--tasks=gone,cached"])
    assert knocks == [], f"connections tried: {knocks}"
    assert str(e.value).startswith("task(s) gone: their data is on the Hugging Face Hub, but "
                                   "https://huggingface.co is out of reach (simulated), and it "
                                   f"is not in the datasets cache ({hub_cache}): run once with "
                                   "network access"), e.value
    assert "\n" not in str(e.value) and len(probes) == 2  # once a run
    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE


def test_the_probe_calls_out_of_reach_only_what_has_no_answer(monkeypatch):
    """A closed port and a silent connect are out of reach; any HTTP answer, an error status too,
    is not (the run tries the Hub): the probe must never stop a run that could download."""
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # any answer counts, however late: the probe's 3 s would race this thread under load
        assert eval_tasks.hub_unreachable(f"http://127.0.0.1:{server.server_port}",
                                          timeout=300) is None
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert "ConnectionRefusedError" in eval_tasks.hub_unreachable(f"http://127.0.0.1:{closed}")

    def silent(*args, **kwargs):
        raise urllib.error.URLError(TimeoutError("timed out"))
    monkeypatch.setattr(urllib.request, "urlopen", silent)
    assert eval_tasks.hub_unreachable("https://huggingface.co") == "no connection within 3 s"
