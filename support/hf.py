"""
Hugging Face folders: load the authors' released checkpoints, save ours in the same layout.

    model = hf.from_pretrained("zeng123/Depth-attention-3B")   # a folder or a hub id
    hf.save_pretrained(model, "out/my_hf", tokenizer)            # `python export.py SRC OUT` from a shell

An export is a complete transformers model: a vanilla one is a plain Qwen3 (or Llama) folder; any
other (a Depth-Attention mode, a looped model, a baseline) claims our architecture,
DepthAttentionForCausalLM, and carries its code (write_remote_code), so transformers runs it with
trust_remote_code=True and refuses it without, rather than loading the weights into a Llama that
skips the depth step.

The authors released 3B models (paper section 3, Table 1) as Hugging Face folders in the Llama
layout: zeng123/Depth-attention-3B, zeng123/AttnRes-3B, zeng123/DenseFormer-3B, zeng123/mHC-3B. A
folder holds config.json, model.safetensors (or shards listed by model.safetensors.index.json) and
tokenizer.json. Their parameter names are ours under "model.", except lm_head.

A folder that cannot be used is a CheckpointError (a MissingPackage for an optional package:
safetensors, tokenizers, huggingface_hub, each imported where used), the scripts' one-line error.
"""

import inspect
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from support.variants import KNOBS, attention_of, build_model, make_config, residual_of
from model import GPT, ModelConfig
from support.cli import read_json_object, require
from support.folders import claim, seal
from support.atomic import room_for
from support.outputs import clean_stale
from support.errors import USER_ERRORS, CheckpointError
from support.hub import HFTokenizer
from support.tokenizer import EOT, is_hf_folder, snapshot

OUR_CONFIG = "model_config"  # our exports also record asdict(config) under this config.json key
REMOTE_ARCH, REMOTE_MODEL_TYPE = "DepthAttentionForCausalLM", "depth_attention"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                 REMOTE_ARCH: REMOTE_MODEL_TYPE}
REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"  # its config and model classes
AUTO_MAP = {"AutoConfig": "configuration_depth_attention.DepthAttentionConfig",
            "AutoModelForCausalLM": "modeling_depth_attention.DepthAttentionForCausalLM"}
# An import of one of the files write_remote_code copies, at any indent (variants.build_model
# imports baselines where it needs it).
OUR_IMPORT = re.compile(r"^( *)from (model|baselines) import ", re.M)
# unused / recomputed on the fly
IGNORED = re.compile(r"(^|\.)lm_head_layernorm\.weight$|rotary_emb\.inv_freq$")
# The authors' `baseline_mode` values (their code accepts these spellings) -> our `residual`. Their
# baseline knobs carry our names (KNOBS).
AUTHORS_BASELINE_MODES = {
    "denseformer": "denseformer", "densetransformer": "denseformer", "mhc": "mhc",
    **dict.fromkeys(("attnres", "block_attnres", "block-attnres", "attention_residual",
                     "attention-residual"), "attnres")}


def _safetensors(module="safetensors"):
    return require(module, "reading or writing a Hugging Face folder", pip="safetensors")


def hf_name(ours: str) -> str:
    """Our parameter name -> the Llama / Qwen3 name (the inverse of our_name)."""
    return ours if ours.startswith("lm_head.") else "model." + ours


def our_name(theirs: str) -> str:
    return theirs.removeprefix("model.")

