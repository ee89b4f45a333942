"""
Tokenizers, behind tiktoken's interface: encode(text, allowed_special=...), encode_ordinary(text),
decode(ids), eot_token, n_vocab, name.

    get_tokenizer("bytes")                       256 bytes + end-of-text, no download (Shakespeare)
    get_tokenizer("gpt2")                        tiktoken's GPT-2 BPE (MiniPile, the Pile)
    get_tokenizer("zeng123/Depth-attention-3B")  a Hugging Face folder, tokenizer.json or hub id

A tokenizer.json's class is support/hub.py's, imported only for one. Also where a Hugging Face hub
id becomes a local folder (`snapshot`), for the tokenizer and the
weights alike. No torch here, so prepare_data.py and its tokenizer processes never import it.
tokenizers and huggingface_hub are optional, imported where used. A tokenizer that cannot be had is
a DataError (a MissingPackage with the pip line for a missing package).
"""

import re
from functools import lru_cache
from pathlib import Path
from typing import Union

import tiktoken

from support.cli import EOT, read_json_object, reason, require
from support.errors import DataError, UserError



@lru_cache(maxsize=None)
def get_tokenizer(name):
    """A tiktoken Encoding: "gpt2" (50257 tokens) or "bytes" (256 bytes + EOT = 257); any other name
    is a Hugging Face folder, tokenizer.json or hub id, behind the same interface (HFTokenizer). EOT
    id: enc.eot_token."""
    if name == "bytes":
        # With no merges the pattern only bounds the piece length; every byte is its own token, so
        # any UTF-8 text round-trips. 256-byte pieces are faster than one piece per character.
        return tiktoken.Encoding(name="bytes", pat_str=r"[\s\S]{1,256}", special_tokens={EOT: 256},
                                 mergeable_ranks={bytes([i]): i for i in range(256)})
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # one call, whose errors are the network's or tiktoken's cache's
            raise DataError(f"could not load the gpt2 tokenizer ({type(e).__name__}): tiktoken "
                            "downloads its BPE files on first use, so run once with network access "
                            "(they are cached afterwards), or use --tokenizer=bytes") from e
    try:
        return load_tokenizer(name)
    except UserError as e:
        raise DataError(f"unknown tokenizer {name!r}: use 'gpt2', 'bytes' or a Hugging Face "
                        f"folder, tokenizer.json or hub id ({e})") from e


# what get_tokenizer and from_record return (HFTokenizer: support.hub's, read only for one)
Tokenizer = Union[tiktoken.Encoding, "HFTokenizer"]  # noqa: F821
TIKTOKEN = ("bytes", "gpt2")  # rebuilt from their names; any other tokenizer is a tokenizer.json


def tokenizer_record(name) -> dict:
    """What a checkpoint stores to rebuild the tokenizer `name` anywhere: a tiktoken encoding's
    name, or a tokenizer.json's contents and end-of-text id (never a path)."""
    if name in TIKTOKEN:
        return {"tokenizer": name}
    enc = get_tokenizer(name)
    return {"tokenizer": enc.name, "tokenizer_json": enc.text, "eot_token": enc.eot_token}


def from_record(record: dict):
    """The tokenizer a tokenizer_record (or an older checkpoint's bare name) describes."""
    if "tokenizer_json" in record:
        from support.hub import HFTokenizer  # a tokenizer.json's class, only for one
        return HFTokenizer(record["tokenizer"], record["eot_token"], text=record["tokenizer_json"])
    return get_tokenizer(record["tokenizer"])


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids. Names cannot tell ("gpt2" and a hub model's
    tokenizer.json may be one tokenizer), so compare the end-of-text id and the ids of a probe
    text."""
    probe = "Probe: the quick brown fox, 1234.\n"
    return a.eot_token == b.eot_token and a.encode(probe) == b.encode(probe)


def tokenizer_flag(enc, source) -> str:
    """prepare_data.py's --tokenizer for the tokenizer enc of the model at source: enc's name where
    it still names a tokenizer (a tiktoken encoding, a file or folder), else the folder an export of
    source writes."""
    if enc.name in TIKTOKEN or Path(enc.name).exists():
        return f"--tokenizer={enc.name}"
    return f"--tokenizer=DIR after `python export.py {source} DIR`"


def load_tokenizer(name_or_path):
    """The tokenizer of a Hugging Face folder, a tokenizer.json file or a hub id; the end-of-text id
    comes from the folder's config.json (eos_token_id) when it has one."""
    from support.hub import HFTokenizer
    p = Path(name_or_path)
    if p.is_file():
        return HFTokenizer(p)
    folder = snapshot(name_or_path,
                      patterns=("tokenizer*", "config.json", "special_tokens_map.json"))
    tok = folder_tokenizer(folder) if folder.is_dir() else None
    if tok is None:
        raise DataError(f"no tokenizer.json in {folder}")
    return tok


def folder_tokenizer(folder):
    """A folder's tokenizer: the tiktoken encoding our export recorded (its tokenizer.json, if any,
    is the same one written out for transformers), else its tokenizer.json; None if neither."""
    from support.hub import HFTokenizer
    folder = Path(folder)
    cfg = (read_json_object(folder / "config.json", DataError) if (folder / "config.json").is_file()
           else {})
    if "tokenizer" in cfg:
        return get_tokenizer(cfg["tokenizer"])
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json", cfg.get("eos_token_id"), name=str(folder))
    return None


# ----------------------------------------------------------------------------- the Hugging Face hub

def is_hf_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def looks_like_hub_id(name) -> bool:
    """owner/name that is not a local path: no such file and no local folder called `owner`."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", str(name))) and not Path(name).exists() \
        and not Path(str(name).split("/")[0]).is_dir()


def snapshot(path_or_hub_id, patterns=("*.json", "*.safetensors", "*.txt", "*.model")) -> Path:
    """A local folder as is; a hub id downloaded (or found in the cache) by huggingface_hub."""
    if Path(path_or_hub_id).exists() or not looks_like_hub_id(path_or_hub_id):
        return Path(path_or_hub_id)
    hub = require("huggingface_hub", f"downloading {path_or_hub_id} from the Hugging Face hub "
                  f"(it is not a local path)")
    try:
        return Path(hub.snapshot_download(str(path_or_hub_id), allow_patterns=list(patterns)))
    except Exception as e:  # one call, whose errors are the network's or the hub's
        raise DataError(f"{path_or_hub_id} is not a local path, and downloading it from the "
                        f"Hugging Face hub failed ({reason(e)}); check the path (a train.py "
                        f"out_dir exists once `python train.py` has run) or the hub id and the "
                        f"network") from e
