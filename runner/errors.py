"""The one exception type for user errors, caught once at the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A mistake the user can fix: printed as one message, exit code 2, no traceback.

    The message names the key, the bad value and the fix: `key='value': fix` (a bool as `true`
    or `false`, as typed), or `key: fix` where the value is None (nothing typed: an argument
    left out, a key left null), which is no value a user gave.
    """

    exit_code = 2

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        if value is None:
            given = ""
        elif isinstance(value, bool):
            given = f"={str(value).lower()}"  # as YAML and the command line spell it
        else:
            given = f"={value!r}"
        super().__init__(f"{key}{given}: {fix}")


def user_error_in(err: BaseException) -> UserError | None:
    """The UserError that `err` is or was raised from (OmegaConf wraps one raised inside an
    interpolation's resolver in an error of its own); None where there is none."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, UserError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


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


class UserErrorExit(SystemExit):
    """Carries a UserError past Hydra's job runner, which reports any Exception on its own."""

    def __init__(self, error: UserError) -> None:
        super().__init__(error.exit_code)
        self.error = error


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
