"""The benchmarks under scripts/bench/ refuse a step count that leaves nothing timed (every step
a warm-up) with argparse's one line and exit 2, before they train anything or start a child."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"

CASES = [
    # (script, arguments, the line it prints)
    (
        "bench_train.py",
        ["--steps", "5", "--repeats", "1"],
        "--steps 5: at least 11, the first 10 are warm-up, not timed",
    ),
    ("bench_loader.py", ["--steps", "5"], "--steps 5: at least 6, the first 5 are warm-up"),
    (
        "bench_backends.py",
        ["--steps", "2", "--warmup", "2"],
        "--steps 2: at least 3, the first 2 (--warmup) are warm-up",
    ),
    ("bench_compile.py", ["--steps", "0"], "--steps 0: at least 1, the steps timed after"),
]


@pytest.mark.parametrize(("script", "arguments", "line"), CASES, ids=[c[0] for c in CASES])
def test_steps_all_warm_up_are_refused_in_one_line(
    script: str, arguments: list[str], line: str
) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"{script}: error: {line}" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
