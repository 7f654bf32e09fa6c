"""The one exception type for user errors, caught once at the CLI."""

from __future__ import annotations

import re
import resource
from collections.abc import Iterator
from contextlib import contextmanager

# A key that holds a credential: a token as the last word of its name (hf_token, GITHUB_TOKEN,
# token), where a tokenizer's special token (eos_token) or a count (max_new_tokens, bos_token_id,
# TOKENIZERS_PARALLELISM) is none; a secret, password, API key or credential anywhere in it.
SECRET_KEY = re.compile(
    r"(?<!bos)(?<!eos)(?<!pad)(?<!unk)(?<!sep)(?<!cls)(?<!mask)(^|[_.-])token$"
    r"|secret|password|passwd|api[_-]?key|credential",
    re.IGNORECASE,
)
# A value shaped as the tokens of the services a run talks to (the hub's hf_..., OpenAI's sk-...,
# GitHub's, Slack's, GitLab's): never echoed, whatever key it was given to.
TOKEN_PREFIXES = r"hf_|sk-|ghp_|gho_|github_pat_|xox[abpr]-|glpat-"
SECRET_VALUE = re.compile(rf"({TOKEN_PREFIXES})[A-Za-z0-9_-]{{6,}}")
HIDDEN = "<hidden>"
# A URL's password (scheme://user:PASSWORD@host), as MLFLOW_TRACKING_URI may hold one.
URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")


def redact_text(text: str) -> str:
    """`text` with a URL's password and a token-shaped value hidden: an error message a library
    raised (MLflow's names its tracking URI) before it is printed or recorded."""
    return SECRET_VALUE.sub(HIDDEN, URL_PASSWORD.sub(rf"\g<1>{HIDDEN}@", text))


class _Null:
    """A null the user typed (key=null), told from None, which is no value given at all."""

    def __repr__(self) -> str:
        return "null"


NULL = _Null()


class UserError(Exception):
    """A mistake the user can fix: printed as one message, exit code 2, no traceback.

    The message names the key, the bad value and the fix: `key='value': fix` (a bool as `true`
    or `false`, as typed; NULL, a null typed, as `null`), or `key: fix` where the value is None
    (nothing typed: an argument left out), which is no value a user gave. A secret is shown as
    '<hidden>' (_looks_secret: a token typed under a misspelt key, runtime.hf_tokn=hf_..., or any
    value of a credential's key, +model.api_key=...).
    """

    exit_code = 2

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        if value is None:
            given = ""
        elif _looks_secret(key, value):
            given = f"={HIDDEN!r}"
        elif isinstance(value, bool):
            given = f"={str(value).lower()}"  # as YAML and the command line spell it
        else:
            given = f"={value!r}"
        super().__init__(f"{key}{given}: {fix}")


def _looks_secret(key: str, value: object) -> bool:
    """A value shaped as a token, or a credential key's value other than a reference to one
    (env:NAME, file:PATH: runtime.hf_token's forms) or the bare name of a variable."""
    if not isinstance(value, str) or value == HIDDEN:
        return False
    if SECRET_VALUE.search(value):
        return True
    reference = value.startswith(("env:", "file:")) or re.fullmatch(r"[A-Z_][A-Z0-9_]*", value)
    return bool(SECRET_KEY.search(key.rpartition(".")[2])) and not reference


def user_error_in(err: BaseException) -> UserError | None:
    """The UserError that `err` is or was raised from (OmegaConf wraps one raised inside an
    interpolation's resolver in an error of its own), or that an interpolation the user wrote
    could not be resolved; None where there is neither."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, UserError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return interpolation_error(err) or address_space_error(err)


# More address space than any library training loads maps at once (libtorch_cpu's segments:
# about 0.5 GiB; a CUDA library's, more): a mapping refused with this much left was not refused
# for room.
_LIBRARY_ROOM = 2 << 30


def address_space_limit() -> int | None:
    """The bytes a process may map here (`ulimit -v`, as login nodes set); None: no limit."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if limit == resource.RLIM_INFINITY else limit


def address_space_error(err: BaseException) -> UserError | None:
    """Memory run out under an address-space limit (`ulimit -v`, as login nodes set), where a
    library loads or allocates outside training (which says it in a line of its own): named
    with the limit; None where no limit is set or `err` is not memory run out."""
    limit = address_space_limit()
    if limit is None:
        return None
    text = str(err)
    # A shared library that cannot be mapped (glibc says so of any mapping refused, a noexec
    # mount's too), or a C extension whose allocation failed without an exception set
    # (SystemError, as torch._dynamo's import gave at 2 GB): memory only where little is left.
    unsure = "failed to map segment" in text or isinstance(err, SystemError)
    # A thread's stack (8 MiB, ulimit -s) that cannot be mapped; a pids limit says so too.
    thread = "can't start new thread" in text
    if not (isinstance(err, MemoryError) or "annot allocate memory" in text or unsure or thread):
        return None
    left = _address_space_left(limit)
    if (unsure and not left < _LIBRARY_ROOM) or (thread and not left < _stack_room()):
        return None
    what = error_line(err) if text else type(err).__name__
    return UserError(
        "ulimit -v",
        None,
        f"this shell lets a process map at most {limit // 1024} KiB ({limit / 2**30:.1f} GiB) "
        f"of memory, and runner ran out of it ({what}); raise the limit (`ulimit -v "
        "unlimited`, where the machine allows) or run where it is higher",
    )


