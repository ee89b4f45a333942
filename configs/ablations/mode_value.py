# Ablation, depth_mode=value: mix the values only: Depth-Attention as proposed (Tables 5-6: 2.2115).
# python train.py configs/ablations/base.py configs/ablations/mode_value.py
depth_mode = "value"
out_dir = "out/ablations/mode_value"
