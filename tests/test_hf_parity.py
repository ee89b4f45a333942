"""`vanilla` is a plain Qwen3 decoder: same weights, same logits as Hugging Face transformers'
Qwen3ForCausalLM, an implementation written independently of ours. transformers is a test-only
dependency (.ci/run installs it)."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from conftest import tiny_model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_vanilla_equals_transformers_qwen3(tie, n_kv_head):
    ours = tiny_model( depth_mode="vanilla", n_kv_head=n_kv_head, tie_embeddings=tie,
                      rope_theta=500.0, block_size=64).eval()
    c = ours.config
    hf_config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.n_embd,
                            intermediate_size=c.mlp_hidden, num_hidden_layers=c.n_layer,
                            num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                            head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
                            tie_word_embeddings=tie, max_position_embeddings=c.block_size,
                            attention_bias=False, attn_implementation="eager")
    theirs = Qwen3ForCausalLM(hf_config).eval()
    # Our module names follow Qwen3's, under "model." except the head.
    state = {(k if k.startswith("lm_head") else "model." + k): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set()), (missing,
                                                                                       unexpected)
    if tie:
        assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()

    idx = torch.randint(0, c.vocab_size, (2, 40))
    with torch.no_grad():
        mine, _ = ours(idx)
        ref = theirs(input_ids=idx).logits
    diff = (mine - ref).abs().max().item()
    # float32 on both sides (transformers computes norms and RoPE frequencies in float32 whatever
    # the dtype), so the bar is float32 rounding on logits of size ~5; a wrong norm, RoPE layout or
    # GQA grouping is O(1).
    assert diff < 1e-4, f"vanilla logits differ from transformers' Qwen3 by {diff:.3e}"
    # Negative control: the same comparison notices a different RoPE base.
    theirs.model.rotary_emb.inv_freq.mul_(0.5)
    with torch.no_grad():
        off = (theirs(input_ids=idx).logits - mine).abs().max().item()
    assert off > 1e-2, f"the parity check cannot tell a wrong RoPE apart ({off:.3e})"
