"""
Hugging Face interop: load the authors' released checkpoints, export ours in the same layout.

    python hf.py export out/shakespeare out/shakespeare_hf    # a train.py run (or any --init_from) -> HF folder

The authors released 3B models (paper section 3, Table 1) as Hugging Face folders in the Llama layout:
zeng123/Depth-attention-3B, zeng123/AttnRes-3B, zeng123/DenseFormer-3B, zeng123/mHC-3B. A folder holds
config.json, model.safetensors (or shards listed by model.safetensors.index.json) and tokenizer.json. Their
parameter names are ours under "model.", except lm_head. GPT.from_pretrained and GPT.save_pretrained in model.py
are thin wrappers around load_pretrained and save_pretrained here.

safetensors, tokenizers and huggingface_hub are optional: each is imported where it is used, and a missing one
fails with its pip line.
"""
import argparse
import importlib
import json
import re
import shutil
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch

from checkpoint import CheckpointError
from model import GPT, ModelConfig

OUR_CONFIG = "model_config"  # our exports also record asdict(ModelConfig) under this config.json key
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
IGNORED = re.compile(r"(^|\.)lm_head_layernorm\.weight$|rotary_emb\.inv_freq$")  # unused / recomputed on the fly


def _require(module):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise CheckpointError(f"Hugging Face folders need {module}: pip install {module.split('.')[0]}") from e


def hf_name(ours: str) -> str:
    """Our parameter name -> the Llama / Qwen3 name (the inverse of our_name)."""
    return ours if ours.startswith("lm_head.") else "model." + ours


def our_name(theirs: str) -> str:
    return theirs.removeprefix("model.")


# ----------------------------------------------------------------------------- finding the files

def looks_like_hub_id(name: str) -> bool:
    """owner/name that is not a local path: no such file and no local folder called `owner`."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", str(name))) and not Path(name).exists() \
        and not Path(str(name).split("/")[0]).is_dir()


def is_hf_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def resolve(path_or_hub_id, patterns=("*.json", "*.safetensors", "*.txt", "*.model")) -> Path:
    """A local folder as is; a hub id downloaded (or found in the cache) by huggingface_hub."""
    if Path(path_or_hub_id).exists() or not looks_like_hub_id(path_or_hub_id):
        return Path(path_or_hub_id)
    try:
        import huggingface_hub
    except ImportError as e:
        raise CheckpointError(f"{path_or_hub_id} is not a local path; to download it as a Hugging Face hub id: "
                              f"pip install huggingface_hub") from e
    try:
        return Path(huggingface_hub.snapshot_download(str(path_or_hub_id), allow_patterns=list(patterns)))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path_or_hub_id} is not a local path, and downloading it from the Hugging Face hub "
                              f"failed ({reason}); check the path (a train.py out_dir exists once "
                              f"`python train.py` has run) or the hub id and the network") from e


# ----------------------------------------------------------------------------- config.json <-> ModelConfig

def config_from_hf(cfg: dict, where="config.json") -> ModelConfig:
    """ModelConfig from a config.json: our own record when present, else the authors' Llama keys (Qwen3's too)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES or cfg.get("model_type", ARCHITECTURES[arch]) != ARCHITECTURES[arch]:
        raise CheckpointError(f"{where}: unknown architecture {arch} (model_type {cfg.get('model_type')!r}); "
                              f"this loader reads {', '.join(ARCHITECTURES)} folders")
    if OUR_CONFIG in cfg:
        return _model_config(cfg[OUR_CONFIG], where)
    unsupported = {k: cfg[k] for k, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                                           ("scale_embeds", False), ("rope_scaling", None),
                                           ("use_sliding_window", False)) if cfg.get(k, ok) != ok}
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope_theta here
    if rope.get("rope_type", "default") != "default":
        unsupported["rope_parameters"] = rope
    if unsupported:
        raise CheckpointError(f"{where}: settings this model does not implement: {unsupported}")
    try:
        n_head = cfg["num_attention_heads"]
        depth = bool(cfg.get("use_depth_attention", False))
        qk_norm = bool(cfg.get("use_qk_norm", arch == "Qwen3ForCausalLM"))  # Qwen3 always has q/k-norm
        kw = dict(vocab_size=cfg["vocab_size"], block_size=cfg["max_position_embeddings"],
                  n_layer=cfg["num_hidden_layers"], n_head=n_head, n_kv_head=cfg.get("num_key_value_heads") or n_head,
                  head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head, n_embd=cfg["hidden_size"],
                  mlp_hidden=cfg["intermediate_size"],
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
    if cfg.get("baseline_mode") not in (None, "", "none"):  # a hidden-state baseline (paper Table 1)
        from baselines import residual_config_from_authors
        try:
            kw.update(residual_config_from_authors(cfg))
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e
    return _model_config(kw, where)


def _model_config(kw: dict, where) -> ModelConfig:
    try:
        return ModelConfig(**kw)
    except (TypeError, ValueError) as e:  # a field this model.py lacks, or a bad value
        raise CheckpointError(f"{where}: {e}") from e


# The fields hf_config writes or tests; a ModelConfig field beyond these (a baseline's) off its default makes
# the export a Llama-layout folder that only our loader reads.
HF_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "head_dim", "n_embd", "mlp_hidden",
             "rope_theta", "qk_norm", "tie_embeddings", "norm_eps", "init_std", "depth_mode", "depth_stride",
             "depth_recent_window", "n_loops", "k_norm_after_rope")


