# Keyless Attention (arXiv 2606.21848): no key projection, queries routed against the values, a
# V-only cache; with the base's depth_mode=value, Depth-Attention inside it (keyless_value).
# python train.py configs/ablations/base.py configs/ablations/attention_keyless.py
attention = "keyless"
out_dir = "out/ablations/attention_keyless"
