# The vanilla twin of minipile_value.py: the same model and run without the depth step.
base_config = "minipile_value.py"
depth_mode = "vanilla"
out_dir = "out/minipile_vanilla"
