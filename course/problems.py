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


PROBLEMS = (
    Problem(1, "The source rule S(l)", 10,
            ("model.py:ModelConfig.stride", "model.py:ModelConfig.sources"),
            "section 2.3 (sparse sources) and the looped experiment (section 3.3)",
            "grading: 5 s"),
    Problem(2, "The depth weights", 15,
            ("model.py:group_mean", "model.py:softmax_weights"),
            "sections 2.1 and 2.3 (the depth query of a KV group)",
            "grading: 5 s"),
    Problem(3, "The mix, and what the cache stores", 25,
            ("model.py:weighted_sum", "model.py:depth_mix", "model.py:depth_mix_one",
             "model.py:Attention.forward", "model.py:Attention.store_and_attend",
             "model.py:GPT.run_layers"),
            "sections 2.2 (recursive value mixing) and 2.4 (the cache), Tables 5 and 6",
            "grading: 6 s"),
    Problem(4, "Cached decoding", 20,
            ("model.py:KVCache.update", "model.py:KVCache.advance", "model.py:causal_attention"),
            "section 2.4 and Table 4 (inference)",
            "grading: 5 s"),
    Problem(5, "The experiment", 15, (),
            "Table 5 (uniform against value) and Figure 3 (the depth weights)",
            "training: 10 min (6 runs, 2 at a time); grading: 9 s"),
    Problem(6, "Written questions", 15, (),
            "Table 2 (cost), Table 6 (key-only), section 2.4",
            "reading and writing", graded=False),
)
GRADED = [p for p in PROBLEMS if p.graded]
# A student copy: its marker file, and the fixtures make.py records (relative to the copy's root)
MARKER, FIXTURES = "course/STUDENT", "course/fixtures/reference.pt"
# Problem 5's runs, as the handout's command writes them (ablate.py's shared protocol on its CPU
# base), and the mean final validation losses of the two seeds that this repository's code gives,
# measured with that command; a correct solution lands within the tolerance on any machine.
EXPERIMENT = {"out": "out/course", "runs": ("vanilla", "uniform", "value"), "seeds": 2,
              "base": "configs/ablations/cpu.py",
              "reference": {"vanilla": 1.8013, "uniform": 1.7488, "value": 1.7716},
              "tolerance": 0.03}
EXPERIMENT_COMMAND = (f"python ablate.py --runs={','.join(EXPERIMENT['runs'])} "
                      f"--seeds={EXPERIMENT['seeds']} --out={EXPERIMENT['out']}")


def problem_of(function: str) -> Problem:
    return next(p for p in PROBLEMS if function in p.functions)
