# Ablation, depth_mode=key: mix the keys, keep the raw values (Table 6, key-only: 2.2354).
# python train.py configs/ablations/base.py configs/ablations/mode_key.py
depth_mode = "key"
out_dir = "out/ablations/mode_key"
