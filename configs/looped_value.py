# A looped Transformer with Depth-Attention (SPEC 3, looped option; paper: 500M x 3 loops, 2.208 -> 2.194):
# 4 shared blocks applied 3 times = 12 effective layers, minipile_value.py's width and recipe.
# Data: python prepare_data.py minipile
dataset = "minipile"
out_dir = "out/looped_value"
depth_mode = "value"

vocab_size = 50304  # GPT-2's 50257 tokens padded to a multiple of 64
block_size = 1024
n_layer = 4  # distinct blocks, each applied n_loops times
n_loops = 3
n_head = 12
n_kv_head = 3  # GQA 4x, as in the paper's models
head_dim = 64
n_embd = 768
mlp_hidden = 2048
depth_stride = None  # half the effective depth (12 // 2 = 6), counted over the 12 effective layers

batch_tokens = 512 * 1024
micro_batch = 16  # per GPU; lower it if memory runs out, gradient accumulation keeps batch_tokens
max_iters = 3000
learning_rate = 1e-3
eval_interval = 250
eval_seqs = 256
ckpt_interval = 500
compile = True
