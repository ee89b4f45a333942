# Prior work, depth_mode=lime: LIMe's learned static router over the K and V heads of every earlier layer
# (depth_stride None = every earlier layer for lime), beside Depth-Attention's query-dependent softmax.
# python train.py configs/ablations/base.py configs/ablations/mode_lime.py
depth_mode = "lime"
depth_stride = None
out_dir = "out/ablations/mode_lime"
