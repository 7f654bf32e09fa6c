"""The eval block and the objective: when a run evaluates, on which metrics, and the metric that
picks the best checkpoint and the best job of a sweep."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.config.fields import integer
from runner.config.interpolations import evaluates
from runner.config.method import PREFERENCE_METHODS
from runner.errors import UserError
from runner.rundir.metrics import (
    METRIC_MODES,
    PREFERENCE_METRICS,
    SFT_METRICS,
    TRAINING_METRIC_MODES,
)

# typing's Optional/List: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045

log = logging.getLogger(__name__)

EVAL_STRATEGIES = ("no", "steps", "epoch")


@dataclass
class Eval:
    """The eval block, as the user types it."""

    # steps, epoch or no (YAML 1.1 reads a bare `no` as false): checked by resolve_eval.
    strategy: Any = "steps"
    steps: Optional[int] = integer(None, 1)
    metrics: Any = field(default_factory=list)
    max_samples: Optional[int] = integer(None, 1)


@dataclass
class EvalRecipe(Eval):
    """The recipe's eval block: a strategy of EVAL_STRATEGIES ("no" where the dataset has no
    validation split) and a list of metrics."""

    strategy: str = "no"
    metrics: List[str] = field(default_factory=list)


@dataclass
class Objective:
    """The metric that picks the best checkpoint and job, and whether lower or higher wins."""

    metric: str = MISSING
    mode: str = "min"


def resolve_eval(cfg: DictConfig) -> EvalRecipe:
    """The eval block of the typed `train` config, checked; a dataset without a validation
    split is not evaluated."""
    evaluation = cfg.eval
    strategy = evaluation.strategy
    if strategy is False:  # YAML 1.1 reads a bare `no` as false
        strategy = "no"
    if strategy not in EVAL_STRATEGIES:
        raise UserError("eval.strategy", strategy, f"choose one of: {', '.join(EVAL_STRATEGIES)}")
    if strategy == "steps" and evaluation.steps is None:
        raise UserError(
            "eval.steps",
            evaluation.steps,
            "eval.strategy=steps needs an interval: give an integer >= 1",
        )
    metrics = _metrics(evaluation.metrics, cfg.method)
    if strategy != "no" and not metrics:
        raise UserError("eval.metrics", [], "name at least one metric, or set eval.strategy=no")
    if strategy != "no" and not evaluates(strategy, cfg.dataset.validation):
        log.warning(
            "eval.strategy=%s is ignored: dataset=%s has no validation split (set one of "
            "dataset.validation.held_out, .split, .source to evaluate)",
            strategy,
            cfg.dataset.name,
        )
        strategy = "no"
    return EvalRecipe(
        strategy=strategy,
        steps=evaluation.steps,
        metrics=metrics,
        max_samples=evaluation.max_samples,
    )


def _metrics(metrics: Any, method: DictConfig) -> list[str]:
    """eval.metrics: known metrics, each one the method computes. Named as method.eval_metrics
    where they are its list (eval.metrics' default)."""
    key = "eval.metrics"
    if OmegaConf.is_list(metrics) and list(metrics) == list(method.eval_metrics):
        key = "method.eval_metrics"
    if not OmegaConf.is_list(metrics):
        raise UserError(key, metrics, f"give a list of: {', '.join(METRIC_MODES)}")
    for name in metrics:
        if name not in METRIC_MODES:
            raise UserError(key, name, f"no such metric; choose from: {', '.join(METRIC_MODES)}")
    preference = method.name in PREFERENCE_METHODS
    for name in metrics:
        if name in (SFT_METRICS if preference else PREFERENCE_METRICS):
            other = "supervised methods" if preference else "preference methods (method=dpo)"
            own = ("eval_loss", *(PREFERENCE_METRICS if preference else SFT_METRICS))
            fix = f"is a metric of {other}; method={method.name} computes {', '.join(own)}"
            raise UserError(key, name, fix)
    return [str(name) for name in metrics]


def resolve_objective(
    objective: DictConfig, evaluation: EvalRecipe, eval_samples: int
) -> Objective:
    """The metric that picks the best checkpoint and the best job; it must be one a run records."""
    metric, mode = objective.metric, objective.mode
    modes = {**TRAINING_METRIC_MODES, **METRIC_MODES}
    if metric not in modes:
        raise UserError("objective.metric", metric, f"choose one of: {', '.join(modes)}")
    if mode != modes[metric]:
        better = "lower" if modes[metric] == "min" else "higher"
        raise UserError(
            "objective.mode",
            mode,
            f"{metric} is better {better}: use objective.mode={modes[metric]}",
        )
    if metric in METRIC_MODES:
        _check_recorded(metric, evaluation, eval_samples)
    return Objective(metric=metric, mode=mode)


def _check_recorded(metric: str, evaluation: EvalRecipe, eval_samples: int) -> None:
    """An eval metric as the objective: the run must evaluate, and compute it."""
    if evaluation.strategy == "no":
        raise UserError(
            "objective.metric",
            metric,
            "the run does not evaluate (eval.strategy=no, or no validation split): evaluate, "
            "or rank by the training loss with objective.metric=loss",
        )
    if metric not in evaluation.metrics:
        raise UserError(
            "objective.metric",
            metric,
            f"not computed: add it to eval.metrics={evaluation.metrics}",
        )
    if metric == "eval_exact_match" and eval_samples == 0:
        raise UserError(
            "objective.metric",
            metric,
            "dataset.eval_samples=0 generates no answers: give it a count",
        )
