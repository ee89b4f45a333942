"""
Which model a flat dict of keys names (train.py's namespace, a checkpoint's stored dict of any
version, a Hugging Face record): `BaselineConfig` (model.ModelConfig and baselines.py's switches),
`make_config`, and `build_model`, which imports baselines.py only for a config that names one of
its models; and what activation checkpointing recomputes (`wrap_units`). An export carries this
file beside model.py and baselines.py (support/hf.py), so it imports nothing else.

    model = build_model(make_config(residual="mhc", depth_mode="vanilla", n_layer=12))
"""
from dataclasses import dataclass, fields

import torch.nn as nn

from model import DEPTH_MODES, GPT, ConfigError, ModelConfig, knob, need

# The names baselines.py builds (its BASELINES, ATTENTIONS and DEPTH_MODELS, tests/test_mode_lists
# checks they agree): a config that names none of them is a plain model.GPT.
RESIDUALS = ("add", "denseformer", "attnres", "mhc")  # by `residual`
ATTENTIONS = ("standard", "keyless")                   # by `attention`
BASELINE_MODES = ("lime", "resformer", "resformer_learned")  # baselines.py's DEPTH_MODES rows


@dataclass
class BaselineConfig(ModelConfig):
    # The baselines of the paper's Table 1; each runs with depth_mode="vanilla".
    residual: str = knob("add", "residual path: add (the plain stream) or a baseline, with "
                         "depth_mode=vanilla")
    attention: str = knob("standard", "standard (q . k), or keyless (q R . v: no keys, a V-only "
                          "cache; Keyless Attention) with depth_mode vanilla/value/uniform")
    denseformer_dwa_dilation: int = knob(1, "DenseFormer: every k-th earlier output (authors: 1)")
    denseformer_dwa_period: int = knob(1, "DenseFormer: after every p-th block (authors: 1)")
    attnres_block_size: int = knob(12, "AttnRes: sublayers per block, 2 a layer (authors: 12)")
    attnres_recency_bias_init: float = knob(3.0, "AttnRes: the stream's initial logit bonus "
                                            "(authors: 3)")
    mhc_num_streams: int = knob(4, "mHC: parallel residual streams n (authors: 4)")
    mhc_alpha_init: float = knob(0.01, "mHC: initial gain of the dynamic maps (authors: 0.01)")
    mhc_sinkhorn_iters: int = knob(20, "mHC: Sinkhorn row/column rounds (authors: 20)")

    def __post_init__(self):
        super().__post_init__()
        for name in ("denseformer_dwa_dilation", "denseformer_dwa_period", "attnres_block_size",
                     "mhc_num_streams", "mhc_sinkhorn_iters"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1,
                 f"BaselineConfig: {name} must be a positive integer, got {value!r}")
        need(self.residual in RESIDUALS, f"BaselineConfig: unknown residual {self.residual!r}; "
             f"choose one of {', '.join(RESIDUALS)}")
        if self.residual != "add":  # the paper compares each with vanilla attention, one change
            need(self.depth_mode == "vanilla", f"BaselineConfig: residual={self.residual} is a "
                 f"baseline with vanilla attention; use --depth_mode=vanilla with "
                 f"--residual={self.residual} (not depth_mode={self.depth_mode})")
            need(self.n_loops == 1, f"BaselineConfig: residual={self.residual} is defined for one "
                 f"pass over the layers; use --n_loops=1 with --residual={self.residual}")
        need(self.attention in ATTENTIONS, f"BaselineConfig: unknown attention "
             f"{self.attention!r}; choose one of {', '.join(ATTENTIONS)}")
        if self.attention == "keyless":  # its depth step mixes values; there is no key to mix
            need(not DEPTH_MODES[self.depth_mode].mixes_k, f"BaselineConfig: attention=keyless has "
                 f"no keys for depth_mode={self.depth_mode} to mix; use --depth_mode=value, "
                 f"uniform or vanilla")
            need(self.residual == "add", f"BaselineConfig: attention=keyless runs on the plain "
                 f"residual stream; use --residual=add with --attention=keyless (not "
                 f"residual={self.residual})")
        need(self.mhc_num_streams >= 2,
             f"BaselineConfig: mhc_num_streams must be at least 2, got {self.mhc_num_streams}")


