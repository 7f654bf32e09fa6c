"""The one exception type for user errors, caught once at the CLI."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: printed as one message, exit code 2, no traceback.

    The message names the key, the bad value and the fix.
    """

    exit_code = 2

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")


class UserErrorExit(SystemExit):
    """Carries a UserError past Hydra's job runner, which reports any Exception on its own."""

    def __init__(self, error: UserError) -> None:
        super().__init__(error.exit_code)
        self.error = error
