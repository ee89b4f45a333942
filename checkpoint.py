"""
Saving and loading trained models: train.py's atomic checkpoints, and `load_model(init_from)`, the one way
every script that reads a trained model (sample.py, eval.py, train.py --init_from) turns a path into a model
and its tokenizer.

    init_from = "out/shakespeare"             a train.py out_dir (reads its ckpt.pt)
              = "out/shakespeare/ckpt.pt"     a checkpoint file
              = "out/shakespeare_hf"          a Hugging Face folder: config.json + *.safetensors (hf.py)
              = "zeng123/Depth-attention-3B"  a Hugging Face hub id, downloaded by huggingface_hub
"""
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GPT, ModelConfig, build_model


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or inconsistent; the message names the file and the fix."""


def _digest(value, h):
    """Feed value into hash h: tensors as dtype, shape and bytes (one pass, a tensor at a time), containers in
    their order, everything else as its repr. torch.load gives back equal values, so an equal digest."""
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {tuple(value.shape)};".encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(b"{")
        for k, v in value.items():
            _digest(k, h)
            _digest(v, h)
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
    """{entry: sha256 of its contents} for every top-level entry of a checkpoint: a flipped byte in any
    tensor or value changes its entry's digest, and a reader can verify just the entries it uses."""
    return {key: _digest(value, hashlib.sha256()).hexdigest() for key, value in obj.items() if key != "checksums"}


def save_checkpoint(obj, path):
    """Write obj with its checksums to a temporary file in the same folder, sync it, then rename: a kill at any
    moment leaves either the previous checkpoint or the new one, never a torn file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({**obj, "checksums": checksums(obj)}, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk, an interrupt: the previous checkpoint stays, the partial file goes
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_checkpoint(path, verify=None) -> dict:
    """torch.load a train.py checkpoint on the CPU and check the stored checksums of the entries in verify
    (None = all). Memory-mapped, so a large optimizer state beside the model is never read unless verified or
    used; only tensors and plain values, so the safe loader suffices."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train one with `python train.py` or check the path")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, random or foreign bytes
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); "
                              f"it may be truncated or corrupt: retrain or restore it") from e
    if not isinstance(ckpt, dict) or not {"model", "model_config"} <= ckpt.keys():
        raise CheckpointError(f"{path} is a torch file but not a train.py checkpoint (no model and model_config)")
    stored = ckpt.pop("checksums", None)
    if stored is None:
        print(f"warning: {path} has no checksums (written before they were added); loading it unverified",
              file=sys.stderr)
        return ckpt
    bad = [key for key in (verify or stored) if checksums({key: ckpt.get(key)}).get(key) != stored.get(key)]
    if bad:
        raise CheckpointError(f"{path} is corrupt: its {', '.join(bad)} no longer match the checksums written with "
                              f"it; restore the file or retrain")
    return ckpt


def model_from_checkpoint(ckpt: dict) -> GPT:
    """The model a train.py checkpoint describes (its stored ModelConfig dict, residual path included), with its
    weights. A checkpoint from before a ModelConfig field existed gets that field's default."""
    model = build_model(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model


@dataclass
class Loaded:
    model: GPT            # in eval mode, on the requested device
    tokenizer: object     # encode(text, allowed_special=...), decode(ids), eot_token, name
    source: str           # the file or folder the weights came from
    step: int             # training steps behind the weights (None when unknown)


def checkpoint_path(init_from) -> Path:
    """An out_dir means its ckpt.pt; a file is itself."""
    p = Path(init_from)
    return p / "ckpt.pt" if p.is_dir() else p


def load_model(init_from, device="cpu") -> Loaded:
    """The model and tokenizer behind init_from (see the module docstring), ready for inference."""
    import hf  # the optional packages of Hugging Face folders are imported only when one is used
    if hf.is_hf_folder(init_from) or hf.looks_like_hub_id(init_from):
        folder = hf.resolve(init_from)
        model = GPT.from_pretrained(folder)
        tokenizer = hf.folder_tokenizer(folder)
        if tokenizer is None:
            raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer.json into it")
        return Loaded(model.to(device).eval(), tokenizer, str(folder), None)
    from prepare_data import get_tokenizer  # tiktoken; model.py stays torch-only
    path = checkpoint_path(init_from)
    ckpt = read_checkpoint(path, verify=("model", "model_config", "tokenizer"))  # the optimizer stays unread
    model = model_from_checkpoint(ckpt).to(device).eval()
    return Loaded(model, get_tokenizer(ckpt["tokenizer"]), str(path), ckpt.get("step"))
