"""eval.py on bad input, as a user meets it: every case ends in one `error:` line, our own naming
the problem and the fix, lm-eval's in its own words after the task and its file, raised before the
model is loaded whenever the problem can be seen without it; never a traceback, a silently wrong
number or a user's file lost. eval.main runs in this process (a subprocess per case would spend
seconds importing lm-eval and torch), on the tiny checkpoint of test_eval.py and copies of the local
task docs/eval_tasks/ cut to a few documents, so no case indexes lm-eval's built-in tasks or touches
the network."""
import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import datasets.config
import numpy as np
import pytest
import torch

from conftest import tiny_model
import eval as eval_py
from support.run_dir import save_checkpoint
from support.errors import USER_ERRORS
from helpers import ROOT, WORDS, local_tasks_only, trained, word_tokenizer  # noqa: F401

TASK = ROOT / "docs" / "eval_tasks" / "shakespeare_last_word.yaml"
DOCS = [json.loads(line)
        for line in (ROOT / "docs" / "eval_tasks" / "shakespeare_last_word.jsonl").open()][:4]


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path_factory, monkeypatch):
    """datasets caches the task data under the test's folder, never in ~/.cache, and never asks the
    Hub."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE",
                        str(tmp_path_factory.getbasetemp() / "hf_datasets"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture
def no_loading(monkeypatch):
    """The model must not be loaded: the case is decidable before."""
    monkeypatch.setattr(eval_py, "load_model",
                        lambda *a, **k: pytest.fail("eval.py loaded the model first"))


def write_task(folder, docs=DOCS, name="shakespeare_last_word", edit=lambda yaml: yaml, data=None):
    """A copy of the shipped task in folder: its YAML (renamed, edited) over docs written as JSON
    lines."""
    folder.mkdir(exist_ok=True)
    data = data or folder / f"{name}.jsonl"
    if docs is not None:
        data.write_text(docs if isinstance(docs, str) else "".join(json.dumps(d) + "\n"
                                                                   for d in docs))
    yaml = TASK.read_text()
    assert "test: shakespeare_last_word.jsonl" in yaml  # the data's line, to point elsewhere
    yaml = yaml.replace("test: shakespeare_last_word.jsonl", f"test: {data}")
    (folder / f"{name}.yaml").write_text(edit(yaml.replace("task: shakespeare_last_word",
                                                           f"task: {name}")))
    return folder


def run(*args):
    """eval.main as `python eval.py args` runs it; the exit message, None on success."""
    try:
        eval_py.main([str(a) for a in args])
    except USER_ERRORS as e:  # the one line run_main prints
        return f"error: {e}"
    return None


def error_line(*args):
    message = run(*args)
    assert message and message.startswith("error: ") and "\n" not in message, message
    return message


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- --ppl data against
# the model

@pytest.mark.parametrize("vocab", [20, 300], ids=["ids beyond its vocabulary", "ids within it"])
def test_ppl_data_in_another_tokenizer_is_refused(vocab, tmp_path, data_root):
    """Bytes data and a word-level model: an IndexError before, or (ids within the vocabulary) a
    perplexity of nothing."""
    model = tiny_model(vocab_size=vocab, block_size=32)
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0,
                     "tokenizer": str(word_tokenizer(tmp_path / "tokenizer.json", vocab))},
                    tmp_path / "ckpt.pt")
    message = error_line(f"--init_from={tmp_path}", "--tasks=", "--ppl=tiny",
                         f"--data_root={data_root}")
    assert f"tiny was tokenized with bytes, but {tmp_path} uses {tmp_path / 'tokenizer.json'}" in message
    assert f"--tokenizer={tmp_path / 'tokenizer.json'}" in message


def test_an_id_beyond_the_vocabulary_in_val_bin_is_one_line(trained, data_root, tmp_path):
    shutil.copytree(data_root / "tiny", tmp_path / "tiny")
    tokens = np.fromfile(tmp_path / "tiny" / "val.bin", dtype=np.uint16)
    tokens[len(tokens) // 2] = 300  # the file no longer matches its meta.json (bytes: 257 ids)
    tokens.tofile(tmp_path / "tiny" / "val.bin")
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={tmp_path}")
    assert "val.bin holds token id 300, beyond the model's vocab_size 257" in message and "--force" in message


@pytest.mark.parametrize("damage", ["missing", "malformed"])
def test_a_missing_or_malformed_meta_json_is_one_line(damage, trained, data_root, tmp_path,
                                                      no_loading):
    shutil.copytree(data_root / "tiny", tmp_path / "tiny")
    meta = tmp_path / "tiny" / "meta.json"
    meta.unlink() if damage == "missing" else meta.write_text('{"tokenizer": "bytes", ')
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={tmp_path}")
    assert f"{meta} not found: run `python prepare_data.py" in message if damage == "missing" else \
        f"{meta} is not a valid prepare_data.py output" in message


# ----------------------------------------------------------------------------- --json

@pytest.mark.parametrize("where", ["a folder", "under a file", "an unwritable folder"])
def test_an_unwritable_json_fails_before_loading(where, trained, data_root, tmp_path, no_loading):
    (tmp_path / "file").write_text("x")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere but in /sys
        readonly = Path("/sys")
    path = {"a folder": tmp_path, "under a file": tmp_path / "file" / "eval.json",
            "an unwritable folder": readonly / "eval.json"}[where]
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={data_root}", f"--json={path}")
    assert f"--json={path}" in message


def test_json_never_replaces_a_file_that_is_not_a_result(trained, data_root, no_loading):
    """--json=out/RUN/ckpt.pt, a slip of tab completion, would have overwritten the checkpoint."""
    before = digest(trained / "ckpt.pt")
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={data_root}", f"--json={trained / 'ckpt.pt'}")
    assert "exists and was not written by eval.py" in message
    assert digest(trained / "ckpt.pt") == before


def test_another_programs_json_with_the_same_keys_is_kept(trained, data_root, tmp_path):
    """The check reads eval.py's own mark, not keys any JSON may hold ("results", "ppl")."""
    theirs = tmp_path / "theirs.json"
    theirs.write_text('{"results": {"arc_easy": 0.5}, "ppl": 3.0}')
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={data_root}", f"--json={theirs}")
    assert "was not written by eval.py" in message
    assert json.loads(theirs.read_text()) == {"results": {"arc_easy": 0.5}, "ppl": 3.0}


