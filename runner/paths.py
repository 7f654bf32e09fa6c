"""Where the packaged configs, recipes and embedded assets live (editable or installed alike),
and paths as a user types them (`~`) and pastes them (an override of a path)."""

from __future__ import annotations

import errno
from importlib.resources import files
from pathlib import Path

CONF_DIR = Path(str(files("runner.conf")))
RECIPES_DIR = Path(str(files("runner.recipes")))
ASSETS_DIR = Path(str(files("runner"))) / "assets"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
SAMPLE_DATA_DIR = ASSETS_DIR / "sample"


# What a cache directory answers when it cannot take a file: full, over quota or a file-size
# limit, read-only, or another user's.
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def unwritable_fix(err: OSError, setting: str) -> str:
    """What a cache that could not take a file (an errno of UNWRITABLE) says after naming it:
    why, and the fix, `setting` pointed elsewhere."""
    room = "free space there, or " if err.errno in FULL else ""
    where = "a directory with room that this user may write"
    return f"({err.strerror}); {room}set {setting} to {where}"


def user_path(given: object) -> Path:
    """A path a user typed, `~` expanded as the shell does unquoted: Hydra keeps a quoted
    `hydra.run.dir='~/runs'` as typed, and a directory named `~` was made in the working
    directory."""
    return Path(str(given)).expanduser()


def refuse_empty_path(
    key: str, given: object, fix: str, means: str = "the working directory"
) -> None:
    """A UserError where the path typed under `key` is empty (`key=`, or `key=$DIR` of an unset
    shell variable): as a path it `means` the working directory (or the root a name is put
    under), where a run, a sweep or an export was written among the user's own files."""
    from runner.errors import UserError

    if isinstance(given, str) and not given.strip():
        raise UserError(key, given, f"an empty path ({means}); {fix}")


def config_groups() -> set[str]:
    """The config groups of conf/ (model, dataset, ..., hydra): its folders."""
    return {path.name for path in CONF_DIR.iterdir() if path.is_dir()}


def override(key: str, value: str) -> str:
    """`key=value` as Hydra reads it back as `value`: quoted for Hydra where its grammar reads
    the value otherwise (a letter outside ASCII, `,`, `=`, brackets, a number)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = f"{key}={value}"
    try:
        if OverridesParser.create().parse_override(plain).value() == value:
            return plain
    except Exception:  # Hydra's grammar refuses it as typed
        pass
    escaped = value.replace("'", "\\'")  # a quote inside Hydra's quotes: \'
    return f"{key}='{escaped}'"


def shell_path(path: Path | str) -> str:
    """`path` as one shell word, to paste into a command (`runner resume RUN`): a space or a
    quote in it stays in it."""
    import shlex

    return shlex.quote(str(path))


def pasteable(key: str, value: str) -> str:
    """`key=value` as one shell word that Hydra reads back as `value` (`override`, then quoted
    for the shell: a space)."""
    import shlex

    given = override(key, value)
    if given != f"{key}={value}" and not set(given) & set('$`"\\!'):
        return f'"{given}"'  # as the CLI's own advice quotes: "key='value'"
    return shlex.quote(given)