def config_from_hf(cfg: dict, where="config.json") -> ModelConfig:
    """ModelConfig from a config.json (Llama, Qwen3 or our DepthAttentionForCausalLM): our own
    record when present, else the authors' Llama keys (Qwen3's too)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    model_type = ARCHITECTURES.get(arch)
    if model_type is None or cfg.get("model_type", model_type) != model_type:
        raise CheckpointError(f"{where}: unknown architecture {arch} (model_type "
                              f"{cfg.get('model_type')!r}); this loader reads "
                              f"{', '.join(ARCHITECTURES)} folders")
    if OUR_CONFIG in cfg:
        return _config(cfg[OUR_CONFIG], where)
    supported = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                 "scale_embeds": False, "rope_scaling": None, "use_sliding_window": False}
    unsupported = {k: cfg[k] for k, ok in supported.items() if cfg.get(k, ok) != ok}
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope_theta here
    if rope.get("rope_type", "default") != "default":
        unsupported["rope_parameters"] = rope
    if unsupported:
        raise CheckpointError(f"{where}: settings this model does not implement: {unsupported}")
    try:
        n_head = cfg["num_attention_heads"]
        depth = bool(cfg.get("use_depth_attention", False))
        qk_norm = bool(cfg.get("use_qk_norm", arch == "Qwen3ForCausalLM"))  # Qwen3 always has it
        kw = dict(
            vocab_size=cfg["vocab_size"], block_size=cfg["max_position_embeddings"],
            n_layer=cfg["num_hidden_layers"], n_head=n_head,
            n_kv_head=cfg.get("num_key_value_heads") or n_head,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
            n_embd=cfg["hidden_size"], mlp_hidden=cfg["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))), qk_norm=qk_norm,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            norm_eps=cfg.get("rms_norm_eps", 1e-6), init_std=cfg.get("initializer_range", 0.02),
            depth_mode="value" if depth else "vanilla",
            depth_stride=cfg.get("depth_attention_stride") if depth else None,
            depth_recent_window=cfg.get("depth_attention_recent_window") or 0,
            # The authors' Depth-Attention model applies k_norm after RoPE (their SDPA path); a
            # "k_norm_after_rope" key in config.json overrides this guess.
            k_norm_after_rope=bool(cfg.get("k_norm_after_rope", depth and qk_norm)))
    except KeyError as e:
        raise CheckpointError(f"{where} lacks the key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:  # // of a value of the wrong type: "hidden_size": "2048"
        raise CheckpointError(f"{where}: a value of the wrong type ({e})") from e
    if cfg.get("baseline_mode") not in (None, "", "none"):  # a hidden-state baseline (Table 1)
        kw.update(_authors_baseline(cfg, where))
    return _config(kw, where)


def _authors_baseline(cfg: dict, where) -> dict:
    """A baseline's keys from the authors' config.json: residual, depth_mode vanilla, its knobs."""
    mode = str(cfg.get("baseline_mode") or "").strip().lower()
    if mode not in AUTHORS_BASELINE_MODES:
        modes = ", ".join(sorted(AUTHORS_BASELINE_MODES))
        raise CheckpointError(f"{where}: baseline_mode={cfg.get('baseline_mode')!r} is not one of "
                              f"the paper's baselines ({modes})")
    knobs = {k: cfg[k] for k in KNOBS if k in cfg}
    return {"residual": AUTHORS_BASELINE_MODES[mode], "depth_mode": "vanilla", **knobs}


def _config(kw: dict, where) -> ModelConfig:
    try:
        return make_config(**kw)
    except USER_ERRORS as e:  # model.ConfigError: a key this code does not know, or a bad value
        raise CheckpointError(f"{where}: {e}") from e


def hf_config(c: ModelConfig, dtype: torch.dtype, eos_token_id=None) -> dict:
    """config.json for a model: Qwen3's (Llama's without q/k-norm) when transformers' own class
    computes it exactly (vanilla, plain residual, standard attention, one pass, q/k-norm before
    RoPE), else our architecture with the auto_map to its code. Either way the authors' Llama keys
    are written and asdict(c) is recorded, so nothing is lost."""
    baseline = residual_of(c) != "add"
    plain = (not baseline and attention_of(c) == "standard" and c.depth_mode == "vanilla"
             and c.n_loops == 1 and not (c.qk_norm and c.k_norm_after_rope))
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
        "torch_dtype": str(dtype).removeprefix("torch."), OUR_CONFIG: asdict(c),
        # a baseline's keys as the authors' config.json spells them: baseline_mode, same-named knobs
        **({"baseline_mode": c.residual, **{k: getattr(c, k) for k in KNOBS}} if baseline else {}),
        **({"auto_map": AUTO_MAP} if arch == REMOTE_ARCH else {}),
    }


def write_remote_code(folder: Path):
    """The code transformers runs for REMOTE_ARCH: model.py, baselines.py and support/variants.py
    as this repository holds them now, and hf_remote/'s two classes. transformers loads the folder
    as a package and follows relative imports only (an absolute `from model import` is refused as a
    missing package), so their imports of one another become relative; nothing else changes."""
    import baselines  # only an export of a model needs its comparisons' code
    for module in (inspect.getmodule(GPT), baselines, inspect.getmodule(build_model)):
        source = Path(inspect.getfile(module))
        (folder / source.name).write_text(
            OUR_IMPORT.sub(r"\1from .\2 import ", source.read_text()))
    for code in sorted(REMOTE_CODE.glob("*.py")):
        shutil.copyfile(code, folder / code.name)


def read_safetensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors (one file, or the shards its index lists), mmapped."""
    safetensors = _safetensors()
    index = folder / "model.safetensors.index.json"
    present = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if index.is_file():
        weight_map = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map; restore it, or delete it if the "
                                  f"folder has one file")
        files = sorted(set(weight_map.values()))
        unlisted = sorted(set(present) - set(files))
        if unlisted:  # transformers would read model.safetensors, we the index: refuse to guess
            raise CheckpointError(
                f"{folder} holds {', '.join(unlisted)} beside an index that lists other files, the "
                f"remains of two exports; delete the stale ones, or export again with --overwrite")
    else:
        weight_map, files = None, present
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights")
    tensors = {}
    for name in files:
        if not (folder / name).is_file():
            raise CheckpointError(f"{index} lists {name}, which is not in {folder}; the download "
                                  f"is incomplete")
        try:  # tensors stay views of the file
            with safetensors.safe_open(folder / name, framework="pt") as f:
                tensors.update((key, f.get_tensor(key)) for key in f.keys())
        except (safetensors.SafetensorError, OSError) as e:  # truncated or foreign bytes
            raise CheckpointError(f"{folder / name} is not a readable safetensors file ({e}); it "
                                  f"may be truncated: download or export it again") from e
    if weight_map is not None and weight_map.keys() != tensors.keys():
        raise CheckpointError(f"{index} and the shards disagree on "
                              f"{sorted(weight_map.keys() ^ tensors.keys())[:5]}")
    return tensors


