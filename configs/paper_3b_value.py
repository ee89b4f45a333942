# The paper's recipe (section 3): the paper's 3B model (2.75B parameters) with Depth-Attention (value-only, stride 24),
# trained with the paper's recipe on the Pile.  Data: python prepare_data.py pile --shards N
dataset = "pile"
out_dir = "out/paper_3b_value"
depth_mode = "value"

vocab_size = 50304
block_size = 2048
n_layer = 48
n_head = 32
n_kv_head = 8
head_dim = 64
n_embd = 2048
mlp_hidden = 6912
rope_theta = 10000.0
qk_norm = True
tie_embeddings = False
init_std = 0.01
depth_stride = 24
depth_recent_window = 0

batch_tokens = 1024 * 2048
micro_batch = 2  # per GPU (python train.py THIS_CONFIG --memory_plan=True prints the plan)
# Memory on 8 GPUs at this micro batch (docs/memory.md): 24 GiB cards need --parallel=fsdp
# --activation_checkpointing=True, 40 GiB --parallel=fsdp, 80 GiB --parallel=fsdp or
# --activation_checkpointing=True.
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
