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
    # Preference methods: the implicit rewards beta * (log p_policy - log p_reference) of the
    # held-out chosen and rejected answers; accuracy: the share of pairs whose chosen answer
    # gets the higher reward; margin: chosen's reward minus rejected's, on average.
    "eval_rewards_accuracy": "max",
    "eval_rewards_margin": "max",
    "eval_rewards_chosen": "max",
    "eval_rewards_rejected": "min",
}
# The eval metrics of supervised methods only, and of preference methods only (eval_loss is
# both: the token-mean cross-entropy, or the DPO loss).
SFT_METRICS = ("eval_perplexity", "eval_token_accuracy", "eval_exact_match")
PREFERENCE_METRICS = (
    "eval_rewards_accuracy",
    "eval_rewards_margin",
    "eval_rewards_chosen",
    "eval_rewards_rejected",
)
# What an objective may name besides the eval metrics: the training loss.
TRAINING_METRIC_MODES = {"loss": "min"}


def known_mode(metric: str) -> str | None:
    """`min` or `max` for a metric that runs record (the training loss or an eval metric)."""
    return {**TRAINING_METRIC_MODES, **METRIC_MODES}.get(metric)
