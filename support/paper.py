"""
The paper's published numbers, in one place: eval.py, ablate.py and bench_cache.py print them
beside ours. Quoted, never computed; the shapes they belong to are the configs in configs/
(paper_3b_value.py, ...).
"""

# Table 1, Qwen3-style models trained on 32B Pile tokens: the average accuracy (%) over the eight
# downstream tasks by number of shots, and the Pile validation perplexity (given for vanilla and
# Depth-Attention only).
TABLE1_AVG = {0: {"1.5B vanilla": 51.26, "1.5B Depth-Attention": 53.60, "3B vanilla": 53.76,
                  "3B mHC": 54.68, "3B AttnRes": 55.01, "3B DenseFormer": 54.70,
                  "3B Depth-Attention": 55.69},
              5: {"1.5B vanilla": 51.65, "1.5B Depth-Attention": 53.72, "3B vanilla": 54.16,
                  "3B mHC": 55.65, "3B AttnRes": 55.92, "3B DenseFormer": 55.59,
                  "3B Depth-Attention": 56.17}}
TABLE1_PPL = {"1.5B vanilla": 8.17, "1.5B Depth-Attention": 7.77, "3B vanilla": 7.55,
              "3B Depth-Attention": 7.25}
# Table 1's 3B rows under ablate.py's run names.
TABLE1_3B_RUNS = {"vanilla": "3B vanilla", "value": "3B Depth-Attention",
                  "denseformer": "3B DenseFormer", "attnres": "3B AttnRes", "mhc": "3B mHC"}

# Tables 5-6 and Figure 4 (with the looped rows), 500M models: validation loss, under ablate.py's
# run names.
ABLATION_LOSS = {"vanilla": 2.2348, "uniform": 2.2153, "value": 2.2115, "key": 2.2354, "kv": 2.2198,
                 "stride_first": 2.2127, "stride_quarter": 2.2140, "stride_full": 2.2139,
                 "looped_vanilla": 2.208, "looped_value": 2.194}

# Table 2, the 3B model (fp16): extra cost per token over vanilla. Depth-Attention's row is also
# derived by support.cost.depth_cost; the hidden-state baselines' FLOPs and I/O are quoted (their
# derivations are not given).
TABLE2_DEPTH_ATTENTION = {"flops_per_token": 2.40e5, "io_kib_per_token": 282,
                          "extra_prefill_gib_128k": 0.0}
TABLE2_BASELINES = {"DenseFormer": {"flops_per_token": 5.01e6, "io_mib_per_token": 4.97},
                    "AttnRes": {"flops_per_token": 4.26e6, "io_mib_per_token": 4.44},
                    "mHC": {"flops_per_token": 4.72e7, "io_mib_per_token": 8.63}}
# Table 2 quotes the extra prefill memory at a 128K-token context
TABLE2_PREFILL_TOKENS = 128 * 1024
