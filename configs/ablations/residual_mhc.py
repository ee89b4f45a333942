# Main comparison (Table 1), mHC: 4 residual streams mixed by Sinkhorn-normalised maps, with vanilla attention
# (paper Table 1, 3B zero-shot avg 54.68).
# python train.py configs/ablations/base.py configs/ablations/residual_mhc.py
depth_mode = "vanilla"
residual = "mhc"
out_dir = "out/ablations/residual_mhc"
