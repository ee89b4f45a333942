# The paper's recipe (section 3): the paper's 410M-class companion (464M parameters) with Depth-Attention (value-only, stride 16):
# the 3B config's recipe and data with 32 layers, width 1024 and lr 3e-4.  Data: python prepare_data.py pile --shards N
base_config = "paper_3b_value.py"
out_dir = "out/paper_410m_value"

n_layer = 32
n_head = 16
n_kv_head = 4
n_embd = 1024
mlp_hidden = 2816
init_std = 0.02  # the paper gives 0.01 for the 1.5B/3B models only
depth_stride = 16

micro_batch = 8  # per GPU (python train.py THIS_CONFIG --memory_plan=True prints the plan)
# Memory on 8 GPUs at this micro batch (docs/memory.md): 24 GiB cards need --parallel=fsdp
# --activation_checkpointing=True, 40 GiB --activation_checkpointing=True, 80 GiB nothing more.
# max_iters stays the larger models' 32B tokens: the paper gives no 410M budget
learning_rate = 3e-4
