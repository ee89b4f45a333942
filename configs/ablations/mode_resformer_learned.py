# Value residual learning with learned weights (ResFormer, arXiv 2410.17897): lambda_1 V_l + lambda_2 V_0,
# two numbers per block, 1/2 each at init (baselines.py).
# python train.py configs/ablations/base.py configs/ablations/mode_resformer_learned.py
depth_mode = "resformer_learned"
out_dir = "out/ablations/mode_resformer_learned"
