"""
STAND-IN for the lead's support/run_config.py (issue 35, item 1): the one table of train.py's keys,
copied here as data from train.py's DEFAULTS, KEY_RANGES, CHOICES, PER_INVOCATION and --help at
commit 84d273a, so that the sweep (support/sweep.py) can read it before the real module lands. It
exposes only the names the lead guarantees (Key, TRAIN_KEYS, DEFAULTS); the real module replaces
this file wholesale at merge.

    TRAIN_KEYS  {name: Key}: every key train.py takes, in --help's order
    DEFAULTS    {name: default}
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    """One train.py key: its default and help; check: a range rule of support.config.RULES or None;
    choices: the values it takes or None; result: whether it changes a number the run reports (the
    sweep reuses a run recorded with other values of the keys that do not); per_invocation: where
    and how one command runs, never taken from a checkpoint."""
    default: object
    help: str = ""
    check: str | None = None
    choices: tuple | None = None
    result: bool = True
    per_invocation: bool = False


TRAIN_KEYS = {
    'vocab_size': Key(None, "None = the tokenizer's vocabulary (meta.json); larger values pad it"),
    'block_size': Key(256, 'context length in tokens (paper: 2048)'),
    'n_layer': Key(6, 'distinct blocks (paper 3B: 48)'),
    'n_head': Key(4, 'query heads (paper 3B: 32)'),
    'n_kv_head': Key(2, 'key/value heads: n_head = MHA, 1 = MQA, else GQA (3B: 8)'),
    'head_dim': Key(32, 'per-head width (paper: 64)'),
    'n_embd': Key(128, 'hidden size (paper 3B: 2048)'),
    'mlp_hidden': Key(384, 'SwiGLU inner width (paper 3B: 6912)'),
    'rope_theta': Key(10000.0, 'RoPE base (paper: 1e4)'),
    'qk_norm': Key(True, 'per-head RMSNorm on q and k before RoPE, as in Qwen3'),
    'k_norm_after_rope': Key(False, "k_norm after RoPE: the authors' released model"),
    'tie_embeddings': Key(False, 'share token embedding and lm_head (paper: untied)'),
    'norm_eps': Key(1e-06, 'RMSNorm epsilon (Qwen3 default)'),
    'init_std': Key(0.02, "std of every Linear's and the embedding's init (3B: 0.01)"),
    'depth_mode': Key('value', 'a row of model.DEPTH_MODES (value = Depth-Attention)',
                               choices=('vanilla', 'value', 'uniform', 'key', 'kv', 'lime')),
    'depth_stride': Key(None, "a source every `stride`-th layer; None = the mode's default (half "
                              'the effective depth; lime: 1)'),
    'depth_recent_window': Key(0, 'also the r most recent earlier layers as sources (paper: 0)'),
    'n_loops': Key(1, 'run the n_layer blocks this many times (looped Transformer)'),
    'residual': Key('add', 'residual path: add (the plain stream) or a baseline, with '
                           'depth_mode=vanilla',
                           choices=('add', 'denseformer', 'attnres', 'mhc')),
    'denseformer_dwa_dilation': Key(1, 'DenseFormer: every k-th earlier output (authors: 1)'),
    'denseformer_dwa_period': Key(1, 'DenseFormer: after every p-th block (authors: 1)'),
    'attnres_block_size': Key(12, 'AttnRes: sublayers per block, 2 a layer (authors: 12)'),
    'attnres_recency_bias_init': Key(3.0, "AttnRes: the stream's initial logit bonus (authors: 3)"),
    'mhc_num_streams': Key(4, 'mHC: parallel residual streams n (authors: 4)'),
    'mhc_alpha_init': Key(0.01, 'mHC: initial gain of the dynamic maps (authors: 0.01)'),
    'mhc_sinkhorn_iters': Key(20, 'mHC: Sinkhorn row/column rounds (authors: 20)'),
    'dataset': Key('shakespeare', '<data_root>/<dataset>/: {train,val}.bin, meta.json '
                                  '(prepare_data)'),
    'data_root': Key('data', 'the folder that holds the prepared datasets'),
    'out_dir': Key('out/shakespeare', 'ckpt.pt, config.json, log.jsonl',
                                      result=False, per_invocation=True),
    'seed': Key(1337, 'model init and the batch sequence', check='>= 0'),
    'batch_tokens': Key(4096, 'tokens per optimizer step, all ranks together (paper: 1024 x 2048)',
                              check='>= 1'),
    'micro_batch': Key(None, "sequences per forward pass on one rank; None = the rank's share",
                             check='>= 1', result=False),
    'max_iters': Key(400, 'optimizer steps; the LR schedule spans exactly these', check='>= 1'),
    'learning_rate': Key(0.003, 'peak LR (paper: 1e-3 at 1.5B/3B, 3e-4 at 410M)', check='> 0'),
    'weight_decay': Key(0.1, 'on matrices only; norms and other 1-D parameters get none',
                             check='>= 0'),
    'beta1': Key(0.9, 'AdamW first-moment decay, in [0, 1)', check='in [0, 1)'),
    'beta2': Key(0.95, 'AdamW second-moment decay, in [0, 1)', check='in [0, 1)'),
    'adam_eps': Key(1e-08, 'AdamW epsilon', check='> 0'),
    'grad_clip': Key(1.0, 'max global grad norm; 0 = no clipping', check='>= 0'),
    'lime_router_lr_mult': Key(10.0, "depth_mode=lime: the routers' LR / the scheduled LR, no "
                                     'decay (LIMe: 1e-2 at 1e-3)',
                                     check='> 0'),
    'warmup_frac': Key(0.02, 'linear warmup over this fraction of max_iters', check='in [0, 1]'),
    'min_lr_ratio': Key(0.1, 'cosine floor as a fraction of the peak LR', check='in [0, 1]'),
    'eval_interval': Key(100, 'steps between evaluations (also at step 0 and at the end)',
                              check='>= 0'),
    'eval_seqs': Key(64, 'fixed validation windows, evenly spaced over val.bin', check='>= 1'),
    'log_interval': Key(25, 'steps between printed train lines (log.jsonl gets every step)',
                            check='>= 1', result=False),
    'ckpt_interval': Key(None, 'steps between checkpoints; None = at every evaluation; 0 = at the'
                               ' end only',
                               check='>= 0', result=False),
    'stop_at_step': Key(0, "end early after this step with a checkpoint, keeping max_iters' "
                           'schedule; 0 = off',
                           check='>= 0', result=False),
    'resume': Key(False, 'continue from out_dir/ckpt.pt', result=False, per_invocation=True),
    'init_from': Key('', 'start from these weights, fresh optimizer: an out_dir, a ckpt.pt, a HF '
                         'folder or a hub id'),
    'overwrite': Key(False, 'start over in an out_dir that holds a checkpoint, deleting it',
                            result=False, per_invocation=True),
    'sample_tokens': Key(200, 'tokens of text sampled at the end of the run; 0 = none',
                              check='>= 0', result=False),
    'sample_prompt': Key('', '"" = start from the end-of-text token, like a new document',
                             result=False),
    'device': Key('auto', 'auto = cuda, then mps, then cpu'),
    'dtype': Key('auto', 'auto = bfloat16 autocast on CUDA where supported, else float32'),
    'compile': Key(False, 'torch.compile the training forward (slow to start on CPU)',
                          result=False),
    'parallel': Key('ddp', 'under torchrun: ddp (each GPU the whole model) | fsdp (sharded: '
                           'support/parallel.py)',
                           result=False),
    'activation_checkpointing': Key(False, 'recompute each block in the backward pass: less '
                                           'memory, ~1/3 more compute',
                                           result=False),
    'memory_plan': Key(False, 'print the per-GPU memory of ddp / fsdp, with and without '
                              'checkpointing, and exit',
                              result=False, per_invocation=True),
    'wandb_log': Key(False, 'log to Weights & Biases (pip install wandb)', result=False),
    'wandb_project': Key('depth-attention', 'the wandb project', result=False),
    'wandb_run_name': Key('', '"" = the out_dir\'s name', result=False),
}
DEFAULTS = {name: key.default for name, key in TRAIN_KEYS.items()}
