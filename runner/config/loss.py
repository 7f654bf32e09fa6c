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
    chunks = resolved.get("num_output_chunks", 1)
    if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks < 1:
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
    return resolved


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
