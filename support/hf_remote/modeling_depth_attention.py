"""
Our model as a transformers model: AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True) on an export of a Depth-Attention mode, a looped model or a baseline.
hf.save_pretrained copies this file into the folder beside model.py and baselines.py, copied from
the repository at export time, so what transformers runs is GPT.forward itself (with its KV cache,
KVCache), not a second implementation:

    DepthAttentionForCausalLM   forward -> CausalLMOutputWithPast (logits, loss with labels), generate()
    DepthAttentionCache         our KVCache behind transformers' Cache, handed from one generate step to the next

Parameter names are the export's: ours under `model.`, and `lm_head.weight`. Padded batches are
refused: the cache holds one length for the whole batch.
"""
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .baselines import build_model, make_config
from .configuration_depth_attention import DepthAttentionConfig

# generate() passes the cache as `cache` (before 5.24: past_key_values); tested on 5.24
MIN_TRANSFORMERS = (5, 24)
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
    raise ImportError(f"this model's code needs transformers>=5.24 "
                      f"(found {transformers.__version__}): pip install -U 'transformers>=5.24,<6'")


class DepthAttentionCache(Cache):
    """Our KVCache, allocated by the first forward for its batch with room ahead (twice the prompt,
    up to block_size) and doubled when a longer sequence needs more, so generate() needs no length
    up front and a decode step rarely copies the cache; every step writes it in place. Beam search
    reorders its rows; what it cannot do (crop, split or repeat rows) raises rather than doing
    nothing."""

    is_croppable = False  # generate must not plan to take a step back
    # a cache of keys and values: generate feeds only the tokens it has not seen
    is_linear = [False]

    def __init__(self):
        super().__init__(layers=[])
        self.kv = None  # model.KVCache

    def get_seq_length(self, layer_idx=0):
        return 0 if self.kv is None else self.kv.pos

    def reserve(self, gpt, batch_size, n_new):
        """The KVCache, with room for n_new more tokens (within block_size; GPT.forward refuses
        beyond it)."""
        old, need = self.kv, self.get_seq_length() + n_new
        if old is None or need > old.max_len:
            grown = 2 * need if old is None else max(need, 2 * old.max_len)
            self.kv = gpt.new_cache(batch_size, min(gpt.config.block_size, grown))
            if old is not None:
                # (n_eff_layer, B, n_kv_head, pos, D)
                self.kv.k[:, :, :, :old.pos] = old.k[:, :, :, :old.pos]
                self.kv.v[:, :, :, :old.pos] = old.v[:, :, :, :old.pos]
                self.kv.pos = old.pos
        return self.kv

    def reorder_cache(self, beam_idx):
        rows = beam_idx.to(self.kv.k.device)  # the batch rows (beams) to keep, in their new order
        self.kv.k, self.kv.v = self.kv.k[:, rows], self.kv.v[:, rows]

    def reset(self):
        self.kv = None

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("DepthAttentionCache supports greedy and sampled generation and "
                                  "beam search; run other decoding strategies with use_cache=False")

    crop = batch_repeat_interleave = batch_select_indices = _unsupported


class DepthAttentionForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DepthAttentionConfig
    base_model_prefix = "model"
    # forward takes **kwargs but returns the mean loss of its batch, ignoring num_items_in_batch: so
    # Trainer must divide the loss by the gradient accumulation steps itself (it would not, seeing
    # **kwargs)
    accepts_loss_kwargs = False
    # used when tie_word_embeddings
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        gpt = build_model(make_config(**config.model_config))
        # not a submodule: its modules are registered below, under the export's names
        self.__dict__["gpt"] = gpt
        self.model = nn.Module()
        for name, module in gpt.named_children():
            if name != "lm_head":
                self.model.add_module(name, module)
        self.lm_head = gpt.lm_head
        self.post_init()

    def _init_weights(self, module):
        """Nothing: GPT.__init__ initialised every weight (model.py); from_pretrained then loads
        them all."""

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate must not make a DynamicCache: forward makes a DepthAttentionCache

    def forward(self, input_ids, attention_mask=None, cache=None, labels=None, use_cache=None,
                inputs_embeds=None, return_dict=None, **kwargs):
        """Logits (B, T, vocab) of every position, as GPT.forward; the loss when labels are given
        (transformers' convention: labels are the inputs, position t predicts t + 1, -100 is
        ignored). With use_cache=True (generate passes it) or a cache, the tokens continue the cache
        and the output carries it; a plain call runs the cacheless forward, as training does."""
        if inputs_embeds is not None:
            raise ValueError("this model takes input_ids, not inputs_embeds")
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise ValueError("this model returns the logits, the loss and the cache; no attentions or "
                             "hidden states")
        if cache is None and use_cache:
            cache = DepthAttentionCache()
        if cache is not None and not isinstance(cache, DepthAttentionCache):
            raise ValueError(f"this model runs on its own KV cache, not a {type(cache).__name__}: "
                             f"pass no cache (generate makes one) or the cache a previous call returned")
        # Padding can only be in a prompt: a decode step (one token after the prefill) skips the
        # check, which on a GPU would wait for the device at every token.
        prompt = cache is None or cache.get_seq_length() == 0 or input_ids.shape[1] > 1
        if attention_mask is not None and prompt and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported (the KV cache keeps one length for the "
                             "whole batch): pass sequences of equal length without padding, or one at "
                             "a time")
        targets = None
        if labels is not None:  # GPT's targets: the next token at each position, -1 where ignored
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            targets = targets.masked_fill(targets == -100, -1)
        kv = None if cache is None else cache.reserve(self.gpt, *input_ids.shape)
        logits, loss = self.gpt(input_ids, targets, cache=kv)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return out if return_dict is not False else out.to_tuple()
