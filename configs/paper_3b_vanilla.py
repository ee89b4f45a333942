# The vanilla twin of paper_3b_value.py: the same model and run without the depth step.
base_config = "paper_3b_value.py"
depth_mode = "vanilla"
out_dir = "out/paper_3b_vanilla"
depth_stride = None  # a vanilla model has no depth step to stride
