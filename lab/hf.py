"""
Hugging Face folders in: the authors' released checkpoints (paper section 3, Table 1:
zeng123/Depth-attention-3B, zeng123/AttnRes-3B, zeng123/DenseFormer-3B, zeng123/mHC-3B) and our
exports (lab/export.py), from a folder or a hub id, and a tokenizer.json behind tokenizer.py's
interface. checkpoint.load_model and tokenizer.get_tokenizer come here for a folder, a
tokenizer.json or a hub id; nothing else does.

    model = from_pretrained("zeng123/Depth-attention-3B")

A folder holds config.json, model.safetensors (or shards listed by model.safetensors.index.json) and
tokenizer.json, in the Llama layout: our parameter names under "model.", and lm_head. A folder that
cannot be used is a CheckpointError; safetensors, tokenizers and huggingface_hub are optional.
"""
import json
import re
from pathlib import Path

import torch

from baselines import KNOBS, build_model
from configurator import CheckpointError, DataError, UserError, reason, require
from model import ConfigError as ModelConfigError

EOT = "<|endoftext|>"  # the end-of-text token's text (tokenizer.EOT)
OUR_CONFIG = "model_config"  # our exports also record asdict(config) under this key
REMOTE_ARCH = "DepthAttentionForCausalLM"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                 REMOTE_ARCH: "depth_attention"}
IGNORED = re.compile(r"(^|\.)lm_head_layernorm\.weight$|rotary_emb\.inv_freq$")  # unused, derived
# The authors' `baseline_mode` spellings -> our `residual`; their knobs carry our names (KNOBS)
AUTHORS_BASELINE_MODES = {"denseformer": "denseformer", "densetransformer": "denseformer",
                          "mhc": "mhc", **dict.fromkeys(("attnres", "block_attnres", "block-attnres",
                          "attention_residual", "attention-residual"), "attnres")}


