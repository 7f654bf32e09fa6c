"""The loss group, and the check every component node of the recipe passes: it builds."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from runner.components import plain_dict, resolve_component
from runner.errors import UserError


def resolve_loss(loss: DictConfig) -> dict[str, Any]:
    """The loss component and its arguments, built once, and the two arguments a build takes
    but training does not: a chunk count under one, a label to ignore other than the data's."""
    from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX

    resolved = plain_dict(loss, resolve=True)
    built_once(resolved, "loss", reference={})
    # Training scales each micro-batch's mean by its trained tokens, over the step's: a sum was
    # scaled again (an update 100x too large, unlike from one layout to the next). size_average
    # and reduce are CrossEntropyLoss's older spellings of reduction.
    for key, mean in (("reduction", "mean"), ("size_average", True), ("reduce", True)):
        if resolved.get(key, mean) not in (mean, None):
            raise UserError(
                f"loss.{key}",
                resolved[key],
                "training weighs each trained token of a step alike, across micro-batches and "
                f"processes, from the loss's mean; leave {key} out",
            )
    chunks = resolved.get("num_output_chunks", 1)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise UserError(
            "loss.num_output_chunks", chunks, "give an integer >= 1 (the logits in that many parts)"
        )
    if resolved.get("ignore_index", CROSS_ENTROPY_IGNORE_IDX) != CROSS_ENTROPY_IGNORE_IDX:
        raise UserError(
            "loss.ignore_index",
            resolved["ignore_index"],
            f"the data marks the labels not trained on with {CROSS_ENTROPY_IGNORE_IDX}, which "
            "the loss must ignore; leave it out or give that",
        )
    _computed_once(resolved)
    return resolved


def _computed_once(loss: dict[str, Any]) -> None:
    """The loss computed once on a few positions, as training calls it (a list of chunks for a
    chunked loss): an argument its class checks only then (CrossEntropyLoss's label_smoothing
    above 1) failed the first step with a traceback and left a failed run."""
    import torch

    from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX

    arguments = {k: v for k, v in loss.items() if k != "_component_"}
    loss_fn = resolve_component(loss["_component_"], "loss._component_")(**arguments)
    logits = torch.zeros(1, 16, 4)
    labels = torch.tensor([[0, 1, 2, CROSS_ENTROPY_IGNORE_IDX] * 4])
    try:
        if "num_output_chunks" in loss:
            value = loss_fn(list(logits.chunk(loss["num_output_chunks"], dim=1)), labels)
        else:
            value = loss_fn(logits.reshape(-1, 4), labels.reshape(-1))
        if value.dim() != 0:  # reduction=none: no number to step on (backward fails)
            raise ValueError(f"it gives a tensor of shape {list(value.shape)}, not one number")
    except (RuntimeError, TypeError, ValueError) as err:
        named = [name for name in arguments if name in str(err)]
        key, value = (f"loss.{named[0]}", arguments[named[0]]) if named else ("loss", arguments)
        raise UserError(
            key,
            value,
            f"{loss['_component_']} fails on a first batch with it ({err}); give a value it takes "
            "(see its documentation)",
        ) from None


def built_once(node: dict[str, Any], key: str, reference: dict[str, Any] | None = None) -> None:
    """Builds a component node once (a builder on the meta device), so that a refused argument
    (`loss.ignore_index=abc`, `model.builder.num_heads=7`) fails here, not in training.

    `reference`: arguments known to build (the model option's own builder arguments; {} for a
    component whose every argument has a default), against which the one argument refused on
    its own is named; without one, or where no argument alone is at fault, all of them are.
    """
    arguments = {k: v for k, v in node.items() if k != "_component_"}
    # None when the node names none: resolve_component refuses it by name.
    path: Any = node.get("_component_")
    component = resolve_component(path, f"{key}._component_")
    try:
        _build(component, arguments)
    except (TypeError, ValueError, AssertionError) as err:
        culprit = _culprit(component, arguments, reference)
        name, value = (f"{key}.{culprit}", arguments[culprit]) if culprit else (key, arguments)
        what = "it" if culprit else "them"
        raise UserError(
            name,
            value,
            f"{node['_component_']} refuses {what} ({err}); give arguments it takes (see its "
            "documentation)",
        ) from None


def _build(component: Any, arguments: dict[str, Any]) -> None:
    import torch

    with torch.device("meta"):
        component(**arguments)


def _culprit(
    component: Any, arguments: dict[str, Any], reference: dict[str, Any] | None
) -> str | None:
    """The one argument that, put alone into `reference` (which builds), is refused; None
    where there is no reference or no argument fails on its own."""
    if reference is None:
        return None
    try:
        _build(component, reference)
    except (TypeError, ValueError, AssertionError):
        return None  # another builder than the reference's: nothing to hold one argument to
    for name, value in arguments.items():
        if name in reference and reference[name] == value:
            continue
        try:
            _build(component, {**reference, name: value})
        except (TypeError, ValueError, AssertionError):
            return name
    return None
