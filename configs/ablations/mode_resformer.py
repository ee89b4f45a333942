# Value residual learning (ResFormer, arXiv 2410.17897): every layer mixes its value with layer 0's,
# 1/2 and 1/2 (Uniform Mix over the sources {0, l}; baselines.py).
# python train.py configs/ablations/base.py configs/ablations/mode_resformer.py
depth_mode = "resformer"
out_dir = "out/ablations/mode_resformer"
