# The vanilla twin of paper_1p5b_value.py: the same model and run without the depth step.
base_config = "paper_1p5b_value.py"
depth_mode = "vanilla"
out_dir = "out/paper_1p5b_vanilla"
depth_stride = None  # a vanilla model has no depth step to stride
