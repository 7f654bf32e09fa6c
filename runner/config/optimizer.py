"""The optimizer section: the component an option names, its arguments checked before training.

An option (conf/optimizer/*.yaml) names a torch.optim class in `_component_`; its other keys are
that class's keyword arguments, but for the learning-rate schedule's keys (SCHEDULE_KEYS), which
every optimizer shares. Adding an optimizer is adding a YAML file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.components import resolve_component
from runner.config.fields import flag, integer, number, typed_as
from runner.errors import UserError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

# Keys of an optimizer option that set the schedule: linear warmup over warmup_steps, then a
# cosine decay to zero over the run's steps (cosine_decay) or a constant rate.
SCHEDULE_KEYS = ("warmup_steps", "cosine_decay")
# Weights in the probe parameter: one step on it creates every optimizer's per-weight state.
_PROBE_WEIGHTS = 3
# The optimizers whose fused step PyTorch runs on sharded weights (DTensor's rules for
# _fused_adam_ and _fused_adamw_); SGD's fused step on them failed the first step with
# "Operator aten._fused_sgd_.default does not have a sharding strategy registered".
_FUSED_SHARDED = frozenset({"torch.optim.Adam", "torch.optim.AdamW"})


@dataclass
class OptimizerKeys:
    """The keys every optimizer option sets (its others are its component's arguments)."""

    lr: float = number(MISSING, positive=True)
    warmup_steps: int = integer(0, 0)
    cosine_decay: bool = flag(True)


def resolve_optimizer(optimizer: DictConfig, processes: int) -> dict[str, Any]:
    """The chosen option: its component, the component's arguments and the schedule keys;
    `processes` train together (FSDP2 shards the weights over them where there are several)."""
    resolved = checked_option(optimizer, processes)
    if "fused" in resolved and resolved["fused"] is None:
        # PyTorch's fused kernel, on CPU as on CUDA: one pass over each weight instead of a
        # dozen elementwise ops (AdamW's step is 3x faster on CPU; scripts/bench/bench_peers.py).
        resolved["fused"] = _fused_runs(resolved["_component_"], processes)
    # Builds it once: a refused argument fails here, not in training.
    state_per_weight(split_option(resolved)[0])
    return resolved


def _fused_runs(component: str, processes: int) -> bool:
    """Whether the optimizer's fused step runs on its weights: FSDP2 shards them over several
    processes, and PyTorch has the rule for a sharded fused step of Adam and AdamW only."""
    return processes == 1 or component in _FUSED_SHARDED


def checked_option(optimizer: DictConfig, processes: int) -> dict[str, Any]:
    """The option's keys that runner itself reads (lr, the schedule, fused), each checked for
    `processes` training together, without torch: what `runner cluster` checks of the job it
    prints."""
    option = OmegaConf.to_container(optimizer, resolve=True)
    assert isinstance(option, dict)  # the optimizer group is a mapping
    if "_component_" not in option:
        raise UserError(
            "optimizer._component_", None, "name the torch.optim class, e.g. torch.optim.AdamW"
        )
    shared = ("lr", *SCHEDULE_KEYS)
    missing = [key for key in shared if key not in option]
    if missing:
        key = f"optimizer.{missing[0]}"
        raise UserError(key, None, f"every optimizer option sets it: give it a value, {key}=VALUE")
    keys = OmegaConf.create({k: option[k] for k in shared})
    resolved = {str(k): v for k, v in option.items()}
    checked = typed_as(keys, OptimizerKeys, "optimizer.")
    resolved.update({key: checked[key] for key in shared})
    if "fused" in resolved and not isinstance(resolved["fused"], bool | None):
        # The fused kernel was taken on any value (fused=maybe, fused=2), and recorded so.
        raise UserError(
            "optimizer.fused",
            resolved["fused"],
            "give true, false or null (null: PyTorch's fused kernel, where it has one)",
        )
    if resolved.get("fused") and not _fused_runs(resolved["_component_"], processes):
        raise UserError(
            "optimizer.fused",
            True,
            f"{resolved['_component_']}'s fused kernel does not run on weights sharded over "
            f"{processes} processes (FSDP2 shards them; PyTorch has the rule for Adam and AdamW "
            "only); give optimizer.fused=null, which fuses where it can, or false",
        )
    _check_decay_and_momentum(resolved)
    return resolved


def _check_decay_and_momentum(option: dict[str, Any]) -> None:
    """torch takes any weight_decay and momentum of 0 or more; a step of lr x weight_decay of 1
    zeroes the weights (past it flips them), a momentum of 1 never lets a gradient go. Either
    ran to a loss of nan, blamed on the learning rate it never came from."""
    decay, momentum = option.get("weight_decay"), option.get("momentum")
    lr = option["lr"]
    if isinstance(decay, int | float) and not isinstance(decay, bool) and decay * lr >= 1:
        raise UserError(
            "optimizer.weight_decay",
            decay,
            f"give less than {1 / lr:g} (1/optimizer.lr): each step shrinks the weights by "
            "lr x weight_decay, and at 1 none is left",
        )
    if isinstance(momentum, int | float) and not isinstance(momentum, bool) and momentum >= 1:
        raise UserError("optimizer.momentum", momentum, "give a value in [0, 1)")


def warn_long_warmup(
    optimizer: dict[str, Any], max_steps: int | None, steps: str = "max_steps={}"
) -> None:
    """A warmup as long as the run or longer ends it before the lr reaches optimizer.lr (the
    default 50 steps, in a run of 20, trains at 2/5 of it at most): said, not refused. `steps`
    says what the run's length is (max_steps, or the steps its epochs make)."""
    warmup = optimizer.get("warmup_steps", 0)
    if max_steps is not None and warmup >= max_steps > 0:
        log.warning(
            "optimizer.warmup_steps=%d is not below %s: the run ends before its lr reaches "
            "optimizer.lr=%g (at most %g); give a shorter warmup",
            warmup,
            steps.format(max_steps),
            optimizer["lr"],
            optimizer["lr"] * (max_steps - 1) / warmup,
        )


def split_option(option: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer option -> (the component node: _component_ and its arguments, the schedule)."""
    option = dict(option)
    schedule = {key: option.pop(key) for key in SCHEDULE_KEYS}
    return option, schedule


def state_per_weight(node: dict[str, Any]) -> int:
    """How many weight-sized tensors the optimizer keeps per trained weight (AdamW: 2, SGD with
    momentum: 1), found by building it on a probe parameter and stepping once.

    A UserError naming the argument the component refuses (or all of them, when it refuses
    only their combination).
    """
    import torch

    arguments = {k: v for k, v in node.items() if k != "_component_"}
    component = resolve_component(node["_component_"], "optimizer._component_")
    # With the kernel training takes (fused: PyTorch's, on CPU as on CUDA), which refuses what
    # the default one lets by (amsgrad="maybe" is a true value to it).
    try:
        optimizer, probe = _step_once(component, arguments)
    except TypeError as err:
        key, value = _culprit(node, component, arguments)
        # A kernel's message lists every signature it has after its first line.
        said = str(err).splitlines()[0].removesuffix(", but expected one of:")
        name = key.removeprefix("optimizer.")
        if _takes(component, name):  # momentum=abc: a key it takes, of another kind
            default = _default(component, name)
            fix = f"refuses it ({said}); give a value of its kind, as its default {default!r}"
        else:
            fix = f"does not take it ({said}); drop or rename the key in the optimizer option"
        raise UserError(key, value, f"{node['_component_']} {fix}") from None
    except (ValueError, IndexError, RuntimeError) as err:
        key, value = _culprit(node, component, arguments)
        default = _default(component, key.removeprefix("optimizer."))
        given = value if isinstance(value, list | tuple) else [value]
        if isinstance(default, tuple | list) and len(given) != len(default):
            # betas=[0.9]: torch reads betas[1] ("list index out of range").
            fix = f"give {len(default)} values (its class's default is {list(default)})"
        else:
            fix = f"{node['_component_']} refuses them: {err}; give values it takes (see its "
            fix += "documentation)"
        raise UserError(key, value, fix) from None
    state = optimizer.state[probe].values()
    return sum(torch.is_tensor(t) and t.shape == probe.shape for t in state)


def _step_once(component: Any, arguments: dict[str, Any]) -> tuple[Any, torch.nn.Parameter]:
    """The optimizer built on a probe weight and stepped once, and the probe."""
    import torch

    probe = torch.nn.Parameter(torch.zeros(_PROBE_WEIGHTS))
    optimizer = component([probe], **arguments)
    probe.grad = torch.ones(_PROBE_WEIGHTS)
    optimizer.step()
    return optimizer, probe


def _default(component: Any, name: str) -> Any:
    """The default of the component's argument `name`; None where it has none or no such one."""
    import inspect

    parameter = inspect.signature(component).parameters.get(name)
    return None if parameter is None else parameter.default


def _takes(component: Any, name: str) -> bool:
    """Whether the component's signature has an argument `name`."""
    import inspect

    return name in inspect.signature(component).parameters


def _culprit(node: dict[str, Any], component: Any, arguments: dict[str, Any]) -> tuple[str, Any]:
    """The key and value of the one argument the component refuses on its own
    (`optimizer.betas`, [0.9]); `optimizer` and all of them when none does alone.

    A UserError naming `optimizer._component_` where the component does not step as training
    steps it (`step()`, no closure: LBFGS) even with its defaults."""
    base = {"lr": arguments["lr"]} if "lr" in arguments and _takes(component, "lr") else {}
    try:
        _step_once(component, base)
    except (TypeError, ValueError, IndexError, RuntimeError) as err:
        raise UserError(
            "optimizer._component_",
            node["_component_"],
            f"does not step as training steps it, with its defaults ({err}); give an optimizer "
            "that steps dense gradients with step() alone, as torch.optim.AdamW or "
            "torch.optim.SGD",
        ) from None
    # With the fused kernel only where the component has one: else every probe fails on it.
    fused = "fused" in arguments and _takes(component, "fused")
    kernel = {"fused": arguments["fused"]} if fused else {}
    for name, value in arguments.items():
        try:
            _step_once(component, {**base, **kernel, name: value})
        except (TypeError, ValueError, IndexError, RuntimeError):
            return f"optimizer.{name}", value
    return "optimizer", arguments
