# The CPU base of the ablation sweep (python ablate.py): Shakespeare bytes, a 12-layer model small enough
# that ten runs x three seeds train in about an hour on two cores. 12 layers as in base.py, so the same
# delta files give the same strides (half 6, quarter 3, first-layer-only 12, full 1).
dataset = "shakespeare"
out_dir = "out/ablations/cpu"
vocab_size = None  # the 257 byte tokens, read from meta.json
depth_mode = "value"
depth_stride = None

block_size = 128
n_layer = 12
n_head = 4
n_kv_head = 2
head_dim = 16
n_embd = 64
mlp_hidden = 176

batch_tokens = 2048
max_iters = 600
learning_rate = 3e-3
eval_interval = 100
eval_seqs = 128
sample_tokens = 0
