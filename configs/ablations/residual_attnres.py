# Main comparison (Table 1), Block AttnRes: every sublayer reads a softmax over depth of stream snapshots taken
# every 12 sublayers, with vanilla attention (paper Table 1, 3B zero-shot avg 55.01).
# python train.py configs/ablations/base.py configs/ablations/residual_attnres.py
depth_mode = "vanilla"
residual = "attnres"
out_dir = "out/ablations/residual_attnres"
