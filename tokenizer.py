"""Tokenizers behind tiktoken's interface (encode, encode_ordinary, decode, eot_token, n_vocab,
name): "bytes" (256 bytes + end-of-text, offline: Shakespeare), "gpt2" (tiktoken's BPE), or a
tokenizer.json of a folder, file or hub id (lab/hf.py's, read only for one). No torch here."""
from functools import lru_cache

import tiktoken

from configurator import DataError, UserError

EOT = "<|endoftext|>"  # the end-of-text token: GPT-2's, the bytes tokenizer's
TIKTOKEN = ("bytes", "gpt2")  # rebuilt from their names; any other is a tokenizer.json


@lru_cache(maxsize=None)
def get_tokenizer(name):
    """The tokenizer `name` names; one that cannot be had is a DataError saying why."""
    if name == "bytes":  # every byte its own token: any UTF-8 text round-trips; no merges
        return tiktoken.Encoding(name="bytes", pat_str=r"[\s\S]{1,256}", special_tokens={EOT: 256},
                                 mergeable_ranks={bytes([i]): i for i in range(256)})
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # the network's or tiktoken's cache's: its BPE files download once
            raise DataError(f"could not load the gpt2 tokenizer ({type(e).__name__}): tiktoken "
                            f"downloads it on first use; run once with network access, or use "
                            f"--tokenizer=bytes") from e
    from lab.hf import load_tokenizer
    try:
        enc = load_tokenizer(name)  # or the name of the tiktoken encoding an export recorded
    except UserError as e:
        raise DataError(f"tokenizer {name!r}: {e}") from e
    return get_tokenizer(enc) if isinstance(enc, str) else enc


def tokenizer_record(name) -> dict:
    """What a checkpoint stores to rebuild the tokenizer anywhere: a tiktoken encoding's name, or a
    tokenizer.json's contents and end-of-text id (never a path, which breaks once moved)."""
    if name in TIKTOKEN:
        return {"tokenizer": name}
    enc = get_tokenizer(name)
    return {"tokenizer": enc.name, "tokenizer_json": enc.text, "eot_token": enc.eot_token}


def from_record(record: dict):
    """The tokenizer a tokenizer_record (or an older checkpoint's bare name) describes."""
    if "tokenizer_json" in record:
        from lab.hf import HFTokenizer
        return HFTokenizer(record["tokenizer"], record["eot_token"], text=record["tokenizer_json"])
    return get_tokenizer(record["tokenizer"])


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids (names cannot tell): a probe text's."""
    probe = "Probe: the quick brown fox, 1234.\n"
    return a.eot_token == b.eot_token and a.encode(probe) == b.encode(probe)
