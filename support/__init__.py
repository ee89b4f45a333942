"""
What the scripts at the repository's root import and nobody runs: configuration and command-line
helpers, tokenizers and datasets, train.py's batches, checkpoints, Hugging Face folders (and
hf_remote/, the code an export carries), DDP/FSDP, signals, a run's log, the memory plan, train.py's
keys, the ablation sweep's records and report, the paper's numbers, the depth weights as numbers and
their viewer.

It stands on model.py and baselines.py (imported from the root, where every script runs) and never on
a script; within it, each module imports only those below it (tests/test_layout.py):

    errors cli config run_config paper depth_weights tokenizer data batches hf checkpoint parallel signals runlog memory sweep depth_weights_view report
"""
