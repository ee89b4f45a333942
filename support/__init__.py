"""
What the scripts at the repository's root import and nobody runs: configuration and command-line
helpers, tokenizers and datasets, train.py's table of keys, checkpoints, Hugging Face folders (and
hf_remote/, the code an export carries), DDP/FSDP, signals, a run's log, the memory plan, the ablation
sweep's records, the paper's numbers, the depth weights as numbers.

It stands on model.py and baselines.py (imported from the root, where every script runs) and never on
a script; within it, each module imports only those below it (tests/test_layout.py):

    errors cli config paper depth_weights tokenizer data hf checkpoint parallel run_config signals runlog memory sweep
"""
