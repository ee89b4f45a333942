# Ablation, depth_stride=12: layer 0 is the only source (stride >= n_layer = 12; Figure 4: 2.2127).
# python train.py configs/ablations/base.py configs/ablations/stride_first.py
depth_stride = 12
out_dir = "out/ablations/stride_first"
