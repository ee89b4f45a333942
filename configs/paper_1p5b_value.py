# The paper's recipe (section 3): the paper's 1.5B model (1.34B parameters) with Depth-Attention (value-only, stride 24): the 3B
# config's depth, recipe and data at a smaller width.  Data: python prepare_data.py pile --shards N
base_config = "paper_3b_value.py"
out_dir = "out/paper_1p5b_value"

n_head = 24
n_kv_head = 6
n_embd = 1536
mlp_hidden = 4096

micro_batch = 4  # per GPU; lower it if memory runs out, gradient accumulation keeps batch_tokens
