# Main comparison (Table 1), DenseFormer: a learned depth-weighted average of the embedding and every earlier
# block output after each block, with vanilla attention (paper Table 1, 3B zero-shot avg 54.70).
# python train.py configs/ablations/base.py configs/ablations/residual_denseformer.py
depth_mode = "vanilla"
residual = "denseformer"
out_dir = "out/ablations/residual_denseformer"
