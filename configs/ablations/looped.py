# Ablation, looped: 4 shared blocks applied 3 times = 12 effective layers, as deep as the base
# (paper: 500M x 3 loops, val loss 2.208 -> 2.194). Combine with mode_vanilla.py or mode_value.py:
# python train.py configs/ablations/base.py configs/ablations/looped.py configs/ablations/mode_value.py
n_layer = 4
n_loops = 3
depth_stride = None  # half the effective depth: 6
out_dir = "out/ablations/looped"