def hf_config(c: ModelConfig, dtype: torch.dtype, eos_token_id=None) -> dict:
    """config.json for a model: Qwen3's when transformers can load it as one (vanilla, q/k-norm before RoPE, no
    loops), else the authors' Llama layout. Either way asdict(c) is recorded too, so nothing is lost."""
    plain = all(getattr(c, f.name) == f.default for f in fields(c) if f.name not in HF_FIELDS)
    qwen3 = plain and c.depth_mode == "vanilla" and c.qk_norm and not c.k_norm_after_rope and c.n_loops == 1
    arch = "Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"
    return {
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd, "head_dim": c.head_dim, "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
        "hidden_act": "silu", "max_position_embeddings": c.block_size, "initializer_range": c.init_std,
        "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings, "rope_theta": c.rope_theta,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "use_depth_attention": c.depth_mode != "vanilla", "depth_attention_stride": c.stride,
        "depth_attention_recent_window": c.depth_recent_window, "use_qk_norm": c.qk_norm,
        "torch_dtype": str(dtype).removeprefix("torch."), OUR_CONFIG: asdict(c),
        **(_baseline_keys(c) if c.residual != "add" else {}),
    }


def _baseline_keys(c: ModelConfig) -> dict:
    """A baseline's keys as the authors' config.json spells them (their baseline_mode, same-named knobs)."""
    from baselines import SHARED_KEYS
    return {"baseline_mode": c.residual, **{k: getattr(c, k) for k in SHARED_KEYS}}


# ----------------------------------------------------------------------------- weights

