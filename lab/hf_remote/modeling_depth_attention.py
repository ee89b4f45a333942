"""
Our model as a transformers model: AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True) on an export of a Depth-Attention mode, a looped model or a baseline.
lab/export.py copies this file into the folder beside model.py and baselines.py, copied from
the repository at export time, so what transformers runs is GPT.forward itself (with its KV cache,
KVCache), not a second implementation:

    DepthAttentionForCausalLM   forward -> CausalLMOutputWithPast (logits, loss with labels),
                                generate()
    DepthAttentionCache         our KVCache behind transformers' Cache, handed from one generate
                                step to the next

Parameter names are the export's: ours under `model.`, and `lm_head.weight`. A padded batch (left
or right, attention_mask one run of ones per row) gives each row what it gives alone: positions
count from the row's first token, and the depth step mixes layers at one position, so no pad can
reach a real token. Without a cache the real tokens of every row are moved to the front for one
batched pass (pads after them are causal-masked away); a cached padded batch (generate) runs each
row on a cache of its own, one pass per row at every step. output_hidden_states gives transformers'
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

from .baselines import build_model, wrap_units
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


def held(kv):
    """The names of a model.KVCache's tensors: k and v, or v alone (a keyless model's ValueCache)."""
    return [name for name in ("k", "v") if getattr(kv, name) is not None]


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
        # a padded batch: one DepthAttentionCache per row (its real tokens only), and the batch's
        # padded length, the one generate counts in
        self.rows, self.length = None, 0

    def get_seq_length(self, layer_idx=0):
        if self.rows is not None:
            return self.length
        return 0 if self.kv is None else self.kv.pos

    def reserve(self, gpt, batch_size, n_new):
        """The KVCache, with room for n_new more tokens (within block_size; GPT.forward refuses
        beyond it)."""
        old, need = self.kv, self.get_seq_length() + n_new
        if old is None or need > old.max_len:
            grown = 2 * need if old is None else max(need, 2 * old.max_len)
            self.kv = gpt.new_cache(batch_size, min(gpt.config.block_size, grown))
            if old is not None:
                for name in held(old):  # (n_eff_layer, B, n_kv_head, pos, D)
                    getattr(self.kv, name)[:, :, :, :old.pos] = getattr(old, name)[:, :, :, :old.pos]
                self.kv.pos = old.pos
        return self.kv

    def reorder_cache(self, beam_idx):
        if self.rows is not None:
            self._unsupported()  # beams would share (and both write) one row's cache
        rows = beam_idx.to(self.kv.v.device)  # the batch rows (beams) to keep, in their new order
        for name in held(self.kv):
            setattr(self.kv, name, getattr(self.kv, name)[:, rows])

    def reset(self):
        self.kv, self.rows, self.length = None, None, 0

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("DepthAttentionCache supports greedy and sampled generation and "
                                  "beam search (of an unpadded batch); run other decoding "
                                  "strategies with use_cache=False")

    crop = batch_repeat_interleave = batch_select_indices = _unsupported


def real_span(mask):
    """(start, length) of each row's real tokens in a 0/1 attention_mask (B, T), which must be one
    run of ones per row: left or right padding."""
    mask = mask.bool()
    n, start = mask.sum(1), (mask.cumsum(1) == 0).sum(1)
    t = torch.arange(mask.shape[1], device=mask.device)
    if not bool((mask == ((t >= start[:, None]) & (t < (start + n)[:, None]))).all()):
        raise ValueError("attention_mask must hold one run of ones per row (left or right "
                         "padding); rows with gaps or several sequences are not supported")
    return start, n


def move(x, offset, keep):
    """x (B, T, ...) with out[b, t] = x[b, t + offset[b]] where keep[b, t], else 0: a padded row's
    real tokens moved to the front (offset: its pads before them) or back (minus that)."""
    B, T = x.shape[:2]
    trailing = [1] * (x.dim() - 2)
    src = (torch.arange(T, device=x.device) + offset[:, None]).clamp(0, T - 1)
    picked = x.gather(1, src.view(B, T, *trailing).expand_as(x))
    return torch.where(keep.view(B, T, *trailing), picked, 0)


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
        gpt = build_model(config.model_config)
        # not a submodule: its modules are registered below, under the export's names
        self.__dict__["gpt"] = gpt
        self.model = nn.Module()
        for name, module in gpt.named_children():
            if name != "lm_head":
                self.model.add_module(name, module)
        self.lm_head = gpt.lm_head
        # a tensor held under several names (a fork's parameters shared by every block) is
        # saved once, under its first name, as a tied lm_head is
        first = {}
        self._tied_weights_keys = {**self._tied_weights_keys, **{
            f"model.{name}": f"model.{first[id(p)]}" for name, p in
            gpt.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name and name != "lm_head.weight"}}
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
        if getattr(self.gpt.config, "residual", "add") != "add":
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

    def _run(self, input_ids, targets, kv, hidden):
        """((logits, loss), the hidden states or None) of GPT.forward."""
        if hidden:
            return self._with_hidden_states(lambda: self.gpt(input_ids, targets, cache=kv))
        return self.gpt(input_ids, targets, cache=kv), None

    def _per_row(self, input_ids, chunk_mask, cache):
        """The logits (B, T, vocab) of a padded batch continuing cache, each row's real tokens (all
        of them without chunk_mask, a decode step) on its own cache; zeros at the pads, but for the
        last column of a right-padded row: its last real token's, where generate reads the next
        token (which then continues the row's own cache: right padding generates exactly)."""
        B, T = input_ids.shape
        if cache.rows is None:
            if cache.kv is not None:
                raise ValueError("padding after an unpadded prefill: pad the whole prompt")
            cache.rows = [DepthAttentionCache() for _ in range(B)]
        logits = None
        for b, row in enumerate(cache.rows):
            keep = chunk_mask[b].bool() if chunk_mask is not None else slice(None)
            ids = input_ids[b:b + 1, keep]
            if ids.shape[1] == 0:  # nothing of this row in the chunk
                continue
            out, _ = self.gpt(ids, cache=row.reserve(self.gpt, 1, ids.shape[1]))
            if logits is None:
                logits = out.new_zeros(B, T, out.shape[-1])
            logits[b, keep] = out[0]
            if chunk_mask is not None and not keep[-1]:
                logits[b, -1] = out[0, -1]
        cache.length += T
        return logits

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
        padded = attention_mask is not None and prompt and not bool(attention_mask.all())
        targets = None
        if labels is not None:  # GPT's targets: the next token at each position, -1 where ignored
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            targets = targets.masked_fill(targets == -100, -1)
        states, loss = None, None
        if cache is not None and (padded or cache.rows is not None):
            if labels is not None or hidden:
                raise ValueError("a padded batch with a cache (generate) returns the logits only: "
                                 "run labels or output_hidden_states without a cache")
            chunk = attention_mask[:, -input_ids.shape[1]:] if padded else None
            logits = self._per_row(input_ids, chunk, cache)
        elif padded:
            start, n = real_span(attention_mask)
            front = torch.arange(input_ids.shape[1], device=n.device) < n[:, None]
            if targets is not None:
                targets = move(targets, start, front).masked_fill(~front, -1)
            ids = move(input_ids, start, front)
            (logits, loss), states = self._run(ids, targets, None, hidden)
            back = attention_mask.bool()
            logits = move(logits, -start, back)
            states = states and tuple(move(h, -start, back) for h in states)
        else:
            kv = None if cache is None else cache.reserve(self.gpt, *input_ids.shape)
            (logits, loss), states = self._run(input_ids, targets, kv, hidden)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache, hidden_states=states)
        return out if return_dict is not False else out.to_tuple()
