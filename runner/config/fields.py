"""Bounded fields of the config schemas, and `typed_as`: a composed config merged into a schema.

`typed_as(cfg, schema)` merges the composed config into the schema, so a wrong type or an
unknown key fails before anything runs, with the key named; then every bounded field is checked
against the bound its field declares (`integer`, `number`, `flag`). Each message is one UserError
naming the key, the value and the fix. What cannot be said per field (cross-field rules, files
that must exist) is checked by the section's own module (runner.config.dataset, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import field
from types import UnionType
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from runner.errors import NULL, UserError

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

# What prints every key of the config a Hydra command composed (`runner train --cfg job`); a
# command that is no Hydra app names its own (runner cluster: `runner cluster --help`).
EVERY_KEY = "--cfg job"
# The spellings of a sweep on the command line: Hydra's flag, and its mode set as a key.
MULTIRUN_FLAGS = ("-m", "--multirun", "hydra.mode=MULTIRUN")


def override_key(override: str) -> str:
    """The dotted key a command-line override sets: `+a.b=1`, `~a.b` and `a.b=1` all set a.b."""
    return override.split("=", 1)[0].lstrip("+~")


def as_typed(overrides: Any) -> list[str]:
    """Hydra's list of overrides (hydra.overrides.task) as typed. Read as OmegaConf's list, an
    override that holds an interpolation is resolved on the way (eval.steps=${max_steps} read
    eval.steps=1600, and was recorded so), or fails where its key is not there."""
    if isinstance(overrides, ListConfig):
        overrides = OmegaConf.to_container(overrides, resolve=False)
    return [str(o) for o in overrides]


def parsed_overrides(overrides: list[str]) -> list[Override]:
    """`overrides` parsed as Hydra's sweeper parses them: with the config loader of this
    process's Hydra, which glob(...) reads a group's options through (without it, each of the
    sweep's callbacks failed, 'ConfigLoader is not set', and the sweep had no summary)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra = GlobalHydra.instance()
    loader = hydra.config_loader() if hydra.is_initialized() else None
    return OverridesParser.create(config_loader=loader).parse_overrides(overrides)


def groups_given_twice(overrides: list[str], groups: set[str]) -> dict[str, list[str]]:
    """Each config group that `overrides` choose more than once, with the options in order:
    Hydra takes the last (`compute=multi_node compute=cpu` is compute=cpu) without a word."""
    chosen: dict[str, list[str]] = {}
    for override in overrides:
        key, equals, option = override.partition("=")
        if equals and key in groups:
            chosen.setdefault(key, []).append(option)
    return {group: options for group, options in chosen.items() if len(set(options)) > 1}


def integer(default: int | None, minimum: int, maximum: int | None = None) -> Any:
    """An int field of at least `minimum`, and at most `maximum` where given (an Optional one
    may be null)."""
    return field(default=default, metadata={"minimum": minimum, "maximum": maximum})


def number(default: float | None, *, positive: bool) -> Any:
    """A float field, > 0 when `positive`, else >= 0 (an Optional one may be null)."""
    return field(default=default, metadata={"positive": positive})


def flag(default: bool | None) -> Any:
    """A bool field given as a true boolean (an Optional one may be null)."""
    return field(default=default, metadata={"flag": True})


def typed_as(
    cfg: DictConfig, schema: type, prefix: str = "", listed_by: str = EVERY_KEY
) -> DictConfig:
    """`cfg` merged into `schema`, every bounded field checked; `prefix` is where `cfg` sits in
    the whole config, and `listed_by` what prints its keys, for the messages."""
    _check_sections(schema, cfg, prefix)
    # Every interpolation resolved here, where OmegaConf names the key that holds one that does
    # not resolve (runner.errors.interpolation_error); and a section (dataset, model.builder)
    # merged alone loses the config around it: one to a key outside it was "not found".
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if cfg._get_parent() is not None:
        section = OmegaConf.create(resolved)
        assert isinstance(section, DictConfig)  # a section's container is a dict
        cfg = section
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except ConfigKeyError as err:
        given = OmegaConf.select(cfg, str(err.full_key), default="", throw_on_missing=False)
        hint = _closest_key(schema, str(err.full_key))
        raise UserError(
            f"{prefix}{err.full_key}", given, f"no such key; {hint}`{listed_by}` prints every key"
        ) from None
    except ValidationError as err:
        key = str(err.full_key)
        given = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        found = _field_of(schema, key)
        fix = _fix(found) if found else f"give a value of the type `{listed_by}` shows"
        if given is None and _typed_null(cfg, key):
            given, fix = NULL, f"{fix} (it takes no null)"
        raise UserError(f"{prefix}{key}", given, fix) from None
    assert isinstance(merged, DictConfig)  # a dataclass merges into a DictConfig
    _check_bounds(schema, merged, cfg, prefix)
    return merged


def decode_hint(written: Any, key: str) -> str:
    """ " (an interpolation gives text: ...)" where `written` (a config as written, its
    interpolations unresolved) holds `key` as an interpolation that resolves to text, as
    ${oc.env:NAME} always does, where a number or true/false was wanted; "" otherwise."""
    parent_key, _, name = key.rpartition(".")
    select = {"throw_on_missing": False, "throw_on_resolution_failure": False}
    parent = OmegaConf.select(written, parent_key, **select) if parent_key else written
    if not (isinstance(parent, DictConfig) and name in parent):
        return ""
    if not OmegaConf.is_interpolation(parent, name):
        return ""
    if not isinstance(OmegaConf.select(parent, name, **select), str):
        return ""
    text = parent._get_node(name)._value()  # type: ignore[union-attr]  # the ${...} as written
    return f" (an interpolation gives text: write '${{oc.decode:{text}}}', which decodes it)"


def _typed_null(cfg: DictConfig, key: str) -> bool:
    """Whether `cfg` holds `key` as a null the user gave (epochs=null), not a key left out."""
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_missing=False) if parent_key else cfg
    return isinstance(parent, DictConfig) and name in parent and parent[name] is None


