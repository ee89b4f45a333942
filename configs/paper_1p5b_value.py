# SPEC 6: the paper's 1.5B model (1.34B parameters) with Depth-Attention (value-only, stride 24),
# trained with the paper's recipe on the Pile.  Data: python prepare_data.py pile --shards N
dataset = "pile"
out_dir = "out/paper_1p5b_value"
depth_mode = "value"

vocab_size = 50304
block_size = 2048
n_layer = 48
n_head = 24
n_kv_head = 6
head_dim = 64
n_embd = 1536
mlp_hidden = 4096
rope_theta = 10000.0
qk_norm = True
tie_embeddings = False
init_std = 0.01
depth_stride = 24
depth_recent_window = 0

batch_tokens = 1024 * 2048
micro_batch = 4  # per GPU; lower it if memory runs out, gradient accumulation keeps batch_tokens
max_iters = 15259  # 32B tokens / 2,097,152 per step: one pass
learning_rate = 1e-3
min_lr_ratio = 0.1
warmup_frac = 0.02
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 500
eval_seqs = 1024
ckpt_interval = 500
compile = True