def from_pretrained(path_or_hub_id, dtype=None) -> GPT:
    """The model in a Hugging Face folder (or hub id): the authors' released checkpoints (Llama
    layout, a baseline's too) or our export. Built on the meta device and given the memory-mapped
    safetensors weights by assignment, so a model is never held twice; dtype None keeps the file's
    (the embedding's) dtype: bf16 stays bf16."""
    folder = snapshot(path_or_hub_id)
    if not is_hf_folder(folder):
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (config.json + "
                              f"*.safetensors)")
    config = config_from_hf(read_json_object(folder / "config.json", CheckpointError),
                            f"{folder}/config.json")
    with torch.device("meta"):
        model = build_model(config)
    tied = shared_names(model)  # stored once, tied again below
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
    state = {}
    for name, t in read_safetensors(folder).items():
        ours = our_name(name)
        if IGNORED.search(name) or (ours == "lm_head.weight" and config.tie_embeddings):
            continue
        if ours not in expected:
            raise CheckpointError(f"{folder}: unknown tensor {name} (shape {tuple(t.shape)}) for "
                                  f"this config; the folder and config.json do not match this "
                                  f"model")
        if t.shape != expected[ours]:
            raise CheckpointError(f"{folder}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"config.json implies {tuple(expected[ours])}")
        state[ours] = t
    missing = sorted(hf_name(k) for k in expected.keys() - state.keys())
    if missing:
        raise CheckpointError(
            f"{folder}: missing tensor{'s' * (len(missing) > 1)} {', '.join(missing[:5])}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
    dtype = dtype or state["embed_tokens.weight"].dtype
    state = {k: v if v.dtype == dtype else v.to(dtype) for k, v in state.items()}
    model.load_state_dict({**state, **{k: state[first] for k, first in tied.items()}}, assign=True)
    for name, first in tied.items():  # assignment replaced the shared parameter; share it again
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    return model


def shared_names(model) -> dict:
    """{name: the first name of the same tensor} for a tensor the model holds under several names
    (a tied lm_head; a learned row's parameters held by every block, DepthMode.shared): an export
    stores it once, under its first name, and from_pretrained ties it again."""
    first, tied = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if first.setdefault(id(t), name) != name:
            tied[name] = first[id(t)]
    return tied


def bytes_tokenizer_json() -> str:
    """The bytes tokenizer as a Hugging Face tokenizer.json, for transformers' AutoTokenizer: every
    UTF-8 byte its own token, id = the byte (GPT-2's byte-to-character table stands each byte for a
    character, with no merges), and <|endoftext|> the special token 256, so the ids are
    get_tokenizer("bytes")'s."""
    tokenizers = require("tokenizers", "a byte-level model's tokenizer.json")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # stand for themselves + 256, in order
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={char[b]: b for b in range(256)},
                                                     merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(EOT, special=True)])
    return tok.to_str()


