"""
What the scripts at the repository's root import and nobody runs; each module's docstring says what
it is for. It stands on model.py and baselines.py and never on a script; within it, each module
imports only those before it in this order, not even inside a function (tests/test_layering.py):

    interrupt variants errors cli argparser atomic folders outputs config paper cost depth_weights
    hub tokenizer data prepare hf checksums run_dir sharded checkpoint continued parallel run_config
    signals runlog memory speed eval_tasks sweep depth_weights_view report recall
"""
