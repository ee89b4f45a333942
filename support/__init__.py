"""
What the scripts at the repository's root import and nobody runs: the error types, configuration
and command-line helpers, train.py's table of keys, tokenizers and datasets, checkpoints, Hugging
Face folders (and hf_remote/, the code an export carries), DDP/FSDP, signals, a run's log, the
memory plan, a run's speed (MFU, ETA), eval.py's lm-eval tasks, the ablation sweep's records and
report, the paper's numbers and cost formulas, the depth weights as numbers and their viewer; and
recall, the one module run as itself (`python -m support.recall`): a synthetic associative-recall
check of Keyless Attention.

It stands on model.py and baselines.py (imported from the root, where every script runs) and never
on a script; within it, each module imports only those below it (tests/test_layout.py), in this
order:

    errors cli config paper cost depth_weights tokenizer data hf checkpoint parallel run_config
    signals runlog memory speed eval_tasks sweep depth_weights_view report recall
"""
