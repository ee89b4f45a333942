# Ablation, depth_mode=vanilla: no depth step: the baseline (Table 5: 2.2348).
# python train.py configs/ablations/base.py configs/ablations/mode_vanilla.py
depth_mode = "vanilla"
out_dir = "out/ablations/mode_vanilla"
