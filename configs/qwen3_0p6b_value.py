# Qwen3-0.6B's shape (its config.json: 28 layers, width 1024, 16 query and 8 KV heads of 128, MLP
# 3072, q/k-norm, tied embeddings, RoPE base 1e6, 151,936 tokens) as Depth-Attention (value, the
# default stride): what `--init_from=Qwen/Qwen3-0.6B-Base --depth_mode=value` trains, for
#   python train.py configs/qwen3_0p6b_value.py --memory_plan=True
# without downloading it (docs/pretrained.md has the training command; --init_from sets all this).
out_dir = "out/qwen3_value"
depth_mode = "value"

vocab_size = 151936
block_size = 4096  # docs/pretrained.md's windows (the release's config.json says more)
n_layer = 28
n_head = 16
n_kv_head = 8
head_dim = 128
n_embd = 1024
mlp_hidden = 3072
qk_norm = True
tie_embeddings = True
rope_theta = 1e6
norm_eps = 1e-6

batch_tokens = 131072  # 32 windows a step, as the docs' command
micro_batch = 1  # per GPU: the plan's largest on 24 GB with --activation_checkpointing=True
learning_rate = 1e-4
max_iters = 500
