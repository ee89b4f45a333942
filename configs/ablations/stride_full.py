# Ablation, depth_stride=1: every earlier layer is a source (Figure 4: 2.2139).
# python train.py configs/ablations/base.py configs/ablations/stride_full.py
depth_stride = 1
out_dir = "out/ablations/stride_full"
