# The paper's recipe (section 3): the paper's 1.5B model (1.34B parameters) with Depth-Attention (value-only, stride 24): the 3B
# config's depth, recipe and data at a smaller width.  Data: python prepare_data.py pile --shards N
base_config = "paper_3b_value.py"
out_dir = "out/paper_1p5b_value"

n_head = 24
n_kv_head = 6
n_embd = 1536
mlp_hidden = 4096

micro_batch = 4  # per GPU (python train.py THIS_CONFIG --memory_plan=True prints the plan)
# Memory on 8 GPUs at this micro batch (docs/memory.md): 24 GiB cards need --parallel=fsdp
# --activation_checkpointing=True, 40 GiB --activation_checkpointing=True, 80 GiB nothing more (only just).
