"""Recasts Hydra's composition errors as UserErrors that name the key, the value and the fix."""

from __future__ import annotations

import difflib
import re

import yaml
from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    SearchPathException,
)
from omegaconf.errors import OmegaConfBaseException, ValidationError

from runner.config.fields import EVERY_KEY
from runner.errors import (
    HIDDEN,
    SECRET_KEY,
    UserError,
    address_space_error,
    interpolation_error,
)
from runner.paths import config_groups, pasteable, user_path

OVERRIDE_FORMS = "overrides look like key=value, group=option, +new_key=value or ~key"
# OmegaConf's type names, as the fix for a value of a typed key of Hydra's own says them.
_A_KIND = {"Integer": "a whole number", "Float": "a number", "bool": "true or false"}
# The key of the path a command reads, given by a user as a bare word (`runner deploy RUN`).
PATH_KEYS = {"deploy": "checkpoint", "export": "checkpoint"}
# A group of `runner train` that another command sets with a key of its own.
OWN_KEYS: dict[tuple[str | None, str], str] = {
    ("deploy", "compute"): "device=cpu, device=cuda or device=auto"
}


def _closest(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1)
    return f"did you mean {match[0]!r}? " if match else ""


def from_hydra_error(
    err: BaseException, command: str | None = None, listed_by: str = EVERY_KEY
) -> UserError | None:
    """A UserError for a bad override or unknown group option; None for anything else.
    `command` (train, deploy, ...) is the runner command that composed, where it is known, and
    `listed_by` what prints the composed config's keys."""
    if isinstance(err, SearchPathException):
        missing = re.search(r"directory '(.*)' not found", str(err))
        return UserError(
            "--config-dir",
            missing.group(1) if missing else str(err),
            "no such directory; give the directory that holds your own options "
            "(DIR/model/mine.yaml for model=mine)",
        )
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        # A config file of the user's own (--config-dir) that is not YAML: a traceback.
        mark = err.problem_mark
        return UserError(
            "config file",
            mark.name,
            f"not valid YAML at line {mark.line + 1}, column {mark.column + 1} ({err.problem}); "
            "fix the file",
        )
    if isinstance(err, MissingConfigException) and err.options is not None:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        options = sorted(err.options)
        return UserError(
            group or "config",
            option,
            f"no such option; {_closest(option, options)}choose one of: {', '.join(options)}",
        )
    if isinstance(err, OverrideParseException):
        reason = str(err.message).splitlines()[0]
        override = err.override or ""
        key, _, value = override.partition("=")
        special = any(c in value for c in "[]{}(),=") or not value.isascii()
        if (special or " " in value) and value[:1] not in ("[", "{", "(", "'", '"'):
            # train[:50%]: a slice, a string to Hydra only when quoted (docs/datasets.md); a
            # path with a space or a letter beyond ASCII (dätä.jsonl) likewise.
            fix = f"quote the value (and the whole, for the shell): \"{key}='{value}'\""
            return UserError("override", override, f"{reason}; {fix}")
        if command in PATH_KEYS and "=" not in override and user_path(override).exists():
            # `runner deploy RUN`, as `runner resume RUN` takes its run.
            fix = f"a path is given as {PATH_KEYS[command]}=PATH: runner {command} " + pasteable(
                PATH_KEYS[command], override
            )
            return UserError("override", override, fix)
        return UserError("override", override, f"{reason}; {OVERRIDE_FORMS}")
    if isinstance(err, ConfigCompositionException):
        return _composition_error(err, command, listed_by)
    return None


