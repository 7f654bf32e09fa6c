"""The hub token by reference, never by value: env:NAME, file:PATH, or null (the login of
`hf auth login`), read only when a download or a push asks for it: never into a config, a run
directory or a log."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runner.errors import HIDDEN, UserError
from runner.paths import user_path

# The token reference whose variable is huggingface_hub's own: unset, the hub's login is used.
HF_TOKEN_REF = "env:HF_TOKEN"


@dataclass(frozen=True)
class TokenRef:
    """Where the hub token is, never the token: env:NAME, file:PATH, or null (hub login), as
    given under `key`."""

    ref: str | None
    key: str = "runtime.hf_token"

    @classmethod
    def parse(cls, value: Any, key: str = "runtime.hf_token") -> TokenRef:
        """A token reference checked to be one; a UserError naming `key` if not."""
        if value is None:
            return cls(None, key)
        kind, _, where = str(value).partition(":")
        if kind in ("env", "file") and not where.strip():
            # env: or file: with nothing after (file:$TOKEN_FILE of an unset variable): a
            # reference, shown as given, to nothing.
            place, holder = ("NAME", "variable") if kind == "env" else ("PATH", "file")
            raise UserError(
                key,
                value,
                f"an empty reference: give {kind}:{place}, the {holder} that holds the token (or "
                "null for the login of `hf auth login`)",
            )
        if kind not in ("env", "file"):
            raise UserError(
                key,
                HIDDEN,
                "give a reference to the token, env:NAME or file:PATH (or null for the login of "
                "`hf auth login`), never the token itself",
            )
        return cls(str(value), key)

    def read(self) -> str | bool | None:
        """The token, as huggingface_hub takes one. None (its own: HF_TOKEN, else the login of
        `hf auth login`) for null and for env:HF_TOKEN unset; False (send none) where another
        reference points at nothing: another account's token is never sent in its place."""
        if self.ref is None:
            return None
        kind, _, where = self.ref.partition(":")
        if kind == "env":
            token = os.environ.get(where) or None
        else:
            path = user_path(where)
            token = (path.read_text().strip() or None) if path.is_file() else None
        return False if token is None and self.ref != HF_TOKEN_REF else token

    def state(self) -> str:
        """How the token stands, in words, for an error message (never its value)."""
        token = self.read()
        if token is None:
            from huggingface_hub import get_token

            if get_token():  # what huggingface_hub sent in its place: HF_TOKEN's, the login's
                given = f"{self.key}={self.ref or 'null'}"
                return f"the token of the login of `hf auth login` ({given}) has no access to it"
        if self.ref is None:
            return f"no token reference was given ({self.key}=null)"
        kind, _, where = self.ref.partition(":")
        if isinstance(token, str):
            return f"the token from {self.key}={self.ref} has no access to it"
        if kind == "env":
            return f"no token was given ({self.key}={self.ref}, and {where} is not set)"
        return f"no token was given ({self.key}={self.ref}, and {where} is missing or empty)"
