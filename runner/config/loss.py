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
    built_once(resolved, "loss")
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


def built_once(node: dict[str, Any], key: str) -> None:
    """Builds a component node once (a builder on the meta device), so that a refused argument
    (`loss.ignore_index=abc`, `model.builder.num_layers=abc`) fails here, not in training."""
    import torch

    arguments = {k: v for k, v in node.items() if k != "_component_"}
    # None when the node names none: resolve_component refuses it by name.
    path: Any = node.get("_component_")
    component = resolve_component(path, f"{key}._component_")
    try:
        with torch.device("meta"):
            component(**arguments)
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(
            key,
            arguments,
            f"{node['_component_']} refuses them ({err}); give arguments it takes (see its "
            "documentation)",
        ) from None
