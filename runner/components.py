"""Instantiates `_component_` config nodes, only from allow-listed module prefixes."""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError
from runner.notices import keep_notices_off_the_console

ALLOWED_PREFIXES = ("torchtune.", "torch.optim.", "torch.nn.", "runner.")


def resolve_component(path: str, key: str = "_component_") -> Any:
    """Imports the object a dotted path names, refusing modules outside ALLOWED_PREFIXES."""
    if not isinstance(path, str) or not path.startswith(ALLOWED_PREFIXES):
        raise UserError(key, path, f"components may only come from {', '.join(ALLOWED_PREFIXES)}")
    module_name, _, attr = path.rpartition(".")
    if path.startswith("torchtune."):
        # torchao warns as torchtune imports it: the filters first, as runner.models.
        # torchtune_boundary puts them (a model's builder was torchtune's first import where
        # the config's checks ran before the data's modules were imported).
        keep_notices_off_the_console(drop=None)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UserError(key, path, f"no such component ({err})") from err


def check_arguments(path: str, arguments: dict[str, Any], key: str) -> None:
    """The arguments of the component at `path` (section `key`) against its signature: one it
    takes no such argument for (a misspelt num_layer) named with the nearest it takes, one it
    needs and is not given named too, where a builder failed on either with a traceback."""
    import difflib
    import inspect

    parameters = inspect.signature(resolve_component(path, f"{key}._component_")).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # it takes any keyword
    for name, value in arguments.items():
        if name != "_component_" and name not in parameters:
            near = difflib.get_close_matches(name, list(parameters), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise UserError(f"{key}.{name}", value, f"{path} takes no such argument{hint}")
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for name, parameter in parameters.items():
        needed = parameter.default is inspect.Parameter.empty and parameter.kind in named
        if needed and name not in arguments:
            raise UserError(f"{key}.{name}", None, f"{path} needs it; give {key}.{name}=VALUE")


def instantiate(node: DictConfig, *args: Any, **kwargs: Any) -> Any:
    """Calls node._component_ with the node's other keys as keyword arguments."""
    params = plain_dict(node, resolve=True)
    component = resolve_component(params.pop("_component_"))
    return component(*args, **params, **kwargs)


def plain_dict(node: DictConfig, *, resolve: bool = False) -> dict[str, Any]:
    """A config section as a plain dict (its keys are strings, as YAML's are; its values plain)."""
    section = OmegaConf.to_container(node, resolve=resolve)
    assert isinstance(section, dict), "a config section is a mapping"
    return {str(key): value for key, value in section.items()}
