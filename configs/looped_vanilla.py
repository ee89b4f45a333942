# The vanilla twin of looped_value.py: the same model and run without the depth step.
base_config = "looped_value.py"
depth_mode = "vanilla"
out_dir = "out/looped_vanilla"
