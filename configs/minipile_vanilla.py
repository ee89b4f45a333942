# The vanilla twin of minipile_value.py: the same model and run without the depth step (depth_mode).
# Data: python prepare_data.py minipile
dataset = "minipile"
out_dir = "out/minipile_vanilla"
depth_mode = "vanilla"

vocab_size = 50304  # GPT-2's 50257 tokens padded to a multiple of 64
block_size = 1024
n_layer = 12
n_head = 12
n_kv_head = 3  # GQA 4x, as in the paper's models
head_dim = 64
n_embd = 768
mlp_hidden = 2048
depth_stride = None  # half the depth (6): layers 1-6 read layer 0, layers 7-11 read layers 0 and 6

batch_tokens = 512 * 1024
micro_batch = 16  # per GPU; lower it if memory runs out, gradient accumulation keeps batch_tokens
max_iters = 3000
learning_rate = 1e-3
eval_interval = 250
eval_seqs = 256
ckpt_interval = 500
compile = True
