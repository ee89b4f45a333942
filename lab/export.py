"""
Export a model to a Hugging Face folder that transformers runs: config.json, model.safetensors, the
tokenizer and, for any model but a plain vanilla one, the code transformers runs it with.

    python lab/export.py out/shakespeare out/shakespeare_hf      # a train.py out_dir (or ckpt.pt)
    python lab/export.py zeng123/Depth-attention-3B out/da3b_hf  # a Hugging Face folder or hub id
    python lab/export.py out/RUN out/RUN_hf --dtype=bfloat16 --overwrite

A vanilla model is a plain Qwen3 (or Llama) folder. Any other claims our architecture,
DepthAttentionForCausalLM, and carries model.py and baselines.py as this repository holds them with
lab/hf_remote/'s two classes, so AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)
runs GPT.forward itself, and without trust_remote_code refuses it rather than loading the weights
into a Llama that skips the depth step. The folder is written beside OUT_DIR and renamed into place:
an interrupted export leaves nothing half written, and --overwrite replaces an earlier export whole.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: the core
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import inspect
import json
import os
import re
import shutil
from dataclasses import asdict

import torch

import baselines
import model as model_py
from checkpoint import checkpoint_path, load_model
from configurator import CheckpointError, Key, parse, require, run_main
from lab.hf import (ARCHITECTURES, OUR_CONFIG, REMOTE_ARCH, HFTokenizer, hf_name, is_hf_folder,
                    shared_names)
from outputs import claim, clean_stale, room_for, seal
from tokenizer import EOT

REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"
AUTO_MAP = {"AutoConfig": "configuration_depth_attention.DepthAttentionConfig",
            "AutoModelForCausalLM": "modeling_depth_attention.DepthAttentionForCausalLM"}
KEYS = {
    "src": Key(None, "a train.py out_dir, a ckpt.pt or ckpt.dcp, or a Hugging Face folder / hub id",
               kind=str, path=True, positional=True),
    "out_dir": Key(None, "a new or empty folder, or an earlier export (--overwrite)", kind=str,
                   path=True, positional=True),
    "dtype": Key("", "convert the weights (default: unchanged)", choices=("", "float32",
                                                                        "bfloat16")),
    "overwrite": Key(False, "replace an earlier export in OUT_DIR, all of it"),
}


def hf_config(c, dtype, eos_token_id=None) -> dict:
    """config.json: Qwen3's (Llama's without q/k-norm) where transformers' own class computes the
    model exactly, else our architecture with the auto_map to its code. Either way the authors'
    Llama keys are written and asdict(c) recorded, so nothing is lost."""
    baseline = getattr(c, "residual", "add") != "add"
    plain = (not baseline and getattr(c, "attention", "standard") == "standard"
             and c.depth_mode == "vanilla" and c.n_loops == 1 and not (c.qk_norm and
                                                                      c.k_norm_after_rope))
    arch = ("Qwen3ForCausalLM" if c.qk_norm else "LlamaForCausalLM") if plain else REMOTE_ARCH
    return {
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd, "head_dim": c.head_dim, "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head, "hidden_act": "silu",
        "max_position_embeddings": c.block_size, "initializer_range": c.init_std,
        "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
        "rope_theta": c.rope_theta, "attention_bias": False, "mlp_bias": False,
        # the pad is end-of-text, as Qwen3's: generate knows it, and warns of right padding
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
        "use_depth_attention": c.depth_mode != "vanilla", "depth_attention_stride": c.stride,
        "depth_attention_recent_window": c.depth_recent_window, "use_qk_norm": c.qk_norm,
        "k_norm_after_rope": c.k_norm_after_rope,  # else a reader guesses it from the depth keys
        "torch_dtype": str(dtype).removeprefix("torch."), OUR_CONFIG: asdict(c),
        **({"baseline_mode": c.residual, **{k: getattr(c, k) for k in baselines.KNOBS}}
           if baseline else {}),
        **({"auto_map": AUTO_MAP} if arch == REMOTE_ARCH else {}),
    }


def write_remote_code(folder: Path):
    """model.py and baselines.py as the repository holds them now, their imports of one another
    made relative (transformers loads the folder as a package), and hf_remote/'s two classes."""
    for module in (model_py, baselines):
        source = Path(inspect.getfile(module))
        (folder / source.name).write_text(
            re.sub(r"^( *)from (model|baselines) import ", r"\1from .\2 import ",
                   source.read_text(), flags=re.M))
    for code in sorted(REMOTE_CODE.glob("*.py")):
        shutil.copyfile(code, folder / code.name)


