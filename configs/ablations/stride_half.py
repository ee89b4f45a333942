# Ablation, depth_stride=6: every 6th layer, the paper's default n_layer // 2 (Figure 4: 2.2115);
# the same run as mode_value.py.  python train.py configs/ablations/base.py configs/ablations/stride_half.py
depth_stride = 6
out_dir = "out/ablations/stride_half"
