"""Moved: the associative-recall check of Keyless Attention is experiments/recall.py."""
import sys

sys.exit("support.recall moved: run `python -m experiments.recall` (same flags)")
