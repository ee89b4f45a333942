"""
Reading a trained model: `load_model(init_from)` turns a train.py out_dir, a ckpt.pt (or an FSDP
run's ckpt.dcp), a Hugging Face folder or a hub id (lab/hf.py) into a model and its tokenizer, for
every script; `read_checkpoint` checks a checkpoint against the checksums written with it
(outputs.save_checkpoint), so a flipped byte is an error naming the entry, never weights served.
"""
import hashlib
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from configurator import CheckpointError
from model import DEPTH_MODES, GPT, ConfigError, ModelConfig
from tokenizer import from_record, get_tokenizer

SHARDED = "ckpt.dcp"  # an FSDP run's checkpoint folder (lab/fsdp.py); ckpt.dcp.old during a save


def build_model(keys: dict) -> GPT:
    """The model a flat dict of keys names: baselines.build_model's, which for model.py's own
    rows is model.GPT, built here without loading baselines.py."""
    if "baselines" not in sys.modules and keys.keys() <= {f.name for f in fields(ModelConfig)} \
            and keys.get("depth_mode", "value") in DEPTH_MODES:  # model.py's rows alone so far
        return GPT(ModelConfig(**keys))
    import baselines
    return baselines.build_model(keys)


def _digest(value, h):
    """value into hash h: a tensor as dtype, shape and bytes, containers in order, else repr."""
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {tuple(value.shape)};".encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(b"{")
        for k, v in value.items():
            _digest(v, _digest(k, h))
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"(" if isinstance(value, tuple) else b"[")
        for v in value:
            _digest(v, h)
        h.update(b")")
    else:
        h.update(f"{type(value).__name__} {value!r};".encode())
    return h


def checksums(obj: dict) -> dict:
    """{entry: sha256} of a checkpoint's top-level entries: a reader verifies those it uses."""
    return {k: _digest(v, hashlib.sha256()).hexdigest() for k, v in obj.items() if k != "checksums"}


def checkpoint_path(init_from) -> Path:
    """An out_dir means its ckpt.pt, else its ckpt.dcp (or a lone ckpt.dcp.old: a save killed
    between its renames); a ckpt.dcp's run.pt means the folder; anything else is itself."""
    p = Path(init_from)
    if p.is_dir() and not p.name.startswith(SHARDED):
        found = [p / n for n in ("ckpt.pt", SHARDED, f"{SHARDED}.old") if (p / n).exists()]
        return (found or [p / "ckpt.pt"])[0]
    return p.parent if p.name == "run.pt" and p.parent.name.startswith(SHARDED) else p


def read_checkpoint(path, verify=None) -> dict:
    """A train.py checkpoint on the CPU, memory-mapped, with the checksums of the entries in verify
    (None: all) checked. An FSDP run's ckpt.dcp: its run.pt, the tensors left in the shards."""
    path = Path(path)
    if path.is_dir() and path.name.startswith(SHARDED):
        return {**read_checkpoint(path / "run.pt", verify), "shards": str(path)}
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train one with `python train.py`, or "
                              f"check the path")
    try:  # through one open file: a run may rename a new checkpoint over path meanwhile
        with open(path, "rb") as f:
            fd = f"/proc/self/fd/{f.fileno()}"
            ckpt = torch.load(fd if os.path.exists(fd) else f, map_location="cpu",
                              weights_only=True, mmap=os.path.exists(fd))
    except Exception as e:  # truncated, random or foreign bytes
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}): "
                              f"truncated, corrupt or another kind of file; restore or retrain") from e
    needed = {"model_config"} if path.name == "run.pt" else {"model", "model_config"}
    if not isinstance(ckpt, dict) or not needed <= ckpt.keys():
        raise CheckpointError(f"{path} is a torch file but not a train.py checkpoint")
    stored = ckpt.pop("checksums", None)
    if stored is None:
        print(f"warning: {path} has no checksums (written before them); loading it unverified",
              file=sys.stderr)
        return ckpt
    bad = [k for k in (verify or stored) if (k in stored or k in ckpt)
           and checksums({k: ckpt.get(k)})[k] != stored.get(k)]
    if bad:
        raise CheckpointError(f"{path} is corrupt: its {', '.join(bad)} no longer match the "
                              f"checksums written with it; restore the file or retrain")
    return ckpt


@dataclass
class Loaded:  # the model, in eval mode on the device asked for, and where it came from
    model: GPT
    tokenizer: object
    source: str  # the file or folder
    step: Optional[int] = None  # training steps behind the weights (None: unknown)
    config: Optional[dict] = None  # a train.py run's config


def read_model(path):
    """(path, its checkpoint's entries, the model they describe); the optimizer's unverified."""
    ckpt = read_checkpoint(path, ("model", "model_config", "files", "tokenizer", "tokenizer_json"))
    try:
        model = build_model(ckpt["model_config"])
    except ConfigError as e:  # model.py's: a stored config this code cannot build
        raise CheckpointError(f"{path}: {e}") from None
    if "shards" in ckpt:  # whole tensors from an FSDP run's shards
        from lab.shards import read_shards
        read_shards(model.state_dict(), ckpt)
    else:
        model.load_state_dict(ckpt["model"])
    return path, ckpt, model


def load_model(init_from, device="cpu") -> Loaded:
    """The model and tokenizer behind init_from (the module docstring), ready for inference."""
    p = Path(init_from)
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(init_from)) and not p.exists() \
        and not Path(str(init_from).split("/")[0]).is_dir()
    if hub_id or (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        from lab.hf import from_pretrained, snapshot
        folder = snapshot(init_from)
        return Loaded(from_pretrained(folder).to(device).eval(), get_tokenizer(str(folder)),
                      str(folder))
    path = checkpoint_path(init_from)
    if path.is_dir():  # a folder a run may replace while it is read (lab/shards.py)
        from lab.shards import snapshot
        path, ckpt, model = snapshot(lambda: checkpoint_path(init_from), read_model)
    else:
        path, ckpt, model = read_model(path)
    return Loaded(model.to(device).eval(), from_record(ckpt), str(path), ckpt.get("step"),
                  ckpt.get("config"))
