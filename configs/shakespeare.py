# The embedded demo, the same run as `python train.py` with no arguments: a 1.2M-parameter Depth-Attention
# model on Shakespeare's plays (byte tokens, prepared on first use), a few minutes on a laptop CPU.
dataset = "shakespeare"
out_dir = "out/shakespeare"
vocab_size = None  # the 257 byte tokens, read from meta.json

block_size = 256
n_layer = 6
n_head = 4
n_kv_head = 2
head_dim = 32
n_embd = 128
mlp_hidden = 384
depth_mode = "value"
depth_stride = None  # half the depth: layers 1-3 read layer 0, layers 4-5 read layers 0 and 3

batch_tokens = 4096
max_iters = 400
learning_rate = 3e-3  # a tiny model tolerates a higher peak than the paper's 1e-3
eval_interval = 100
eval_seqs = 64
sample_tokens = 200