# The baselines' own keys beyond ModelConfig's: `residual`, `attention` and the methods' knobs,
# which a plain model (residual "add", standard attention) has no use for.
BASELINE_KEYS = tuple(f.name for f in fields(BaselineConfig)
                      if f.name not in {g.name for g in fields(ModelConfig)})
KNOBS = tuple(k for k in BASELINE_KEYS if k not in ("residual", "attention"))


def make_config(**keys) -> ModelConfig:
    """The config a flat dict of keys describes (train.py's namespace, a checkpoint's stored dict of
    any version, a Hugging Face record): a BaselineConfig for a baseline, else a ModelConfig, whose
    dict then carries no baseline keys. Every key is checked either way; an unknown one is a
    ConfigError."""
    known = [f.name for f in fields(BaselineConfig)]
    unknown = sorted(keys.keys() - set(known))
    if unknown:
        raise ConfigError(f"unknown model keys {unknown} (from a newer version of this code?); this "
                         f"version knows {', '.join(known)}")
    if keys.get("depth_mode") in BASELINE_MODES:
        from baselines import DEPTH_MODELS  # noqa: F401  (its rows join model.DEPTH_MODES)
    config = BaselineConfig(**keys)
    if config.residual == "add" and config.attention == "standard":
        return ModelConfig(**{k: v for k, v in keys.items() if k not in BASELINE_KEYS})
    return config


def depth_modes() -> tuple:
    """Every depth_mode a config may name: model.DEPTH_MODES's rows, then baselines.py's."""
    return tuple(dict.fromkeys([*DEPTH_MODES, *BASELINE_MODES]))


def residual_of(config: ModelConfig) -> str:
    """A config's residual path: "add" (the plain stream) for a ModelConfig, else the baseline."""
    return getattr(config, "residual", "add")


def attention_of(config: ModelConfig) -> str:
    """A config's attention: "standard" for a ModelConfig, else its `attention` key."""
    return getattr(config, "attention", "standard")


def build_model(config: ModelConfig) -> GPT:
    """The model a config describes: a baseline, LIMe, a keyless model (baselines.py), or GPT."""
    residual, attention = residual_of(config), attention_of(config)
    if residual == "add" and attention == "standard" and config.depth_mode not in BASELINE_MODES:
        return GPT(config)
    from baselines import ATTENTIONS as BY_ATTENTION, BASELINES, DEPTH_MODELS
    if residual != "add":
        return BASELINES[residual](config)
    if attention != "standard":
        return BY_ATTENTION[attention](config)
    return DEPTH_MODELS.get(config.depth_mode, GPT)(config)  # ResFormer's rows: GPT's layers


# ----------------------------------------------------------------------------- checkpointing

def checkpoint_units(model) -> list:
    """The (object, method name) pairs activation checkpointing recomputes: each block's forward,
    or the pieces a model class names in its `recomputed` (a block's methods or modules)."""
    units = []
    for block in model.layers:
        for name in getattr(type(model), "recomputed", ("forward",)):
            part = getattr(block, name)
            units.append((part, "forward") if isinstance(part, nn.Module) else (block, name))
    return units


def wrap_units(model, wrap):
    """Replace every unit's method by wrap(method); returns the function that puts them back. An
    instance attribute shadows the class's method, and nn.Module.__call__ (with its hooks) and the
    baselines find it."""
    units = checkpoint_units(model)
    for owner, name in units:
        setattr(owner, name, wrap(getattr(owner, name)))
    return lambda: [delattr(owner, name) for owner, name in units]