def is_hf_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def looks_like_hub_id(name) -> bool:
    """owner/name that is not a local path: no such file and no local folder called owner."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", str(name))) and not Path(name).exists() \
        and not Path(str(name).split("/")[0]).is_dir()


def snapshot(path_or_hub_id, patterns=("*.json", "*.safetensors", "*.txt", "*.model")) -> Path:
    """A local folder as it is; a hub id downloaded (or found in the cache) by huggingface_hub."""
    if not looks_like_hub_id(path_or_hub_id):
        return Path(path_or_hub_id)
    hub = require("huggingface_hub", f"downloading {path_or_hub_id} from the Hugging Face hub")
    try:
        return Path(hub.snapshot_download(str(path_or_hub_id), allow_patterns=list(patterns)))
    except Exception as e:  # one call, whose errors are the network's or the hub's
        raise DataError(f"{path_or_hub_id} is not a local path, and downloading it from the hub "
                        f"failed ({reason(e)}); check the path, the hub id or the network") from e


def read_json(path, error=CheckpointError) -> dict:
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise error(f"{path} is not readable JSON ({reason(e)}); restore it") from None
    if not isinstance(value, dict):
        raise error(f"{path} holds a JSON {type(value).__name__}, not an object; restore it")
    return value


class HFTokenizer:
    """A tokenizer.json (the `tokenizers` package) behind tiktoken's interface, from the file at
    path or from text, its contents (what a checkpoint keeps: never a path)."""

    def __init__(self, path, eot_token=None, name=None, text=None):
        tokenizers = require("tokenizers", "a Hugging Face tokenizer.json")
        try:
            self.text = Path(path).read_text() if text is None else text
            self._tok = tokenizers.Tokenizer.from_str(self.text)
            self._plain = tokenizers.Tokenizer.from_str(self.text)
        except Exception as e:  # unreadable, not JSON, or JSON that is not a tokenizer
            raise DataError(f"{path}: not a readable tokenizer.json ({reason(e)})") from e
        self._plain.encode_special_tokens = True  # special-token text encoded as plain text
        self.name = name or str(path)
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.special = {t.content for t in self._tok.get_added_tokens_decoder().values()
                        if t.special}
        self.eot_token = eot_token if eot_token is not None else self._tok.token_to_id(EOT)
        if not isinstance(self.eot_token, int):
            raise DataError(f"{path}: no end-of-text token (no eos_token_id in config.json, no {EOT} "
                            f"in the tokenizer)")

    def encode(self, text, allowed_special=()):
        """Like tiktoken: special-token text is an error unless allowed ("all" or a set)."""
        if allowed_special != "all":
            if banned := [s for s in self.special if s in text and s not in allowed_special]:
                raise ValueError(f"text contains special tokens {banned}; pass allowed_special or "
                                 f"use encode_ordinary")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text):
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(name_or_path):
    """The tokenizer of a tokenizer.json file, or of a folder or hub id: the tiktoken encoding our
    export recorded in config.json (its name), else its tokenizer.json, whose end-of-text id comes
    from config.json's eos_token_id where it has one."""
    p = Path(name_or_path)
    if p.is_file():
        return HFTokenizer(p)
    folder = snapshot(name_or_path, ("tokenizer*", "config.json", "special_tokens_map.json"))
    cfg = read_json(folder / "config.json", DataError) if (folder / "config.json").is_file() else {}
    if "tokenizer" in cfg:  # a tiktoken encoding's name: tokenizer.get_tokenizer builds it
        if cfg["tokenizer"] not in ("bytes", "gpt2"):  # (tokenizer.TIKTOKEN)
            raise DataError(f"{folder / 'config.json'} names the tokenizer {cfg['tokenizer']!r}, "
                            f"not bytes or gpt2; restore the file or export again")
        return cfg["tokenizer"]
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} holds no tokenizer.json; copy the model's tokenizer.json there")
    eos = cfg.get("eos_token_id")
    return HFTokenizer(folder / "tokenizer.json", eos if isinstance(eos, int) else None,
                       name=str(folder))


def config_from_hf(cfg: dict, where="config.json") -> dict:
    """The model keys of a config.json (Llama, Qwen3 or ours): our own record when present, else
    the authors' Llama keys (Qwen3's too)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if ARCHITECTURES.get(arch) is None or cfg.get("model_type", ARCHITECTURES[arch]) != \
            ARCHITECTURES[arch]:
        raise CheckpointError(f"{where}: unknown architecture {arch} (model_type "
                              f"{cfg.get('model_type')!r}); this loader reads "
                              f"{', '.join(ARCHITECTURES)} folders")
    if OUR_CONFIG in cfg:
        return cfg[OUR_CONFIG]
    supported = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                 "scale_embeds": False, "rope_scaling": None, "use_sliding_window": False}
    unsupported = {k: cfg[k] for k, ok in supported.items() if cfg.get(k, ok) != ok}
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope_theta here
    if rope.get("rope_type", "default") != "default":
        unsupported["rope_parameters"] = rope
    if unsupported:
        raise CheckpointError(f"{where}: settings this model does not implement: {unsupported}")
    try:
        n_head, depth = cfg["num_attention_heads"], bool(cfg.get("use_depth_attention", False))
        qk_norm = bool(cfg.get("use_qk_norm", arch == "Qwen3ForCausalLM"))  # Qwen3 always has it
        keys = dict(
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
            # the authors' Depth-Attention model applies k_norm after RoPE (their SDPA path)
            k_norm_after_rope=bool(cfg.get("k_norm_after_rope", depth and qk_norm)))
    except KeyError as e:
        raise CheckpointError(f"{where} lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:  # "hidden_size": "2048" // 16
        raise CheckpointError(f"{where}: a value of the wrong type ({e})") from None
    if cfg.get("baseline_mode") not in (None, "", "none"):  # a hidden-state baseline (Table 1)
        mode = str(cfg["baseline_mode"]).strip().lower()
        if mode not in AUTHORS_BASELINE_MODES:
            raise CheckpointError(f"{where}: baseline_mode={cfg['baseline_mode']!r} is not one of "
                                  f"the paper's baselines ({', '.join(AUTHORS_BASELINE_MODES)})")
        keys.update(residual=AUTHORS_BASELINE_MODES[mode], depth_mode="vanilla",
                    **{k: cfg[k] for k in KNOBS if k in cfg})
    return keys


def read_safetensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors (one file, or the shards its index lists), mapped."""
    safetensors = require("safetensors", "reading a Hugging Face folder")
    index = folder / "model.safetensors.index.json"
    present = [p.name for p in sorted(folder.glob("*.safetensors"))]
    weight_map, files = None, present
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map; restore it, or delete it if the "
                                  f"folder has one file")
        files = sorted(set(weight_map.values()))
        if unlisted := sorted(set(present) - set(files)):  # transformers would read another file
            raise CheckpointError(f"{folder} holds {', '.join(unlisted)} beside an index that "
                                  f"lists other files, the remains of two exports; delete the "
                                  f"stale ones, or export again with --overwrite")
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
        except (safetensors.SafetensorError, OSError) as e:
            raise CheckpointError(f"{folder / name} is not a readable safetensors file ({e}); it "
                                  f"may be truncated: download or export it again") from e
    if weight_map is not None and weight_map.keys() != tensors.keys():
        raise CheckpointError(f"{index} and the shards disagree on "
                              f"{sorted(weight_map.keys() ^ tensors.keys())[:5]}")
    return tensors


