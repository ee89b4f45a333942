# Ablation, depth_mode=uniform: every candidate weighted 1/C instead of by the softmax (Table 5, Uniform Mix: 2.2153).
# python train.py configs/ablations/base.py configs/ablations/mode_uniform.py
depth_mode = "uniform"
out_dir = "out/ablations/mode_uniform"