# A schema field and its annotation, resolved (the modules that declare schemas postpone their
# annotations, so Field.type is a string there).
TypedField = tuple[dataclasses.Field[Any], Any]


def _fields(schema: type) -> list[TypedField]:
    """The fields of `schema`, each with its annotation resolved."""
    hints = get_type_hints(schema)
    return [(spec, hints[spec.name]) for spec in dataclasses.fields(schema)]


def _check_sections(schema: type, given: DictConfig, prefix: str) -> None:
    """Each section of `schema` given as a section (`merged=3` would fail the merge with no key
    named)."""
    for spec, annotation in _fields(schema):
        section = _section(annotation)
        if section is None or spec.name not in given:
            continue
        value = OmegaConf.select(given, spec.name, throw_on_missing=False)
        key = f"{prefix}{spec.name}"
        if not isinstance(value, DictConfig):
            names = [spec.name for spec in dataclasses.fields(section)]
            raise UserError(
                key,
                value,
                f"is a section of {', '.join(names)}: set them, e.g. {key}.{names[0]}=...",
            )
        _check_sections(section, value, f"{key}.")


def check_chosen(cfg: DictConfig, schema: type) -> None:
    """Each section of a composed config given that is a config group's, or has a key that
    only an option of its group gives (???): `~model` removed the option, and the ??? failed
    at its first read with a traceback."""
    from runner.paths import config_groups

    groups = config_groups()
    for spec, annotation in _fields(schema):
        if spec.name in cfg:
            continue
        section = _section(annotation)
        # A group's option removed (optimizer and loss, untyped, too): its defaults would stand
        # in, or (~method) a key another reads (eval.metrics: ${method.eval_metrics}) would not
        # resolve.
        if spec.name in groups or (
            section is not None and any(f.default is MISSING for f, _ in _fields(section))
        ):
            raise _removed(spec.name)


