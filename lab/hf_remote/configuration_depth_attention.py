"""
transformers' config class for a Depth-Attention or baseline folder (AutoConfig with
trust_remote_code=True). The export copies this file into every export that transformers has
no class for, beside modeling_depth_attention.py, model.py and baselines.py (lab/export.py).

config.json records our whole ModelConfig (a BaselineConfig for a baseline) under `model_config`,
which is all the model is built from; the Llama-style keys beside it (hidden_size,
max_position_embeddings, ...) describe it to tools that read them, e.g. lm-eval's context length.
"""
from transformers import PretrainedConfig

# The folder's own model code. Besides checking model_config below, importing it makes transformers
# key this config class by that code: it names a remote module by the hash of its file and the files
# it imports, and registers the model class per config class, so without it two folders whose
# model.py differ (exports from two versions of the repository) would share one config class and, in
# one process, run the first folder's model.
from .baselines import make_config


class DepthAttentionConfig(PretrainedConfig):
    # lab/hf.py's ARCHITECTURES: transformers knows no class for it, so a folder loads only with
    # this code, never as a plain Llama that skips the depth step
    model_type = "depth_attention"

    def __init__(self, model_config=None, **kwargs):
        self.model_config = dict(model_config or {})  # asdict(config) of model.py / baselines.py
        if self.model_config:  # transformers also builds an empty one, for its defaults
            # a key or value this code does not know fails here, named
            make_config(**self.model_config)
        super().__init__(**kwargs)
