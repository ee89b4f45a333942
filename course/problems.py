"""
The assignment's one list: each problem, its points, the functions a student writes (by name:
make.py blanks their bodies, nothing in model.py marks them), what to read in the paper, and its CPU
budget. make.py, grade.py, the tests and the handout (course/README.md) all read it from here.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    number: int
    title: str
    points: int
    functions: tuple = ()   # "file.py:qualified.name" of every body the student writes
    reading: str = ""       # what to read in the paper first
    budget: str = ""        # the CPU it takes on a 2-core machine, as measured (course/README.md)
    graded: bool = True     # False: written answers, graded by hand (course/answers.md)
    tests: tuple = ()       # (test, points) of every graded test: partial credit, test by test

    def __post_init__(self):
        assert not self.graded or sum(points for _, points in self.tests) == self.points, self


PROBLEMS = (
    Problem(1, "The source rule S(l)", 10,
            ("model.py:ModelConfig.stride", "model.py:ModelConfig.sources"),
            "section 2.3 (sparse sources) and the looped experiment (section 3.3)",
            "grading: 6 s", tests=(
                ("the_default_stride_is_the_modes_or_half_the_effective_depth", 3),
                ("an_explicit_stride_is_kept", 1), ("every_layer_has_the_sources_of_the_rule", 4),
                ("layer_zero_and_vanilla_have_no_sources", 1),
                ("the_paper_counts_117_candidates_at_48_layers", 1))),
    Problem(2, "The depth weights", 15,
            ("model.py:group_mean", "model.py:softmax_weights"),
            "sections 2.1 and 2.3 (the depth query of a KV group)",
            "grading: 6 s", tests=(
                ("qbar_is_the_mean_of_each_group_of_query_heads", 5),
                ("the_weights_are_a_softmax_over_the_candidates", 6),
                ("the_softmax_runs_in_float32_for_bf16_activations", 4))),
    Problem(3, "The mix, and what the cache stores", 25,
            ("model.py:weighted_sum", "model.py:depth_mix", "model.py:depth_mix_one",
             "model.py:Attention.forward", "model.py:Attention.store_and_attend",
             "model.py:GPT.run_layers"),
            "sections 2.2 (recursive value mixing) and 2.4 (the cache), Tables 5 and 6",
            "grading: 7 s", tests=(
                ("the_weighted_sum_of_the_candidates", 3),
                ("depth_mix_mixes_what_each_mode_says", 5),
                ("one_new_token_in_one_attention_call", 3),
                ("the_model_gives_the_reference_logits", 8), ("a_bf16_model_runs_in_bf16", 2),
                ("each_layer_stores_its_mixed_record_and_decoding_reads_it", 4))),
    Problem(4, "Cached decoding", 20,
            ("model.py:KVCache.update", "model.py:KVCache.advance", "model.py:causal_attention"),
            "section 2.4 and Table 4 (inference)",
            "grading: 5 s", tests=(
                ("causal_attention_over_a_whole_sequence", 8),
                ("a_prefill_then_chunks_and_single_tokens_equal_the_whole_sequence", 12))),
    Problem(5, "The experiment", 15, (),
            "Table 5 (uniform against value) and Figure 3 (the depth weights)",
            "training: 10 min (6 runs, 2 at a time); grading: 20 s", tests=(
                ("every_run_finished_with_the_handouts_settings", 3),
                ("results_json_says_what_the_logs_say", 3),
                ("each_checkpoint_gives_its_logged_loss", 3),
                ("the_losses_are_those_of_a_correct_model", 4),
                ("the_figure_of_the_depth_weights", 2))),
    Problem(6, "Written questions", 15, (),
            "Table 2 (cost), Table 6 (key-only), section 2.4",
            "reading and writing", graded=False),
)
GRADED = [p for p in PROBLEMS if p.graded]
# A student copy: its marker file, and the fixtures make.py records (relative to the copy's root)
MARKER, FIXTURES = "course/STUDENT", "course/fixtures/reference.pt"
# Problem 5's runs (lab/ablate.py's shared protocol) and the mean final validation losses of the two
# seeds this code gave (course/expected). The grader asks each mean of the losses it re-evaluates
# within `tolerance` of these, and value's paired gain over vanilla beyond half of `gain`: a value
# run that trains like vanilla lands `gain` from value's reference, so the tolerance is half that.
EXPERIMENT = {"out": "out/course", "runs": ("vanilla", "uniform", "value"), "seeds": 2,
              "base": "configs/ablations/cpu.py",
              "reference": {"vanilla": 1.7979, "uniform": 1.7497, "value": 1.7700},
              "gain": 0.0279, "tolerance": 0.014}
EXPERIMENT_COMMAND = (f"python lab/ablate.py --runs={','.join(EXPERIMENT['runs'])} "
                      f"--seeds={EXPERIMENT['seeds']} --out={EXPERIMENT['out']}")
