# SPEC 6: the paper's 410M-class companion (464M parameters) with Depth-Attention (value-only, stride 16),
# trained with the paper's recipe on the Pile.  Data: python prepare_data.py pile --shards N
dataset = "pile"
out_dir = "out/paper_410m_value"
depth_mode = "value"

vocab_size = 50304
block_size = 2048
n_layer = 32
n_head = 16
n_kv_head = 4
head_dim = 64
n_embd = 1024
mlp_hidden = 2816
rope_theta = 10000.0
qk_norm = True
tie_embeddings = False
init_std = 0.02  # SPEC 6 gives 0.01 for the 1.5B/3B models only
depth_stride = 16
depth_recent_window = 0

batch_tokens = 1024 * 2048
micro_batch = 8  # per GPU; lower it if memory runs out, gradient accumulation keeps batch_tokens
max_iters = 15259  # 32B tokens / 2,097,152 per step; SPEC 6 gives no 410M budget, we reuse the larger models'
learning_rate = 3e-4
min_lr_ratio = 0.1
warmup_frac = 0.02
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 500
eval_seqs = 1024
ckpt_interval = 500
compile = True
