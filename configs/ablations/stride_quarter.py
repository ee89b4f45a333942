# Ablation, depth_stride=3: every 3rd layer (n_layer // 4; Figure 4: 2.2140).
# python train.py configs/ablations/base.py configs/ablations/stride_quarter.py
depth_stride = 3
out_dir = "out/ablations/stride_quarter"
