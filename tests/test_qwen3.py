"""Continuing a released Qwen3 as Depth-Attention (docs/pretrained.md), end to end on a tiny Qwen3
that transformers builds here with Qwen3's real vocabulary size (151,936) and a tokenizer.json of
that size: the docs' own commands, the folder in place of the hub id, prepare uint32 token files,
continue the model as value (its architecture, vocabulary, RoPE base and tokenizer the folder's),
resume exactly, score its perplexity, sample, export, and load the export in transformers with
logits equal to ours."""
import shlex

import pytest
import torch

import eval as eval_py
import export as export_py
import prepare_data
import sample as sample_py
from helpers import (HIGH_ID, QWEN3_EOT, QWEN3_VOCAB, ROOT, WORDS, log_records, qwen3_tokenizer,
                     read_log, train)
from support.checkpoint import load_model
from support.data import load_meta, read_tokens

transformers = pytest.importorskip("transformers")

HUB_ID = "Qwen/Qwen3-0.6B-Base"
# Qwen3's own settings at a tiny width: 151,936 tokens, RoPE base 1e6, tied embeddings, q/k-norm
TINY_QWEN3 = dict(vocab_size=QWEN3_VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, bos_token_id=QWEN3_EOT, eos_token_id=QWEN3_EOT)
# what a tiny model needs beyond the docs' command: its windows, batch and steps, where to write
TINY_RUN = ["--block_size=32", "--batch_tokens=64", "--micro_batch=2", "--max_iters=4",
            "--eval_interval=2", "--eval_seqs=4", "--log_interval=2", "--sample_tokens=0"]


def docs_commands():
    """{script: argv} of docs/pretrained.md's commands that name HUB_ID, continuation lines
    joined."""
    text = (ROOT / "docs" / "pretrained.md").read_text().replace("\\\n", " ")
    commands = {}
    for line in text.splitlines():
        if line.startswith("python ") and HUB_ID in line:
            words = shlex.split(line, comments=True)
            commands[words[1]] = words[2:]
    return commands


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3 folder as transformers saves one (config.json, model.safetensors) with a
    tokenizer.json of Qwen3's size, and a corpus of its words."""
    folder = tmp_path_factory.mktemp("Qwen3-tiny")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_QWEN3)).save_pretrained(folder)
    qwen3_tokenizer(folder / "tokenizer.json")
    corpus = folder.parent / "my_corpus"
    corpus.mkdir()
    rng = torch.Generator().manual_seed(0)
    for i in range(4):
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (400,), generator=rng)]
        (corpus / f"doc{i}.txt").write_text(" ".join(words) + " .")
    return folder, corpus


def with_folder(argv, folder, corpus):
    return [a.replace(HUB_ID, str(folder)).replace("my_corpus", str(corpus)) for a in argv]


def test_the_docs_commands_continue_a_real_vocabulary_qwen3_as_depth_attention(
        qwen3, tmp_path, monkeypatch, capsys):
    folder, corpus = qwen3
    commands = docs_commands()
    assert set(commands) == {"prepare_data.py", "train.py"}, commands
    data_root = tmp_path / "data"
    prepare_data.main([*with_folder(commands["prepare_data.py"], folder, corpus),
                       f"--out_dir={data_root}", "--val_fraction=0.25"])
    meta = load_meta(data_root / "mine_qwen3")
    ids = read_tokens(data_root / "mine_qwen3", "train", meta)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == QWEN3_VOCAB
    assert int(ids.min()) >= HIGH_ID and int(ids.max()) == QWEN3_EOT  # beyond uint16, kept whole

    argv = [*with_folder(commands["train.py"], folder, corpus), f"--data_root={data_root}",
            *TINY_RUN]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    capsys.readouterr()
    assert train(monkeypatch, *argv, f"--out_dir={whole}") is None
    printed = capsys.readouterr().out
    assert "depth_mode 'vanilla' -> 'value'" in printed and "block_size 64 -> 32" in printed
    assert train(monkeypatch, *argv, f"--out_dir={halves}", "--stop_at_step=2") is None
    assert train(monkeypatch, *argv, f"--out_dir={halves}", "--resume=True") is None
    assert read_log(whole) == read_log(halves)  # the resume continued the same run
    assert [r["step"] for r in log_records(whole) if r["kind"] == "eval"] == [0, 2, 4]

    # the model is the folder's, as Depth-Attention: its shape, vocabulary, RoPE base, tokenizer
    ckpt = torch.load(whole / "ckpt.pt", weights_only=False)
    c = ckpt["model_config"]
    assert (c["depth_mode"], c["vocab_size"], c["rope_theta"], c["n_embd"], c["n_layer"],
            c["qk_norm"], c["tie_embeddings"]) == ("value", QWEN3_VOCAB, 1e6, 32, 2, True, True)
    assert ckpt["tokenizer_json"] == (folder / "tokenizer.json").read_text()

    capsys.readouterr()  # eval.py's perplexity reads the uint32 val.bin: each id once
    eval_py.main([f"--init_from={whole}", "--tasks=", "--ppl=mine_qwen3", f"--data_root={data_root}"])
    val = read_tokens(data_root / "mine_qwen3", "val", meta)
    assert f"over {len(val) - 1:,} tokens" in capsys.readouterr().out

    sample_py.main([f"--init_from={whole}", "--prompt=the cat sat", "--max_new_tokens=5"])
    text = capsys.readouterr().out.splitlines()[-1]
    assert text.startswith("the cat sat") and len(text.split()) == 3 + 5, text

    exported = tmp_path / "exported"
    export_py.main([str(whole), str(exported)])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported,
                                                               trust_remote_code=True).eval()
    ours = load_model(whole).model
    idx = torch.from_numpy(ids[:24].astype("int64"))[None]  # (1, 24)
    with torch.no_grad():
        diff = theirs(input_ids=idx).logits - ours(idx)[0]
    assert diff.abs().max().item() == 0.0, diff.abs().max().item()
    tok = transformers.AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    batch = tok(["the cat", "a dog sat on the mat"], padding=True, return_tensors="pt")
    assert tok.pad_token == "<|endoftext|>" and batch.input_ids[0, 0] == QWEN3_EOT  # on the left
