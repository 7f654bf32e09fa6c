"""Secrets typed on the command line: refused before Hydra composes, whose `--cfg job` and
`--info` print every value as typed, and before any command that would not read them (an
export without push_to) runs on with the secret in its shell history alone.

A hub token is given by reference (env:NAME or file:PATH), deploy's API key by the name of its
variable or file, and runtime.env, which the run directory records, holds no secret; nor does
any other key: a value that is a service's token, typed or brought in by an interpolation
(${oc.env:NAME}), is refused before the recipe is written (refuse_tokens).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig

from runner.config.fields import override_key
from runner.errors import HIDDEN, SECRET_KEY, TOKEN_PREFIXES, URL_PASSWORD, UserError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A whole value that is a token (hf_ and 34 more, sk-..., ghp_...): not a path or a name that
# holds such a prefix inside it (/data/task-management.jsonl).
_TOKEN = re.compile(rf"(?:{TOKEN_PREFIXES})[A-Za-z0-9_-]{{20,}}")


# The sections whose keys name environment variables, and where each is written.
_WRITTEN_TO = {
    "runtime.env": "runtime.env is written to the run directory",
    "hydra.job.env_set": "Hydra writes hydra.job.env_set to the run directory (.hydra/)",
}


def env_secret_error(name: str, section: str = "runtime.env") -> UserError:
    """SECTION.NAME (runtime.env, hydra.job.env_set), where NAME looks like a secret's."""
    return UserError(
        f"{section}.{name}",
        HIDDEN,
        f"looks like a secret, and {_WRITTEN_TO[section]}; export it in the environment of "
        "`runner train` instead (training processes inherit it)",
    )


def token_error(key: str) -> UserError:
    """`key` holds a value shaped as a service's token, never shown."""
    return UserError(
        key,
        HIDDEN,
        "looks like a token, and the run directory records every value: export it in the "
        "environment of `runner` (training processes inherit it), or give it by reference "
        "where the key takes one (runtime.hf_token=env:NAME)",
    )


def refuse_tokens(section: Any, prefix: str = "") -> None:
    """A UserError for the first value of a resolved config (a plain dict) that is a token:
    one brought in by an interpolation (runtime.project=${oc.env:HF_TOKEN}) was written in
    clear to recipe.yaml, manifest.json and the trackers' records."""
    if isinstance(section, dict):
        for name, value in section.items():
            refuse_tokens(value, f"{prefix}{name}.")
    elif isinstance(section, list):
        for i, value in enumerate(section):
            refuse_tokens(value, f"{prefix}{i}.")
    elif isinstance(section, str) and _TOKEN.fullmatch(section.strip()):
        raise token_error(prefix.removesuffix("."))
    elif isinstance(section, str) and URL_PASSWORD.search(section):
        raise url_password_error(prefix.removesuffix("."))


def url_password_error(key: str) -> UserError:
    """`key` holds a URL with a password in it (scheme://user:PASSWORD@host), never shown."""
    return UserError(
        key,
        HIDDEN,
        "holds a password in its URL, and the run directory records every value: give the URL "
        "without it, and the password by the service's own variable, exported where `runner` "
        "starts (MLflow's MLFLOW_TRACKING_PASSWORD)",
    )


def check_env_name(key: str, name: str) -> None:
    """A UserError where `key` (api_key.env) holds no environment variable's name: it may be a
    key pasted by mistake, so the value is never echoed."""
    if not _ENV_NAME.fullmatch(name):
        raise UserError(
            key,
            HIDDEN,
            "give the NAME of an environment variable holding the key, never the key itself",
        )


def refuse_typed_secrets(overrides: list[str]) -> None:
    """A UserError, naming the key and never the value, for a secret typed as a value."""
    for override in overrides:
        key, equals, value = override.partition("=")
        if equals:
            refuse_secret(override_key(key), value.strip("'\""))


def refuse_config_secrets(config: DictConfig) -> None:
    """A UserError for the first secret among a composed config's values as written (a config
    file's, --config-name's or an option's; hydra.job.env_set's): a sweep writes its config to
    multirun.yaml, and each job's to its .hydra/, before any job's checks run."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(config, resolve=False)
    assert isinstance(values, dict)
    env_set = (values.pop("hydra", None) or {}).get("job", {}).get("env_set") or {}
    for key, value in [*_leaves(values), *_leaves(env_set, "hydra.job.env_set.")]:
        refuse_secret(key, value)


def _leaves(section: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Each (dotted key, value) of a nested dict's (and list's) string values."""
    if isinstance(section, dict):
        for name, value in section.items():
            yield from _leaves(value, f"{prefix}{name}.")
    elif isinstance(section, list):
        for i, value in enumerate(section):
            yield from _leaves(value, f"{prefix}{i}.")
    elif isinstance(section, str):
        yield prefix.removesuffix("."), section


def refuse_secret(key: str, value: str) -> None:
    """A UserError, naming `key` and never `value`, where `value` is a secret."""
    if value == "null":
        return
    if key.rpartition(".")[2] == "hf_token":
        from runner.hub.token import TokenRef

        TokenRef.parse(value, key)
    elif key == "api_key.env":
        check_env_name(key, value)
    elif key.rpartition(".")[0] in _WRITTEN_TO and SECRET_KEY.search(key.rpartition(".")[2]):
        section, _, name = key.rpartition(".")
        raise env_secret_error(name, section)
    elif _TOKEN.fullmatch(value):
        raise token_error(key)
    elif URL_PASSWORD.search(value):
        raise url_password_error(key)