def _composition_error(
    err: ConfigCompositionException, command: str | None, listed_by: str
) -> UserError:
    """An override Hydra could not apply: an unknown key or group, or a comma list."""
    cause = err.__cause__
    message = str(err).splitlines()[0]
    value = re.search(r"use \+[^=]+=(.*)$", str(err), re.MULTILINE)
    given = value.group(1) if value else ""
    if isinstance(cause, OmegaConfBaseException) and message.startswith("Could not override"):
        parent = getattr(cause, "parent_node", None)
        known = [str(k) for k in parent.keys()] if parent is not None else []
        close = difflib.get_close_matches(str(cause.key), known, n=1)
        key = str(cause.full_key)
        if any(SECRET_KEY.search(name) for name in [key, *close]):  # runtime.hf_tokn=hf_...
            given = HIDDEN
        typed = re.match(r"Could not override '(.*)'", message)
        if typed and key.startswith(f"{typed.group(1)}."):  # runtime.env={FOO:bar}
            fix = f"a dict of new keys merges into it with +{typed.group(1)}={given}"
            return UserError(typed.group(1), given, fix)
        if typed and typed.group(1).startswith(f"{key}."):
            key = typed.group(1)  # lora.rank=4 named as typed, not as `lora`, the key missing
        hint = f"did you mean {close[0]!r}? " if close else ""
        if key.startswith("method.") and not hint:
            from runner.config.method import METHOD_NAMES, methods_reading

            readers = methods_reading(key.removeprefix("method."))
            if readers != list(METHOD_NAMES):  # method.rank=4 with method=full
                fix = f"this method has no such key; it is a key of method={', '.join(readers)}"
                return UserError(key, given, fix)
        add = f" (add it with +{key}={given})" if not hint and _addable(key) else ""
        return UserError(key, given, f"no such key; {hint}`{listed_by}` prints every key{add}")
    if isinstance(cause, ValidationError) and message.startswith("Error merging override"):
        # A typed key of Hydra's own (hydra.launcher.n_jobs=abc): OmegaConf names the type.
        kind = re.search(r"converted to (\w+)|not a valid (bool)", str(cause.msg))
        name = kind and (kind.group(1) or kind.group(2))
        fix = f"give {_A_KIND.get(name, name)}" if name else str(cause.msg).splitlines()[0]
        return UserError(str(cause.full_key), message.partition("=")[2], fix)
    group = re.match(r"Could not override '(.*)'\. No match in the defaults list", message)
    if group:
        runner = f"runner {command}" if command else "this command"
        own = OWN_KEYS.get((command, group.group(1)))
        fix = f"set {own} instead" if own else f"`{runner} --help` lists its groups and keys"
        return UserError(group.group(1), given, f"{runner} has no {group.group(1)} group; {fix}")
    ambiguous = re.match(r"Ambiguous value for argument '([^=]*)=(.*)'$", message)
    if ambiguous and ambiguous.group(1) in config_groups():
        key, listed = ambiguous.groups()  # optimizer=adamw,sgd: a list is no option
        return UserError(
            key, listed, "a comma list is a sweep: add -m (--multirun) for one run per option"
        )
    if ambiguous:
        key, listed = ambiguous.groups()
        return UserError(
            key,
            listed,
            "a comma list is a sweep: add -m (--multirun) for one run per value, or quote it "
            f"for one string (\"{key}='{listed}'\"), or give a list as {key}=[{listed}]",
        )
    primary = re.match(r"Cannot find primary config '([^']*)'", message)
    if primary:  # --config-name nosuch
        return UserError(
            "--config-name",
            primary.group(1),
            "no such config: each command composes its own (train.yaml for runner train); "
            "drop --config-name, or name a file of your --config-dir",
        )
    # +key=value on a key that is there, ~key on one that is not, ~key=value on another value.
    added = re.match(r"Could not append to config\. An item is already at '(.*)'", message)
    if added:
        key = added.group(1)
        fix = f"{key} is there already: set it with {key}=VALUE"
        if key == "method.name":  # which check_method_keys refuses: the option sets it
            fix = "the option sets it: choose the method with method=NAME"
        return UserError(f"+{key}", None, fix)
    gone = re.match(r"Could not delete from config\. '(.*)' does not exist", message)
    if gone:
        # Hydra reads a key that holds null (~resume) as one that does not exist.
        fix = f"nothing to remove: no such key, or it holds null; `{listed_by}` prints every key"
        return UserError(f"~{gone.group(1)}", None, fix)
    other = re.match(r"Could not delete from config\. The value of '(.*)' is (.*) and not", message)
    if other:
        key, held = other.groups()
        return UserError(
            f"~{key}", None, f"{key} is {held}, not the value given: ~{key} removes it as it is"
        )
    sweep = re.match(r"Sweep parameters '([^=]*)=(.*)' requires --multirun", message)
    if sweep:  # seed=choice(1,2) without -m
        key, swept = sweep.groups()
        fix = "a sweep of values: add -m (--multirun) to runner train for one run per value"
        if command in ("validate", "estimate", "download"):
            fix = f"runner {command} checks one config: give one value"
        return UserError(key, swept, fix)
    return UserError("override", message, f"{OVERRIDE_FORMS}; `--help` lists the groups")


def _addable(key: str) -> bool:
    """Whether +key=value can add `key`: its section is a dict the schemas leave open
    (runtime.env, dataset.column_map, ...), not a typed section."""
    from runner.config.fields import is_open
    from runner.config.schema import Cluster, Deploy, Export, Train

    section = key.rpartition(".")[0]
    return bool(section) and any(is_open(s, section) for s in (Train, Deploy, Export, Cluster))


def as_user_error(err: BaseException, command: str | None = None) -> UserError | None:
    """Our UserError, or a Hydra/OmegaConf composition error recast as one; None otherwise.
    `command` is the runner command that composed, where it is known."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, UserError):
            return cause
        converted = from_hydra_error(cause, command)
        if converted is not None:
            return converted
        cause = cause.__cause__ or cause.__context__
    return interpolation_error(err) or address_space_error(err)
