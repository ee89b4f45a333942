"""
Loading trained models: `load_model(init_from)`, the one way every script that reads a trained
model (sample.py, eval.py, export.py, train.py --init_from) turns a path into a model and its
tokenizer, and `read_checkpoint`, a train.py checkpoint verified against its checksums (written by
support/run_dir.py, and support/sharded.py for an FSDP run's ckpt.dcp).

    init_from = "out/shakespeare"             a train.py out_dir (reads its ckpt.pt or ckpt.dcp)
              = "out/shakespeare/ckpt.pt"     a checkpoint file
              = "out/shakespeare_hf"          a Hugging Face folder: config.json + *.safetensors
              = "zeng123/Depth-attention-3B"  a Hugging Face hub id, downloaded by huggingface_hub
"""
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from model import GPT
from model import ConfigError as ModelConfigError
from support.checksums import checksums
from support.cli import SHARDED, SHARDED_OLD
from support.errors import CheckpointError
from support.tokenizer import (Tokenizer, folder_tokenizer, from_record, is_hf_folder,
                               looks_like_hub_id, snapshot)
from support.variants import build_model, make_config

TOKENIZER_KEYS = ("tokenizer", "tokenizer_json", "eot_token")  # tokenizer.tokenizer_record's keys


def _torch_load(path):
    """torch.load through one open file: the run may rename a new checkpoint over path at any
    moment, and torch.load(path, mmap=True) opens it twice (the archive, then the map), maybe two
    checkpoints. Memory-mapped through /proc/self/fd where there is one, else read from the file."""
    with open(path, "rb") as f:
        pinned = f"/proc/self/fd/{f.fileno()}"
        if os.path.exists(pinned):
            return torch.load(pinned, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(f, map_location="cpu", weights_only=True)


def is_torch_file(path) -> bool:
    """Whether path starts as torch.save writes (a zip archive; the legacy format, a pickle)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def read_checkpoint(path, verify=None) -> dict:
    """torch.load a train.py checkpoint on the CPU and check the stored checksums of the entries in
    verify (None = all). Memory-mapped: a large optimizer state is never read unless verified or
    used."""
    path = Path(path)
    # an FSDP run's: run.pt here, the tensors in the shards
    if path.is_dir() and path.name in (SHARDED, SHARDED_OLD):
        ckpt = read_checkpoint(path / "run.pt", verify)
        return {**ckpt, "shards": str(path)}
    if not path.is_file():
        raise no_checkpoint(path)
    # a .pt that does not start as one is a damaged checkpoint; a log, a config or a shard is not one
    if path.suffix not in (".pt", ".pth", ".ckpt") and not is_torch_file(path):
        raise CheckpointError(f"{path} is not a checkpoint; give a train.py out_dir, its ckpt.pt "
                              f"or ckpt.dcp, or a Hugging Face folder or hub id")
    try:
        ckpt = _torch_load(path)
    except Exception as e:  # truncated, random or foreign bytes
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); "
                              f"it may be truncated or corrupt: retrain or restore it") from e
    needed = {"model_config"} if path.name == "run.pt" else {"model", "model_config"}
    if not isinstance(ckpt, dict) or not needed <= ckpt.keys():
        raise CheckpointError(f"{path} is a torch file but not a train.py checkpoint (no "
                              f"{' and '.join(needed)})")
    stored = ckpt.pop("checksums", None)
    if stored is None:
        print(f"warning: {path} has no checksums (written before they were added); loading it "
              f"unverified", file=sys.stderr)
        return ckpt
    # older checkpoints lack newer keys
    bad = [key for key in (verify or stored) if (key in stored or key in ckpt)
           and checksums({key: ckpt.get(key)}).get(key) != stored.get(key)]
    if bad:
        raise CheckpointError(f"{path} is corrupt: its {', '.join(bad)} no longer match the "
                              f"checksums written with it; restore the file or retrain")
    return ckpt


def unfinished(folder) -> str:
    """' (X: a write that did not finish)' for the temporaries a killed save left in folder."""
    left = sorted(p.name for p in Path(folder).glob("ckpt.*.tmp*")) if Path(folder).is_dir() else []
    return f" ({', '.join(left)}: a write that did not finish)" if left else ""


def model_from_checkpoint(ckpt: dict) -> GPT:
    """The model a train.py checkpoint describes, with its weights. A checkpoint from before a
    config field existed gets that field's default."""
    model = build_model(make_config(**ckpt["model_config"]))
    # an FSDP run's: torch.distributed.checkpoint reads the shards into the parameters
    if "shards" in ckpt:
        from support.sharded import read_shards
        read_shards({"model": model.state_dict()}, ckpt)  # (state_dict's tensors are their storage)
    else:
        model.load_state_dict(ckpt["model"])
    return model


@dataclass
class Loaded:
    model: GPT             # in eval mode, on the requested device
    tokenizer: Tokenizer   # encode(text, allowed_special=...), decode(ids), eot_token, name
    source: str            # the file or folder the weights came from
    step: Optional[int]    # training steps behind the weights (None when unknown)
    config: Optional[dict] = None  # a train.py checkpoint's run config (support.continued reads it)


def no_checkpoint(path) -> CheckpointError:
    where = f"{path} or {path.with_name(SHARDED)}" if path.name == "ckpt.pt" else str(path)
    return CheckpointError(f"no checkpoint at {where}{unfinished(path.parent)}; train one with "
                           f"`python train.py` or check the path")


def check_source(init_from):
    """A CheckpointError now, before any slow work (lm-eval's task downloads), when init_from names
    no model: not a Hugging Face folder, not a hub id, and no checkpoint there."""
    if not (is_hf_folder(init_from) or looks_like_hub_id(init_from)):
        path = checkpoint_path(init_from)
        if not path.exists():
            raise no_checkpoint(path)


def checkpoint_path(init_from) -> Path:
    """An out_dir means its checkpoint (ckpt.pt, or an FSDP run's ckpt.dcp, or a lone ckpt.dcp.old:
    a save between its two renames, or killed there); a ckpt.dcp's run.pt means the ckpt.dcp; a file
    or a ckpt.dcp is itself."""
    p = Path(init_from)
    if p.name == "run.pt" and p.parent.name in (SHARDED, SHARDED_OLD):  # the folder is the one
        return p.parent
    if p.is_dir() and p.name not in (SHARDED, SHARDED_OLD):
        sharded = [p / name for name in (SHARDED, SHARDED_OLD) if (p / name).is_dir()]
        return sharded[0] if sharded and not (p / "ckpt.pt").exists() else p / "ckpt.pt"
    return p


def read_snapshot(find, read):
    """read(path) of the checkpoint path = find() as one snapshot. A run replaces its checkpoint by
    renames while it trains: a file is read through one open file (_torch_load), which is one
    snapshot; for a folder (ckpt.dcp: run.pt and the shards) a reader checks that path is, after the
    read, the folder it held open before (held, its inode cannot be reused by a newer one). When the
    run replaced it meanwhile, the read (or its failure: the files it was reading went) counts for
    nothing and is tried once more, and a second replacement says so."""
    for attempt in range(2):
        path = find()
        if not path.is_dir():
            return read(path)
        try:
            held = os.open(path, os.O_RDONLY)
        except OSError:  # nothing there (read says so), or gone between find and open
            if attempt:
                return read(path)
            continue
        try:
            try:
                result = read(path)
            except (CheckpointError, OSError):  # OSError: a file went between two looks at it
                if _unchanged(held, path):
                    raise
                continue
            if _unchanged(held, path):
                return result
        finally:
            os.close(held)
    raise CheckpointError(f"{path} was replaced while being read (a run is writing it); try again")


def _unchanged(held, path) -> bool:
    """Whether path still names the file or folder open as held."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    was = os.fstat(held)
    return (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino)


def load_model(init_from, device="cpu") -> Loaded:
    """The model and tokenizer behind init_from (see the module docstring), ready for inference. A
    folder, file or hub id that cannot be used is a UserError naming the file and the fix."""
    if is_hf_folder(init_from) or looks_like_hub_id(init_from):
        from support.hf import from_pretrained
        folder = snapshot(init_from)
        model = from_pretrained(folder)
        tokenizer = folder_tokenizer(folder)
        if tokenizer is None:
            raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's "
                                  f"tokenizer.json into it")
        return Loaded(model.to(device).eval(), tokenizer, str(folder), None)
    path, ckpt, model = read_snapshot(lambda: checkpoint_path(init_from), read_model)
    return Loaded(model.to(device).eval(), from_record(ckpt), str(path), ckpt.get("step"),
                  ckpt.get("config"))


def read_model(path):
    """(path, its checkpoint's entries, the model they describe); the optimizer's go unverified."""
    ckpt = read_checkpoint(path, verify=("model", "model_config", "files", *TOKENIZER_KEYS))
    try:
        return path, ckpt, model_from_checkpoint(ckpt)
    except ModelConfigError as e:  # a stored config this code cannot build
        raise CheckpointError(f"{path}: {e}") from None
