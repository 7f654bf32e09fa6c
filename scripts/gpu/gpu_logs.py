"""What gpu_report.py reads from its stages' outputs: runner's metrics, pytest's summary, and
the lines that profile_decode.py, profile_engine.py and bench_deploy.py print (their formats are
tested against those scripts' own output in tests/test_gpu_report.py)."""

from __future__ import annotations

import itertools
import json
import re
import statistics

from gpu_bare import overall_rate


def runner_rate(metrics: str, warmup: int) -> tuple[float, list[float]]:
    """Tokens/s of `runner train` over the steps after `warmup`, from its metrics.jsonl (logged
    every `warmup` steps), and each logged window's tokens/s."""
    logged = [json.loads(line) for line in metrics.splitlines() if line.strip()]
    logged = [r for r in logged if "tokens_per_s" in r and r["step"] > warmup]
    steps = [warmup] + [r["step"] for r in logged]
    sizes = [b - a for a, b in itertools.pairwise(steps)]
    rates = [r["tokens_per_s"] for r in logged]
    return overall_rate(sizes, rates), rates


# runner train's train.log at its last step (recipes/finetune.py, _log_totals).
COMPILED = re.compile(r"compiled: (\d+) graph breaks, (\d+) graphs compiled")
PEAK_MEMORY = re.compile(r"peak device memory: ([\d.]+) GiB")


def runner_totals(train_log: str) -> dict[str, float]:
    """From `runner train`'s train.log: its graph breaks (compile=true) and peak device memory
    in GiB (CUDA), those it logged."""
    totals = {}
    if found := COMPILED.search(train_log):
        totals["graph_breaks"] = float(found[1])
    if found := PEAK_MEMORY.search(train_log):
        totals["peak_gib"] = float(found[1])
    return totals


def pytest_summary(log: str) -> str:
    """pytest's last summary line (`12 passed, 3 skipped in 80.1s`), or '' if it never ended."""
    lines = [line.strip("= ") for line in log.splitlines()]
    found = [line for line in lines if re.search(r"\d+ (passed|failed|error)", line)]
    return found[-1] if found else ""


# pytest -v's line per test (under xdist: `[gw0] [ 25%] PASSED path::test`; without:
# `path::test PASSED [ 25%]`), and --durations=0's line per phase of each test.
OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
OUTCOME_LINE = re.compile(
    rf"^(?:\[gw\d+\] \[\s*\d+%\] (?P<a>{OUTCOMES}) (?P<x>\S+::\S+)"
    rf"|(?P<y>\S+::\S+) (?P<b>{OUTCOMES})(?:\s|$))"
)
DURATION_LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+::\S+)\s*$")


def pytest_tests(log: str) -> list[tuple[str, str, float | None]]:
    """Each test pytest -v --durations=0 reported, in the order it ended: its name (the test
    function and parameters), its outcome, and its seconds (setup, call and teardown; None
    where --durations left it out)."""
    outcomes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for line in log.splitlines():
        if found := OUTCOME_LINE.match(line.strip()):
            test = found["x"] or found["y"]
            # A test that passes and then errors in teardown keeps its worst outcome.
            if outcomes.get(test) not in ("FAILED", "ERROR"):
                outcomes[test] = (found["a"] or found["b"]).lower()
        elif found := DURATION_LINE.match(line.strip()):
            seconds[found[2]] = seconds.get(found[2], 0.0) + float(found[1])
    return [
        (test.split("::", 1)[1], outcome, seconds.get(test)) for test, outcome in outcomes.items()
    ]


# profile_decode.py's line per batch size, eager or compiled: rows, milliseconds a step, tokens/s.
PROFILE_ROW = re.compile(r"^rows (\d+)( compiled)?: ([\d.]+) ms a step, ([\d,]+) tokens/s")


def profile_rows(log: str) -> list[tuple[int, float, float, bool]]:
    """profile_decode.py's (rows, ms a step, tokens/s, compiled), one per batch size and step
    it profiled."""
    found = [PROFILE_ROW.match(line) for line in log.splitlines()]
    return [
        (int(m[1]), float(m[3]), float(m[4].replace(",", "")), m[2] is not None)
        for m in found
        if m is not None
    ]


# profile_engine.py's line per repeat: its output tokens/s.
ENGINE_REPEAT = re.compile(r"^repeat \d+: ([\d,]+) tokens/s")


def engine_rates(log: str) -> list[float]:
    """profile_engine.py's tokens/s, one per repeat."""
    found = [ENGINE_REPEAT.match(line) for line in log.splitlines()]
    return [float(m[1].replace(",", "")) for m in found if m is not None]


# bench_deploy.py's report() rows: side, concurrency, tokens/s, its range over repeats, p50, p90
# and p99 ms, then ratios.
DEPLOY_ROW = re.compile(
    r"^(runner deploy.*?|transformers generate|engine alone)\s+(\d+)\s+(\d+)\s+\d+-\d+\s+(\d+)"
    r"\s+\d+\s+(\d+)\s"
)
# Its line per measurement, printed as each lands (before the table, which a run stopped short
# of its end never prints).
DEPLOY_PROGRESS = re.compile(
    r"^  (runner deploy.*?|transformers generate|engine alone), concurrency (\d+): (\d+) tokens/s"
)


def deploy_rows(log: str) -> list[dict]:
    """bench_deploy.py's table: one dict per row (side, concurrency, tokens/s, p50 and p99 ms).
    Without a table (the run was stopped), the medians of its progress lines, with the number
    of repeats each had (`repeats`) and no latencies (None)."""
    rows = []
    for match in map(DEPLOY_ROW.match, log.splitlines()):
        if match:
            label, concurrency, rate, p50, p99 = match.groups()
            rows.append(
                {"side": _side(label), "concurrency": int(concurrency), "tokens_per_s": float(rate)}
                | {"p50_ms": float(p50), "p99_ms": float(p99), "repeats": None}
            )
    if rows:
        return rows
    landed: dict[tuple[str, int], list[float]] = {}
    for match in map(DEPLOY_PROGRESS.match, log.splitlines()):
        if match:
            label, concurrency, rate = match.groups()
            landed.setdefault((_side(label), int(concurrency)), []).append(float(rate))
    return [
        {"side": side, "concurrency": concurrency, "tokens_per_s": statistics.median(rates)}
        | {"p50_ms": None, "p99_ms": None, "repeats": len(rates)}
        for (side, concurrency), rates in landed.items()
    ]


def _side(label: str) -> str:
    return "hf generate" if label == "transformers generate" else label
