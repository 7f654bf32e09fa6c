"""Which way each metric a run records is better.

Light on purpose (no torch): readers of run directories rank runs and checkpoints with it.
"""

from __future__ import annotations

# Every metric an evaluation can record, and which way is better.
METRIC_MODES = {
    "eval_loss": "min",
    "eval_perplexity": "min",
    "eval_token_accuracy": "max",
    "eval_exact_match": "max",
}
# What an objective may name besides the eval metrics: the training loss.
TRAINING_METRIC_MODES = {"loss": "min"}


def known_mode(metric: str) -> str | None:
    """`min` or `max` for a metric that runs record (the training loss or an eval metric)."""
    return {**TRAINING_METRIC_MODES, **METRIC_MODES}.get(metric)