def test_the_same_json_twice_is_replaced_cleanly(trained, data_root, tmp_path):
    out = tmp_path / "eval.json"
    for limit in (1, 3):
        assert run(f"--init_from={trained}", "--tasks=", "--ppl=tiny", f"--data_root={data_root}",
                   f"--limit={limit}", f"--json={out}") is None
        assert json.loads(out.read_text())["ppl"]["windows"] == limit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]  # no temporary or probe left


@pytest.mark.parametrize("moment", ["mid-evaluation", "mid-write"])
def test_ctrl_c_keeps_the_previous_json_whole(moment, trained, data_root, tmp_path, monkeypatch):
    out = tmp_path / "eval.json"
    args = (f"--init_from={trained}", "--tasks=", "--ppl=tiny", f"--data_root={data_root}",
            f"--json={out}")
    assert run(*args, "--limit=1") is None
    before = out.read_text()
    write = Path.write_bytes

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    def torn(self, data):  # the interrupt lands after half of the text is on disk
        write(self, data[:len(data) // 2])
        raise KeyboardInterrupt
    if moment == "mid-evaluation":
        monkeypatch.setattr(eval_py, "perplexity", interrupted)
    else:
        monkeypatch.setattr(Path, "write_bytes", torn)
    with pytest.raises(KeyboardInterrupt):
        eval_py.main([*args, "--limit=2"])
    assert out.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


# ----------------------------------------------------------------------------- task files

def break_task(case, folder):
    """A copy of the local task with one fault, and what the error line must say about it."""
    if case == "malformed jsonl":  # datasets' own log line above it names the data file and row
        lines = "".join(json.dumps(d) + "\n"
                        for d in DOCS[:2]) + '{"context": "To be", "choices": ["or",\n'
        return write_task(folder, lines), "DatasetGenerationError: An error occurred while generating the dataset"
    if case == "missing data file":
        data = folder / "gone.jsonl"
        return write_task(folder, None, data=data), f"Unable to find '{data}'"
    if case == "missing field":
        return write_task(folder, edit=lambda y: y.replace("{{context}}", "{{prompt}}")), \
            "UndefinedError: 'prompt' is undefined"
    return write_task(folder, edit=lambda y: y.replace("output_type: multiple_choice", "output_type: [multiple")), \
        f"lm-eval left out these task files of --include_path, which it could not read: " \
        f"{folder / 'shakespeare_last_word.yaml'}"


@pytest.mark.parametrize("case", ["malformed jsonl", "missing data file", "missing field",
                                  "malformed yaml"])
def test_a_broken_task_file_is_one_line_naming_it(case, trained, tmp_path, no_loading,
                                                  local_tasks_only):
    folder, fragment = break_task(case, tmp_path / "tasks")
    message = error_line(f"--init_from={trained}", f"--include_path={folder}",
                         "--tasks=shakespeare_last_word")
    assert fragment in message
    if case != "malformed yaml":  # lm-eval's own words, after the task and its file
        assert message.startswith(f"error: task shakespeare_last_word ({folder / 'shakespeare_last_word.yaml'}): ")


def test_bad_document_types_are_one_line(trained, tmp_path):
    """Every line is JSON, but one's choices are numbers: lm-eval stops in its metrics, after the
    scoring."""
    folder = write_task(tmp_path / "tasks", [*DOCS[:2], {**DOCS[2], "choices": [1, 2, 3, 4]}])
    message = error_line(f"--init_from={trained}", f"--include_path={folder}",
                         "--tasks=shakespeare_last_word")
    assert message.startswith("error: lm-eval stopped on --tasks (--num_fewshot=0): TypeError")


def test_an_answer_longer_than_the_context_is_one_line(trained, tmp_path):
    folder = write_task(tmp_path / "tasks", [{**DOCS[0], "choices": ["x" * 40, "to", "be", "or"]}])
    message = error_line(f"--init_from={trained}", f"--include_path={folder}",
                         "--tasks=shakespeare_last_word")
    assert "a task's answer of 41 tokens does not fit the model's context of 32 tokens" in message


def test_globs_select_every_single_task_that_matches(trained, tmp_path, local_tasks_only):
    """--help promises globs; lm-eval's simple_evaluate takes names only. A group that matches the
    glob too is left out (its task would run twice, which lm-eval refuses)."""
    folder = write_task(tmp_path / "tasks")
    write_task(folder, DOCS[:2], name="shakespeare_short")
    (folder / "shakespeare_group.yaml").write_text("group: shakespeare_group\ntask: [shakespeare_last_word]\n")
    out = tmp_path / "eval.json"
    assert run(f"--init_from={trained}", f"--include_path={folder}", "--tasks=shakespeare_*",
               f"--json={out}") is None
    assert sorted(json.loads(out.read_text())["results"]) == ["shakespeare_last_word",
                                                              "shakespeare_short"]
    assert "unknown task(s) nothing_*" in error_line(f"--init_from={trained}",
                                                     f"--include_path={folder}",
                                                     "--tasks=nothing_*")


# ----------------------------------------------------------------------------- flags at and beyond
# their range

FLAGS = [
    ("--limit=-5", "--limit must be a finite number > 0, got -5.0"),
    ("--limit=0", "--limit must be a finite number > 0, got 0.0"),
    ("--limit=nan", "--limit must be a finite number > 0, got nan"),
    ("--limit=inf", "--limit must be a finite number > 0, got inf"),
    ("--limit=2.5", "--limit=2.5: give a whole number of examples, or a fraction below 1"),
    ("--num_fewshot=-1", "--num_fewshot must be a finite number >= 0, got -1"),
    ("--num_fewshot=1e3",
     "argument --num_fewshot: invalid int value: '1e3' (python eval.py --help lists the flags)"),
    ("--batch_size=0", "--batch_size must be a finite number >= 1, got 0"),
    ("--batch_size=x", "argument --batch_size: invalid int value: 'x'"),
    ("--bogus=1", "unrecognized arguments: --bogus=1"),
]


@pytest.mark.parametrize("flag, fragment", FLAGS, ids=[flag for flag, _ in FLAGS])
def test_a_flag_out_of_range_is_one_line_before_loading(flag, fragment, trained, tmp_path,
                                                        no_loading):
    folder = write_task(tmp_path / "tasks")
    assert fragment in error_line(f"--init_from={trained}", f"--include_path={folder}",
                                  "--tasks=shakespeare_last_word", flag)


def test_more_shots_than_documents_is_one_line(trained, tmp_path):
    """lm-eval draws the examples when it scores: its own error, as one line that names the flag."""
    folder = write_task(tmp_path / "tasks")
    message = error_line(f"--init_from={trained}", f"--include_path={folder}",
                         "--tasks=shakespeare_last_word", f"--num_fewshot={len(DOCS) + 1}")
    assert f"(--num_fewshot={len(DOCS) + 1}): ValueError: Sample larger than population" in message


def test_cuda_without_a_gpu_is_one_line_before_anything(trained, monkeypatch, no_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(eval_py, "build_tasks",
                        lambda *a: pytest.fail("eval.py indexed the tasks first"))
    message = error_line(f"--init_from={trained}", "--device=cuda", "--tasks=anything",
                         "--json=/nonexistent/x")
    assert message == "error: device 'cuda' but torch sees no CUDA GPU here; use --device=cpu (or auto)"


@pytest.mark.parametrize("init_from", ["garbage", "empty folder"])
def test_init_from_garbage_or_an_empty_folder_is_one_line(init_from, tmp_path, data_root):
    path = tmp_path / "x"
    path.write_bytes(os.urandom(256)) if init_from == "garbage" else path.mkdir()
    message = error_line(f"--init_from={path}", "--tasks=", "--ppl=tiny",
                         f"--data_root={data_root}")
    # random bytes with no checkpoint's name or beginning: not called a damaged checkpoint
    assert "is not a checkpoint" in message if init_from == "garbage" else \
        f"no checkpoint at {path / 'ckpt.pt'}" in message


def test_a_missing_data_root_is_one_line_before_loading(trained, tmp_path, no_loading):
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={tmp_path / 'none'}")
    assert f"{tmp_path / 'none' / 'tiny'}" in message and "--data_root" in message


def test_a_huge_batch_size_gives_the_same_perplexity(trained, data_root, tmp_path):
    ppl = []
    for batch_size in (1, 10**9):
        out = tmp_path / f"{batch_size}.json"
        assert run(f"--init_from={trained}", "--tasks=", "--ppl=tiny", f"--data_root={data_root}",
                   "--limit=3", f"--batch_size={batch_size}", f"--json={out}") is None
        ppl.append(json.loads(out.read_text())["ppl"]["ppl"])
    assert math.isclose(*ppl, rel_tol=1e-6), ppl


def test_out_of_memory_is_one_line_naming_the_batch_size(trained, data_root, monkeypatch):
    def full(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 800000000000 bytes")
    monkeypatch.setattr(eval_py, "token_logprobs", full)
    message = error_line(f"--init_from={trained}", "--tasks=", "--ppl=tiny",
                         f"--data_root={data_root}", "--batch_size=100000")
    assert "out of memory scoring 100000 sequences of up to 32 tokens at once; lower --batch_size" in message


# ----------------------------------------------------------------------------- the documentation

def test_the_docs_quote_what_an_untrained_model_scores_on_the_local_task():
    """The true word is often the shortest choice, which plain acc (a sum of log-probabilities)
    favours: 25% is not this task's floor. The counts quoted in docs/eval.md are recounted from the
    data here."""
    docs = [json.loads(line)
            for line in (ROOT / "docs" / "eval_tasks" / "shakespeare_last_word.jsonl").open()]
    lengths = [[len(c) for c in d["choices"]] for d in docs]
    shortest = sum(ls.index(min(ls)) == d["answer"] for ls, d in zip(lengths, docs))
    longest = sum(ls.index(max(ls)) == d["answer"] for ls, d in zip(lengths, docs))
    text = " ".join((ROOT / "docs" / "eval.md").read_text().split())
    assert f"the shortest of the four in {shortest} of the {len(docs)} lines" in text
    assert f"the longest in {longest}" in text
    assert "chance is 25%)" not in text
