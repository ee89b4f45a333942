# The shared base of the paper's ablations (section 3.3: Tables 5-6, Figure 4; the paper ran them at 500M): an 85M-parameter,
# 12-layer MiniPile model, 2000 steps x 0.26M = 0.5B tokens.  Give it first, then one delta file:
#   python train.py configs/ablations/base.py configs/ablations/mode_key.py
dataset = "minipile"
out_dir = "out/ablations/base"
depth_mode = "value"
depth_stride = None  # half the depth (6); the stride_*.py files change it

vocab_size = 50304
block_size = 1024
n_layer = 12
n_head = 8
n_kv_head = 2
head_dim = 64
n_embd = 512
mlp_hidden = 1408

batch_tokens = 256 * 1024
micro_batch = 32  # per GPU; lower it if memory runs out, gradient accumulation keeps batch_tokens
max_iters = 2000
learning_rate = 1e-3
eval_interval = 250
eval_seqs = 256
ckpt_interval = 500
compile = True
