"""
Our model as a transformers model: AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True) on an export of a Depth-Attention mode, a looped model or a baseline.
hf.save_pretrained copies this file into the folder beside model.py and baselines.py, copied from
the repository at export time, so what transformers runs is GPT.forward itself (with its KV cache,
KVCache), not a second implementation:

    DepthAttentionForCausalLM   forward -> CausalLMOutputWithPast (logits, loss with labels),
                                generate()
    DepthAttentionCache         our KVCache behind transformers' Cache, handed from one generate
                                step to the next

Parameter names are the export's: ours under `model.`, and `lm_head.weight`. Padded batches are
refused: the cache holds one length for the whole batch. output_hidden_states gives transformers'
tuple (the embeddings, each effective layer's output, the last one after the final norm; a plain
residual stream only), and gradient_checkpointing_enable() recomputes what train.py's
--activation_checkpointing does (baselines.checkpoint_units).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .baselines import build_model, make_config, residual_of, wrap_units
from .configuration_depth_attention import DepthAttentionConfig

# generate() passes the cache as `cache` (before 5.24: past_key_values); tested on 5.24
MIN_TRANSFORMERS = (5, 24)
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
    raise ImportError(f"this model's code needs transformers>=5.24 "
                      f"(found {transformers.__version__}): pip install -U 'transformers>=5.24,<6'")

# PEFT's default LoRA targets for this model type, Qwen3's and Llama's (the attention's query and
# value projections), registered where PEFT looks them up, so that get_peft_model(model,
# LoraConfig(...)) works without naming modules. peft is optional.
PEFT_LORA_TARGETS = ["q_proj", "v_proj"]
try:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA
    LORA.setdefault(DepthAttentionConfig.model_type, PEFT_LORA_TARGETS)
except ImportError:
    pass


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
    supports_gradient_checkpointing = True

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
        self.unwrap = None  # undoes gradient checkpointing's wrappers (baselines.wrap_units)
        self.post_init()

    def get_input_embeddings(self):
        return self.gpt.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=checkpoint,
                                    every_n_layers=1):
        """gradient_checkpointing_enable() / _disable(): every unit train.py recomputes (a block,
        or a baseline's pieces of one) runs under gradient_checkpointing_func while training.
        Always non-reentrant: a block reads the earlier layers' K and V in lists, which a
        reentrant checkpoint would cut from the graph (no gradient to those layers' depth step).
        every_n_layers is not supported: every unit is recomputed."""
        if self.unwrap is not None:
            self.unwrap()
            self.unwrap = None
        self.gradient_checkpointing = enable  # what transformers' is_gradient_checkpointing reads
        if not enable:
            return

        def wrap(method):
            def run(*args, **kwargs):
                if not (self.training and torch.is_grad_enabled()):  # inference: nothing to keep
                    return method(*args, **kwargs)
                return gradient_checkpointing_func(method, *args, use_reentrant=False, **kwargs)
            return run
        self.unwrap = wrap_units(self.gpt, wrap)

    def _with_hidden_states(self, run):
        """(run()'s result, transformers' hidden_states): the embeddings, each effective layer's
        output and, in place of the last, the final norm's, as Llama and Qwen3 return them."""
        if residual_of(self.gpt.config) != "add":
            raise ValueError("output_hidden_states needs a plain residual stream; a baseline's "
                             "blocks feed its own mixing of the streams, not one hidden state")
        states = []
        keep = [self.gpt.embed_tokens.register_forward_hook(lambda m, i, out: states.append(out))]
        keep += [block.register_forward_hook(lambda m, i, out: states.append(out[0]))
                 for block in self.gpt.layers]
        keep.append(self.gpt.norm.register_forward_hook(lambda m, i, out: states.append(out)))
        try:
            result = run()
        finally:  # before any backward: a recomputed block must not append again
            for handle in keep:
                handle.remove()
        return result, tuple(states[:-2] + states[-1:])

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
        if kwargs.get("output_attentions"):
            raise ValueError("this model returns the logits, the loss, the cache and the hidden "
                             "states; no attentions")
        hidden = kwargs.get("output_hidden_states")
        hidden = self.config.output_hidden_states if hidden is None else hidden
        if cache is None and use_cache:
            cache = DepthAttentionCache()
        if cache is not None and not isinstance(cache, DepthAttentionCache):
            raise ValueError(f"this model runs on its own KV cache, not a "
                             f"{type(cache).__name__}: pass no cache (generate makes one) or the "
                             f"cache a previous call returned")
        # Padding can only be in a prompt: a decode step (one token after the prefill) skips the
        # check, which on a GPU would wait for the device at every token.
        prompt = cache is None or cache.get_seq_length() == 0 or input_ids.shape[1] > 1
        if attention_mask is not None and prompt and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported (the KV cache keeps one length "
                             "for the whole batch): pass sequences of equal length without "
                             "padding, or one at a time")
        targets = None
        if labels is not None:  # GPT's targets: the next token at each position, -1 where ignored
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            targets = targets.masked_fill(targets == -100, -1)
        kv = None if cache is None else cache.reserve(self.gpt, *input_ids.shape)
        states = None
        if hidden:
            (logits, loss), states = self._with_hidden_states(
                lambda: self.gpt(input_ids, targets, cache=kv))
        else:
            logits, loss = self.gpt(input_ids, targets, cache=kv)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache, hidden_states=states)
        return out if return_dict is not False else out.to_tuple()