def _stack_room() -> int:
    """Room for a few threads' stacks (glibc gives each one ulimit -s): a thread refused with
    more left was refused for another reason (a pids limit)."""
    import threading

    stack = threading.stack_size() or resource.getrlimit(resource.RLIMIT_STACK)[0]
    return max(64 << 20, 4 * stack) if stack != resource.RLIM_INFINITY else 64 << 20


def _address_space_left(limit: int) -> float:
    """Bytes this process may still map under `limit` (/proc/self/status's VmSize); infinite
    where the kernel does not say."""
    try:
        with open("/proc/self/status") as proc:
            status = proc.read()
    except OSError:
        return float("inf")
    found = re.search(r"^VmSize:\s+(\d+) kB", status, re.M)
    return float("inf") if found is None else limit - int(found[1]) * 1024


def interpolation_error(err: BaseException) -> UserError | None:
    """A `${...}` that does not resolve, named by the key that holds it, as typed: a key that
    is not there, one left ??? (to be given), an environment variable that is not set, or a
    circle; None for any other error."""
    from omegaconf.errors import (
        InterpolationKeyError,
        InterpolationResolutionError,
        InterpolationToMissingValueError,
    )

    if not isinstance(err, InterpolationResolutionError):
        return None
    node = getattr(err, "child_node", None)
    given = node._value() if node is not None else None  # the ${...} as written
    reason = str(err.msg).splitlines()[0] if err.msg else ""
    variable = re.search(r"Environment variable '(.*)' not found", reason)
    if isinstance(err, InterpolationKeyError):
        missing = re.search(r"key '(.*)' not found", reason)
        what = f" ({missing.group(1)})" if missing else ""
        fix = f"no such key to interpolate{what}; `--cfg job` prints every key"
    elif isinstance(err, InterpolationToMissingValueError):
        fix = "it interpolates a key left ??? (to be given): give that key a value"
    elif variable:
        name = variable.group(1)
        default = f"${{oc.env:{name},DEFAULT}}"
        fix = f"the environment variable {name} is not set: set it, or give a default, {default}"
    elif "Recursive interpolation" in reason:
        fix = "the interpolation leads back to itself: give one of its keys a value"
    else:
        fix = f"the interpolation does not resolve: {reason}"
    # No key where OmegaConf resolved a value read apart from its config (--cfg hydra
    # --resolve: Hydra's run directory interpolates the job's keys, which it prints without).
    return UserError(str(err.full_key or "config"), given, fix)


@contextmanager
def user_errors_pass_hydra() -> Iterator[None]:
    """Inside a Hydra task function: lets a UserError reach the CLI as a UserErrorExit."""
    try:
        yield
    except Exception as err:
        # Hydra prints "Error executing job with overrides" above any other exception it is
        # handed: a user error must leave as the one message the CLI prints.
        user_error = user_error_in(err)
        if user_error is None:
            raise
        raise UserErrorExit(user_error) from err


def error_line(err: BaseException) -> str:
    """An error as status.json and a sweep's summary record it: a UserError (a DataError, a
    loss gone nan: Diverged) as the command line prints it, its key, value and fix; any other
    after its type's name."""
    return str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"


class UserErrorExit(SystemExit):
    """Carries a UserError past Hydra's job runner, which reports any Exception on its own."""

    def __init__(self, error: UserError) -> None:
        super().__init__(error.exit_code)
        self.error = error


def diverged(error: str) -> bool:
    """Whether a run's recorded error (status.json's) says its loss went nan or inf (Diverged's
    message, however an older runner prefixed it)."""
    return "the training loss is " in error and "lower the learning rate" in error


class Diverged(UserError):
    """The training loss became inf or nan: the run's directory (its metrics and log) is kept."""

    def __init__(self, lr: float, value: float, step: int) -> None:
        # The step the run failed at, which status.json records (the loop may have gone on a few
        # steps before it read the loss).
        self.step = step
        super().__init__(
            "optimizer.lr",
            lr,
            f"the training loss is {value} at step {step}; lower the learning rate (or raise "
            "optimizer.warmup_steps, keep clip_grad_norm set); the last checkpoint, if any, is "
            "from before it",
        )