def read_safetensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors (one file, or the shards its index lists), memory-mapped."""
    safetensors = _require("safetensors")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights")
    tensors = {}
    for name in files:
        if not (folder / name).is_file():
            raise CheckpointError(f"{index} lists {name}, which is not in {folder}; the download is incomplete")
        with safetensors.safe_open(folder / name, framework="pt") as f:  # tensors stay views of the file
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    if weight_map is not None and weight_map.keys() != tensors.keys():
        raise CheckpointError(f"{index} and the shards disagree on {sorted(weight_map.keys() ^ tensors.keys())[:5]}")
    return tensors


def load_pretrained(build, path_or_hub_id, dtype=None):
    """The model in a Hugging Face folder (or hub id), built by `build(config)` on the meta device and given the
    memory-mapped weights by assignment: no second copy. dtype None keeps the file's (the embedding's) dtype."""
    folder = resolve(path_or_hub_id)
    if not is_hf_folder(folder):
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (config.json + *.safetensors)")
    config = config_from_hf(json.loads((folder / "config.json").read_text()), f"{folder}/config.json")
    with torch.device("meta"):
        model = build(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    state = {}
    for name, t in read_safetensors(folder).items():
        ours = our_name(name)
        if IGNORED.search(name) or (ours == "lm_head.weight" and config.tie_embeddings):
            continue
        if ours not in expected:
            raise CheckpointError(f"{folder}: unknown tensor {name} (shape {tuple(t.shape)}) for this config; "
                                  f"the folder and config.json do not match this model")
        if t.shape != expected[ours]:
            raise CheckpointError(f"{folder}: tensor {name} has shape {tuple(t.shape)}, config.json implies "
                                  f"{tuple(expected[ours])}")
        state[ours] = t
    missing = sorted(hf_name(k) for k in expected.keys() - state.keys())
    if missing:
        raise CheckpointError(f"{folder}: missing tensor{'s' * (len(missing) > 1)} {', '.join(missing[:5])}"
                              f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
    dtype = dtype or state["embed_tokens.weight"].dtype
    state = {k: v if v.dtype == dtype else v.to(dtype) for k, v in state.items()}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:  # assignment replaced the shared parameter; share it again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def save_pretrained(model: GPT, out_dir, tokenizer=None):
    """config.json + model.safetensors, plus the tokenizer: a tokenizer.json is copied, a tiktoken encoding's
    name is recorded (our loader reads it; other tools need the matching tokenizer.json)."""
    safetensors_torch = _require("safetensors.torch")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {hf_name(k): v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_embeddings)}  # a tied head is not stored twice
    dtype = model.embed_tokens.weight.dtype
    cfg = hf_config(model.config, dtype, getattr(tokenizer, "eot_token", None))
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
    elif tokenizer is not None:
        cfg["tokenizer"] = tokenizer.name  # prepare_data.get_tokenizer(name) rebuilds it
    safetensors_torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ----------------------------------------------------------------------------- tokenizer

class HFTokenizer:
    """A tokenizer.json (the `tokenizers` package) behind the interface of prepare_data's tiktoken encodings:
    encode(text, allowed_special=...), encode_ordinary(text), decode(ids), eot_token, n_vocab, name."""

    def __init__(self, path, eot_token=None, name=None):
        tokenizers = _require("tokenizers")
        self.path = Path(path)
        self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        self._plain = tokenizers.Tokenizer.from_file(str(self.path))
        self._plain.encode_special_tokens = True  # special-token text is encoded as plain text
        self.name = name or str(self.path)
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self.eot_token = eot_token if eot_token is not None else self._tok.token_to_id("<|endoftext|>")
        if self.eot_token is None:
            raise CheckpointError(f"{path}: no end-of-text token (no eos_token_id in config.json and no "
                                  f"<|endoftext|> in the tokenizer)")

    def encode(self, text, allowed_special=()):
        """Like tiktoken: special-token text is an error unless allowed ("all" or a set of them)."""
        if allowed_special != "all":
            banned = [s for s in self.special if s in text and s not in allowed_special]
            if banned:
                raise ValueError(f"text contains special tokens {banned}; pass allowed_special or use encode_ordinary")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text):
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(name_or_path):
    """The tokenizer of a Hugging Face folder, a tokenizer.json file or a hub id; the end-of-text id comes from
    the folder's config.json (eos_token_id) when it has one."""
    p = Path(name_or_path)
    if p.is_file():
        return HFTokenizer(p)
    folder = resolve(name_or_path, patterns=("tokenizer*", "config.json", "special_tokens_map.json"))
    tok = folder_tokenizer(folder) if folder.is_dir() else None
    if tok is None:
        raise CheckpointError(f"no tokenizer.json in {folder}")
    return tok


def folder_tokenizer(folder: Path):
    """A folder's tokenizer: its tokenizer.json, or the tiktoken encoding our export recorded; None if neither."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json", cfg.get("eos_token_id"), name=str(folder))
    if "tokenizer" in cfg:
        from prepare_data import get_tokenizer
        return get_tokenizer(cfg["tokenizer"])
    return None


# ----------------------------------------------------------------------------- command line

def main(argv):
    p = argparse.ArgumentParser(description="Export a model to a Hugging Face folder (config.json + safetensors).")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="python hf.py export SRC OUT_DIR")
    ex.add_argument("src", help="a train.py out_dir, a ckpt.pt, or a Hugging Face folder / hub id")
    ex.add_argument("out_dir", help="the folder to write (not a train.py out_dir: its config.json differs)")
    ex.add_argument("--dtype", choices=("float32", "bfloat16"), help="convert the weights (default: unchanged)")
    args = p.parse_args(argv)
    from checkpoint import load_model
    if (Path(args.out_dir) / "ckpt.pt").exists():
        sys.exit(f"error: {args.out_dir} holds a train.py checkpoint; export into another folder")
    try:
        loaded = load_model(args.src)
        model = loaded.model.to(getattr(torch, args.dtype)) if args.dtype else loaded.model
        save_pretrained(model, args.out_dir, loaded.tokenizer)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    print(f"{loaded.source} -> {args.out_dir}: {model.num_params() / 1e6:.2f}M parameters, "
          f"{json.loads((Path(args.out_dir) / 'config.json').read_text())['architectures'][0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