def shared_names(model) -> dict:
    """{name: the first name of the same tensor} (a tied lm_head): stored once, tied again."""
    first, tied = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if first.setdefault(id(t), name) != name:
            tied[name] = first[id(t)]
    return tied


def from_pretrained(path_or_hub_id, dtype=None):
    """The model in a Hugging Face folder (or hub id), built on the meta device and given the
    memory-mapped weights by assignment, so it is never held twice; dtype None keeps the file's
    (the embedding's): bf16 stays bf16."""
    folder = snapshot(path_or_hub_id)
    if not is_hf_folder(folder):
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (config.json + "
                              f"*.safetensors)")
    keys = config_from_hf(read_json(folder / "config.json"), f"{folder}/config.json")
    try:
        with torch.device("meta"):
            model = build_model(keys)
    except ModelConfigError as e:  # a key or value this code does not know
        raise CheckpointError(f"{folder}/config.json: {e}") from None
    tied = shared_names(model)
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
    state = {}
    for name, t in read_safetensors(folder).items():
        ours = name.removeprefix("model.")
        if IGNORED.search(name) or (ours == "lm_head.weight" and model.config.tie_embeddings):
            continue
        if ours not in expected:
            raise CheckpointError(f"{folder}: unknown tensor {name} (shape {tuple(t.shape)}) for "
                                  f"this config; the weights and config.json do not match")
        if t.shape != expected[ours]:
            raise CheckpointError(f"{folder}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"config.json implies {tuple(expected[ours])}")
        state[ours] = t
    if missing := sorted(hf_name(k) for k in expected.keys() - state.keys()):
        raise CheckpointError(f"{folder}: missing tensor{'s' * (len(missing) > 1)} "
                              f"{', '.join(missing[:5])}" + (f" and {len(missing) - 5} more"
                                                             if len(missing) > 5 else ""))
    dtype = dtype or state["embed_tokens.weight"].dtype
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict({**state, **{k: state[first] for k, first in tied.items()}}, assign=True)
    for name, first in tied.items():  # assignment replaced the shared parameter; share it again
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    return model


def hf_name(ours: str) -> str:
    """Our parameter name -> the Llama / Qwen3 name."""
    return ours if ours.startswith("lm_head.") else "model." + ours