def check_removed(
    cfg: DictConfig, overrides: list[str], schema: type, listed_by: str = EVERY_KEY
) -> None:
    """Each `~KEY` among `overrides` that removed from `cfg` (composed) a key `schema` types:
    the key fell back on the schema's default, not the one its YAML gives (~max_steps trained
    4 epochs, not 1600 steps), or failed where it was read (~objective.metric in a traceback).
    `listed_by` prints the composed config's keys."""
    from runner.paths import config_groups

    groups = config_groups()
    absent = object()
    for override in overrides:
        key = override_key(override)
        held = OmegaConf.select(cfg, key, default=absent, throw_on_resolution_failure=False)
        if not override.startswith("~") or held is not absent:  # kept, or added back (+KEY=)
            continue
        if key in groups:
            raise _removed(key)
        found = _field_of(schema, key)
        if found is None:
            continue  # a key of an open section (runtime.env.NAME, model.builder.KEY)
        give = f"set its keys, {key}.KEY=VALUE" if _section(found[1]) else f"give {key}=VALUE"
        fix = f"removed (~{key}), but runner reads it: {give} instead"
        raise UserError(key, None, f"{fix} (`{listed_by}` prints its default)")


def check_groups_read(cfg: DictConfig, choices: Mapping[str, Any], schema: type) -> None:
    """A config group of the user's own (--config-dir, hydra.searchpath) whose option lands
    under a key `schema` does not have (+mygroup=x: mygroup.*) is refused by its group and
    option, not as "no such key" of the option's contents. One whose option is in the global
    package (an experiment file) sets keys of runner's, and is read. `choices` are Hydra's
    (hydra.runtime.choices)."""
    from runner.paths import config_groups

    groups = config_groups()
    for group, option in choices.items():
        top = group.partition("/")[0]  # mygroup/sub lands under mygroup
        if top in groups or top not in cfg or _field_of(schema, top) is not None:
            continue
        ours = ", ".join(sorted(groups - {"hydra"}))
        raise UserError(
            group,
            option,
            f"runner reads no {group} group (its groups: {ours}); put your option in one of "
            "those (DIR/model/NAME.yaml, chosen with model=NAME), or begin its file with "
            "`# @package _global_` to set runner's keys from it",
        )


def _removed(group: str) -> UserError:
    """A config group's option, removed (~GROUP)."""
    return UserError(group, None, f"removed (~{group}); give {group}=OPTION (`--help` lists them)")


def _field_of(schema: type | None, key: str) -> TypedField | None:
    """The field of `schema` at a dotted key, if the schema types it."""
    found = None
    for part in key.split("."):
        fields = {spec.name: (spec, hint) for spec, hint in _fields(schema)} if schema else {}
        found = fields.get(part)
        if found is None:
            return None
        schema = _section(found[1])
    return found


def _closest_key(schema: type, key: str) -> str:
    """ "did you mean 'batch_size'? " for a key a letter or two off one of its section's."""
    section_key, _, name = key.rpartition(".")
    found = _field_of(schema, section_key) if section_key else None
    section = _section(found[1]) if found else (None if section_key else schema)
    names = [spec.name for spec in dataclasses.fields(section)] if section else []
    match = difflib.get_close_matches(name, names, n=1)
    return f"did you mean {match[0]!r}? " if match else ""


def is_open(schema: type, key: str) -> bool:
    """Whether the field of `schema` at a dotted key is a dict that takes any key (+key=value
    adds one), as runtime.env is."""
    found = _field_of(schema, key)
    if found is None:
        return False
    # Dict[...] or Optional[Dict[...]]: the dict is the annotation or one of its Union's args.
    kinds = [found[1], *get_args(found[1])]
    return any(get_origin(kind) is dict for kind in kinds)


def _section(annotation: Any) -> type | None:
    """The section dataclass a field's annotation is, if it is one."""
    section = annotation if isinstance(annotation, type) else None
    return section if dataclasses.is_dataclass(section) else None


