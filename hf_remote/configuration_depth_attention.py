"""
transformers' config class for a Depth-Attention or baseline folder (AutoConfig with trust_remote_code=True).
hf.save_pretrained copies this file into every export that transformers has no class for, beside
modeling_depth_attention.py, model.py and baselines.py.

config.json records our whole ModelConfig (a BaselineConfig for a baseline) under `model_config`, which is all
the model is built from; the Llama-style keys beside it (hidden_size, max_position_embeddings, ...) describe it
to tools that read them, e.g. lm-eval's context length.
"""
from transformers import PretrainedConfig


class DepthAttentionConfig(PretrainedConfig):
    model_type = "depth_attention"  # hf.py's REMOTE_MODEL_TYPE: transformers knows no class for it, so a folder
                                    # loads only with this code, never as a plain Llama that skips the depth step

    def __init__(self, model_config=None, **kwargs):
        self.model_config = dict(model_config or {})  # asdict(config) of model.py / baselines.py
        super().__init__(**kwargs)
