"""
What the scripts at the repository's root import and nobody runs: which model a config names
(variants), the error types, configuration and command-line helpers, train.py's table of keys,
tokenizers, prepared datasets and their preparation, reading a trained model (checkpoint), a run's
folder and an FSDP run's sharded checkpoint, Hugging Face folders (and hf_remote/, the code an
export carries), DDP/FSDP, signals, a run's log, the memory plan, a run's speed (MFU, ETA),
eval.py's lm-eval tasks, the ablation sweep's records and report, the paper's numbers and cost
formulas, the depth weights as numbers and their viewer.

It stands on model.py and baselines.py (imported from the root, where every script runs) and never
on a script; within it, each module imports only those below it (tests/test_layering.py), in this
order:

    variants errors cli config paper cost depth_weights tokenizer data prepare hf checkpoint
    run_dir sharded parallel run_config signals runlog memory speed eval_tasks sweep
    depth_weights_view report
"""
