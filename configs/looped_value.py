# A looped Transformer with Depth-Attention (paper section 3.3, looped; paper: 500M x 3 loops, 2.208 -> 2.194):
# minipile_value.py with 4 shared blocks applied 3 times = 12 effective layers.
# Data: python prepare_data.py minipile
base_config = "minipile_value.py"
out_dir = "out/looped_value"

n_layer = 4  # distinct blocks, each applied n_loops times
n_loops = 3
depth_stride = None  # half the effective depth (12 // 2 = 6), counted over the 12 effective layers
