"""argparse for the commands that are not Hydra apps (push, repro, runs, logs, stop, resume): its
errors are UserErrors, `error: KEY=VALUE: FIX` like every other command's."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from runner.errors import UserError
from runner.paths import refuse_empty_path, user_path

# argparse's wording for a value its `type` refuses -> what to give instead.
TYPE_NAMES = {"int": "an integer", "float": "a number"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors raise a UserError naming the argument and value."""

    def error(self, message: str) -> NoReturn:
        raise argument_error(message, self.prog, self.format_usage())


def path_argument(name: str, fix: str) -> Callable[[str], Path]:
    """argparse's `type` of the path argument `name`: `~` expanded, an empty one refused."""

    def typed(given: str) -> Path:
        refuse_empty_path(name, given, fix)
        return user_path(given)

    return typed


def seconds_argument(name: str) -> Callable[[str], float]:
    """argparse's `type` of the seconds argument `name`: a number > 0, refused as typed (`0`,
    not argparse's float of it, `0.0`)."""

    def typed(given: str) -> float:
        try:
            seconds = float(given)
        except ValueError:
            seconds = math.nan
        if not seconds > 0:  # NaN too
            raise UserError(name, given, "give the seconds to wait, a number > 0")
        return seconds

    return typed


def _key(argument: str) -> str:
    """An argument as argparse names it ("-f/--follow", "RUN") -> its longest spelling."""
    return max(argument.split("/"), key=len)


def argument_error(message: str, prog: str, usage: str) -> UserError:
    """argparse's message -> a UserError naming the argument, its value and the fix."""
    see = " ".join(usage.split())  # "usage: runner logs [-h] [-f] RUN", on one line
    if m := re.fullmatch(r"argument (.+?): invalid (\w+) value: '(.*)'", message):
        wanted = TYPE_NAMES.get(m[2], f"a {m[2]}")
        return UserError(_key(m[1]), m[3], f"give {wanted}")
    if m := re.fullmatch(r"argument (.+?): invalid choice: '(.*)' \(choose from (.*)\)", message):
        return UserError(_key(m[1]), m[2], f"choose one of: {m[3]}")
    if m := re.fullmatch(r"argument (.+?): expected (.*)", message):
        return UserError(_key(m[1]), None, f"give it {m[2]} ({see})")
    if m := re.fullmatch(r"the following arguments are required: (.*)", message):
        missing = m[1].split(", ")
        return UserError(_key(missing[0]), None, f"missing: give {' and '.join(missing)} ({see})")
    if m := re.fullmatch(r"unrecognized arguments: (.*)", message):
        return UserError("argument", m[1], f"`{prog}` takes no such argument ({see})")
    return UserError("arguments", message, see)
