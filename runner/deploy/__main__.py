"""`python -m runner.deploy [overrides]`: the same as `runner deploy`, for scripts and tests."""

from __future__ import annotations

import sys

from runner.deploy import main
from runner.errors import UserError

try:
    main()
except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(error.exit_code)