def save_pretrained(model: GPT, out_dir, tokenizer, overwrite=False, sources=()):
    """config.json + model.safetensors + the tokenizer, a folder that loads from anywhere: a
    tokenizer.json is written out (its contents, not a path), a tiktoken encoding's name is recorded
    (our loader rebuilds it). tokenizer=None writes the weights alone (from_pretrained reads them;
    the scripts then need a tokenizer.json added).

    The folder is written beside out_dir and renamed into place, so an interrupted export leaves
    nothing half written, and a replaced folder (overwrite=True) keeps no file of the earlier one (a
    stale shard index would otherwise be read before the new weights)."""
    safetensors_torch = _safetensors("safetensors.torch")
    out = Path(out_dir)
    check_export_dir(out, overwrite, sources)
    if tokenizer is not None and tokenizer.n_vocab > model.config.vocab_size:
        raise CheckpointError(
            f"the tokenizer {tokenizer.name} has {tokenizer.n_vocab} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}: it is not this model's tokenizer")
    tied = shared_names(model)  # stored once (a tied lm_head, a row shared by every block)
    state = {hf_name(k): v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
             if k not in tied}
    cfg = hf_config(model.config, model.embed_tokens.weight.dtype,
                    getattr(tokenizer, "eot_token", None))
    clean_stale(out, hidden=True)  # a killed export's .NAME.tmp<pid>, .NAME.old<pid>
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # the space: the weights (the rest is small)
        with room_for(out_dir, lambda: sum(v.nbytes for v in state.values())):
            tmp.mkdir(parents=True)
            if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
                cfg["tokenizer"] = tokenizer.name  # tokenizer.get_tokenizer(name) rebuilds it
            text = tokenizer.text if isinstance(tokenizer, HFTokenizer) else \
                bytes_tokenizer_json() if getattr(tokenizer, "name", None) == "bytes" else None
            if text:  # tokenizer_config.json: what transformers' AutoTokenizer needs beside it;
                # a batch pads on the left with end-of-text, as Qwen3's does, which generate needs
                (tmp / "tokenizer.json").write_text(text)
                eot = tokenizer.decode([tokenizer.eot_token])
                (tmp / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot,
                     "pad_token": eot, "padding_side": "left",
                     "model_max_length": model.config.block_size}, indent=2) + "\n")
            safetensors_torch.save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            if "auto_map" in cfg:
                write_remote_code(tmp)
            # the usual modes, which safetensors' own (0600) would not give the weights
            mask = os.umask(0)
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
    except OSError as e:  # only files are written here: a full disk, a folder made read-only
        raise CheckpointError(f"cannot write {out_dir} ({e.strerror or e}); "
                              f"pick a folder you can write to") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_export_dir(out: Path, overwrite, sources=()):
    """Refuse a folder save_pretrained must not replace (support.folders.claim: new, empty or an
    earlier export, never the model it reads, sources), an earlier export unless overwrite, and one
    holding files export.py did not write (a model card added since: moved out first, never
    deleted with the folder)."""
    folder = claim(out, "export.py", "OUT_DIR", sources=sources)
    if folder.names and not overwrite:
        raise CheckpointError(f"{out} already holds an export; replace it whole with --overwrite "
                              f"(overwrite=True in Python), or export into a new folder")
    folder.refuse_foreign()
    try:  # the folder is written beside out_dir: check before a large model is loaded for nothing
        out.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(out.parent, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:
        raise CheckpointError(f"cannot write into {out.parent}; export into a folder you can "
                              f"write to")
