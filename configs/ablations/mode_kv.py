# Ablation, depth_mode=kv: mix keys and values with the same weights (Table 6, key-value: 2.2198).
# python train.py configs/ablations/base.py configs/ablations/mode_kv.py
depth_mode = "kv"
out_dir = "out/ablations/mode_kv"
