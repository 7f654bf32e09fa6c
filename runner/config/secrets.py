"""Secrets typed on the command line: refused before Hydra composes, whose `--cfg job` and
`--info` print every value as typed, and before any command that would not read them (an
export without push_to) runs on with the secret in its shell history alone.

A hub token is given by reference (env:NAME or file:PATH), deploy's API key by the name of its
variable or file, and runtime.env, which the run directory records, holds no secret.
"""

from __future__ import annotations

import re

from runner.config.fields import override_key
from runner.errors import SECRET_KEY, UserError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_secret_error(name: str) -> UserError:
    """runtime.env.NAME, where NAME looks like a secret's."""
    return UserError(
        f"runtime.env.{name}",
        "<hidden>",
        "looks like a secret, and runtime.env is written to the run directory; export it in "
        "the environment of `runner train` instead (training processes inherit it)",
    )


def check_env_name(key: str, name: str) -> None:
    """A UserError where `key` (api_key.env) holds no environment variable's name: it may be a
    key pasted by mistake, so the value is never echoed."""
    if not _ENV_NAME.fullmatch(name):
        raise UserError(
            key,
            "<hidden>",
            "give the NAME of an environment variable holding the key, never the key itself",
        )


def refuse_typed_secrets(overrides: list[str]) -> None:
    """A UserError, naming the key and never the value, for a secret typed as a value."""
    for override in overrides:
        key, equals, value = override.partition("=")
        key, value = override_key(key), value.strip("'\"")
        if not equals or value == "null":
            continue
        if key.rpartition(".")[2] == "hf_token":
            from runner.hub.download import TokenRef

            TokenRef.parse(value, key)
        elif key == "api_key.env":
            check_env_name(key, value)
        elif key.startswith("runtime.env.") and SECRET_KEY.search(key.removeprefix("runtime.env.")):
            raise env_secret_error(key.removeprefix("runtime.env."))