def bytes_tokenizer_json() -> str:
    """The bytes tokenizer as a tokenizer.json for transformers' AutoTokenizer: every byte its own
    token, id = the byte (GPT-2's byte-to-character table, no merges), <|endoftext|> = 256."""
    tokenizers = require("tokenizers", "a byte-level model's tokenizer.json")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # stand for 256 + i, in order
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={char[b]: b for b in range(256)},
                                                     merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(EOT, special=True)])
    return tok.to_str()


def check_export_dir(out: Path, overwrite, sources=()):
    """A folder save_pretrained may replace, checked before a large model is loaded: new, empty
    or an earlier export (with overwrite), never the model it reads, and holding nothing else
    (a model card added since: moved out first, never deleted with the folder)."""
    folder = claim(out, "export.py", "OUT_DIR", sources=sources)
    if folder.names and not overwrite:
        raise CheckpointError(f"{out} already holds an export; replace it whole with --overwrite, "
                              f"or export into a new folder")
    folder.refuse_foreign()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write into {out.parent}; export into a folder you can "
                              f"write to")


def save_pretrained(model, out_dir, tokenizer, overwrite=False, sources=()):
    """config.json + model.safetensors + the tokenizer, a folder that loads from anywhere: a
    tokenizer.json written out (its contents, not a path), or a tiktoken encoding's name recorded
    (lab/hf.py rebuilds it); tokenizer=None writes the weights alone."""
    safetensors_torch = require("safetensors.torch", "writing a Hugging Face folder", "safetensors")
    out = Path(out_dir)
    check_export_dir(out, overwrite, sources)
    if tokenizer is not None and tokenizer.n_vocab > model.config.vocab_size:
        raise CheckpointError(f"the tokenizer {tokenizer.name} has {tokenizer.n_vocab} tokens, "
                              f"more than the model's vocab_size {model.config.vocab_size}")
    tied = shared_names(model)  # stored once
    state = {hf_name(k): v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
             if k not in tied}
    cfg = hf_config(model.config, model.embed_tokens.weight.dtype,
                    getattr(tokenizer, "eot_token", None))
    clean_stale(out, hidden=True)  # a killed export's .NAME.tmp<pid>, .NAME.old<pid>
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with room_for(out_dir, lambda: sum(v.nbytes for v in state.values())):
            tmp.mkdir(parents=True)
            if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
                cfg["tokenizer"] = tokenizer.name
            text = tokenizer.text if isinstance(tokenizer, HFTokenizer) else \
                bytes_tokenizer_json() if getattr(tokenizer, "name", None) == "bytes" else None
            if text:  # and what AutoTokenizer needs beside it: a batch pads on the left with
                (tmp / "tokenizer.json").write_text(text)  # end-of-text, as Qwen3's, for generate
                eot = tokenizer.decode([tokenizer.eot_token])
                (tmp / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot,
                     "pad_token": eot, "padding_side": "left",
                     "model_max_length": model.config.block_size}, indent=2) + "\n")
            safetensors_torch.save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            if "auto_map" in cfg:
                write_remote_code(tmp)
            mask = os.umask(0)  # the usual modes, which safetensors' own (0600) would not give
            os.umask(mask)
            seal(tmp, "export.py")
            for f in tmp.iterdir():
                f.chmod(0o666 & ~mask)
            tmp.chmod(0o777 & ~mask)
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # a folder made read-only meanwhile (a full disk is DiskFull)
        raise CheckpointError(f"cannot write {out_dir} ({e.strerror or e}); pick a folder you can "
                              f"write to") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    a = parse(argv, KEYS, __doc__)
    out, src = Path(a["out_dir"]).resolve(), Path(a["src"]).resolve()
    # a folder or a file of ours (a hub id is not a path): never written into, nor around
    home = (src if is_hf_folder(src) else checkpoint_path(src).resolve().parent) \
        if src.exists() else ""
    check_export_dir(Path(a["out_dir"]), a["overwrite"], [("SRC", home)])  # before loading
    loaded = load_model(a["src"])
    model = loaded.model.to(getattr(torch, a["dtype"])) if a["dtype"] else loaded.model
    save_pretrained(model, out, loaded.tokenizer, a["overwrite"], [("SRC", home)])
    cfg = json.loads((out / "config.json").read_text())
    code = (" (its code is in the folder: transformers loads it with trust_remote_code=True)"
            if "auto_map" in cfg else "")
    print(f"{loaded.source} -> {a['out_dir']}: {model.num_params() / 1e6:.2f}M parameters, "
          f"{cfg['architectures'][0]}{code}")


if __name__ == "__main__":
    sys.exit(run_main(main))
