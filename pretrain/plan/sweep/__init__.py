"""The batch-size sweep (``pretrain-sweep``): run each MBS (runner), read what it means (analysis), draw it
(plot). The command line lives in ``pretrain/cli/sweep.py``."""

from pretrain.plan.sweep.analysis import NEAR_BEST, SCALING_THRESHOLD, analyse, format_table, nearest_multiples
from pretrain.plan.sweep.plot import plot
from pretrain.plan.sweep.runner import MBSResult, add_run, measure, repeat_rounds

__all__ = ["NEAR_BEST", "SCALING_THRESHOLD", "MBSResult", "add_run", "analyse", "format_table", "measure",
           "nearest_multiples", "plot", "repeat_rounds"]