def _fix(typed_field: TypedField) -> str:
    """What to give instead, from the field's declared bound."""
    spec, annotation = typed_field
    optional = " or null" if type(None) in get_args(annotation) else ""
    if spec.metadata.get("maximum") is not None:
        bounds = f"from {spec.metadata['minimum']} to {spec.metadata['maximum']}"
        return f"give an integer {bounds}{optional}"
    if "minimum" in spec.metadata:
        return f"give an integer >= {spec.metadata['minimum']}{optional}"
    if "positive" in spec.metadata:
        return f"give a number {'> 0' if spec.metadata['positive'] else '>= 0'}{optional}"
    if "flag" in spec.metadata:
        return f"give true or false{optional}"
    kind = _number_type(annotation)
    if kind is not None:
        return f"give {'an integer' if kind is int else 'a number'}{optional}"
    return f"give {_in_words(annotation)}{optional}"


def _in_words(annotation: Any) -> str:
    """A field's type as a user types its value (`a list, e.g. [a, b]`), not Python's name."""
    union = get_origin(annotation) is Union or isinstance(annotation, UnionType)
    kinds = [a for a in get_args(annotation) if a is not type(None)] if union else [annotation]
    words: dict[Any, str] = {
        list: "a list, e.g. [a, b]",
        dict: "a mapping, e.g. {key: value}",
        str: "a string",
        bool: "true or false",
    }
    if len(kinds) != 1:
        return f"a value of type {annotation}"
    return words.get(get_origin(kinds[0]) or kinds[0], f"a value of type {annotation}")


def _number_type(annotation: Any) -> type | None:
    """int or float for a field annotated so (Optional or not); None for any other field."""
    kinds = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else None


def _given_as(raw: Any, kind: type | None) -> bool:
    """Whether a value as given is of the field's number type: an int for an int, an int or a
    float for a float, never a string or a boolean (None: not given, or not a number field)."""
    if raw is None or kind is None:
        return True
    allowed = (int,) if kind is int else (int, float)
    return isinstance(raw, allowed) and not isinstance(raw, bool)


def _check_bounds(schema: type, merged: DictConfig, given: Any, prefix: str) -> None:
    """Each bounded field of `merged` within its bound; a flag given as a true boolean."""
    for spec, annotation in _fields(schema):
        key = f"{prefix}{spec.name}"
        if spec.name not in merged:
            continue
        raw = given.get(spec.name) if isinstance(given, DictConfig) else None
        section = _section(annotation)
        if section is not None:
            _check_bounds(section, merged[spec.name], raw, f"{key}.")
            continue
        value = OmegaConf.select(merged, spec.name, throw_on_missing=False)
        if value is None:
            continue
        if not _given_as(raw, _number_type(annotation)):
            # OmegaConf converts "12" (a quoted YAML value, max_steps='12') to 12: not here.
            raise UserError(key, raw, _fix((spec, annotation)) + decode_hint(given, spec.name))
        if not spec.metadata:
            continue
        if "flag" in spec.metadata:
            # OmegaConf takes 3 or "yes" for true: only a boolean is one here.
            if raw is not None and not isinstance(raw, bool):
                raise UserError(key, raw, _fix((spec, annotation)))
            continue
        minimum, positive = spec.metadata.get("minimum"), spec.metadata.get("positive")
        maximum = spec.metadata.get("maximum")
        out_of_range = (
            (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
            or (positive is True and value <= 0)
            or (positive is False and value < 0)
        )
        if out_of_range or value != value or value in (math.inf, -math.inf):
            # nan compares false with every bound (clip_grad_norm=nan passed, and the run went
            # nan at its second step, blamed on the learning rate); inf is no setting either.
            # Named as given: the merge made optimizer.lr=0 a float, 0.0.
            raise UserError(key, value if raw is None else raw, _fix((spec, annotation)))
