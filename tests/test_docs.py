"""docs/getting-started.md runs as written: its code blocks, in order, in a fresh directory.

The page's ```bash blocks are the commands a reader types and its ```python blocks what they
paste into Python; ```text blocks show what a command printed. The page becomes one bash script
(`set -euo pipefail`, so a command that fails fails the test): bash blocks as they are, python
blocks run by `python -` in the same shell, so variables chain (`export RUN=...` after the first
run names its run directory for the commands after it). Every `runner ...` line goes through the
real CLI, the `runner` of this environment. Setup lines are not run (SETUP below says which and
why): the test runs in the environment it was started in, and the suite's own command is CI's.

The whole page trains the default (about 2 minutes on two cores) and more, so the test is marked
`docs`: the default `pytest` leaves it out, `pytest -m docs -n 0 tests/test_docs.py` runs it, as
.ci/run does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"
# Lines of the page that are not run, each with why.
SETUP = {
    "ruff check . && pytest": "sets up an environment and runs the whole suite: CI's own test "
    "command (.ci/run), which this test is part of",
    "python3.11 -m venv": "creates a virtual environment and installs runner into it: the test "
    "runs in the environment it was started in",
    "pip install": "installs packages: the test runs in the environment it was started in",
}
FENCE = re.compile(r"^```(\w*)\s*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
# A printed summary line, `label: value`: each one a ```text block shows must be printed.
LABEL = re.compile(r"^([a-z][a-z -]*[a-z]):\s", re.MULTILINE)
# The page's deploy example serves on runner deploy's default port.
DEPLOY_PORT = 8000


def blocks(text: str) -> list[tuple[str, str]]:
    """The page's fenced code blocks, in order: (language, body)."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def script(page: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """The page as one bash script, the lines left out with why, and the runner lines it runs."""
    lines = ["set -euo pipefail"]
    skipped: list[tuple[str, str]] = []
    runner_lines: list[str] = []
    for language, body in blocks(page):
        if language == "bash":
            for line in body.splitlines():
                reason = next((why for start, why in SETUP.items() if start in line), None)
                if reason is not None:
                    skipped.append((line, reason))
                    continue
                if line.lstrip().startswith("runner "):
                    runner_lines.append(line.strip())
                lines.append(line)
        elif language == "python":
            lines += ["python - <<'PYTHON_BLOCK'", body.rstrip("\n"), "PYTHON_BLOCK"]
        elif language != "text":
            raise AssertionError(f"a ```{language} block: the page's blocks are bash, python, text")
    return "\n".join(lines) + "\n", skipped, runner_lines


def test_the_page_has_commands_to_run_and_only_setup_lines_are_left_out() -> None:
    """Cheap (no training): the page parses into a script, and what it leaves out is setup."""
    _, skipped, runner_lines = script(PAGE.read_text())
    for line, reason in skipped:
        print(f"not run: {line}\n    why: {reason}")
    assert {"runner train", "runner deploy", "runner validate", "runner estimate"} <= {
        " ".join(line.split()[:2]) for line in runner_lines
    }


def test_the_estimate_the_page_shows_is_what_it_prints_with_nothing_downloaded(runner_cli) -> None:
    """Cheap (no training): the page's LoRA estimate of the 1B model, with nothing downloaded,
    shows the lines estimate prints, the same ones not estimated and bounded (`at least`)."""
    text = PAGE.read_text()
    (shown,) = [b for lang, b in blocks(text) if lang == "text" and b.startswith("model ")]
    assert "runner estimate model=llama3_2_1b method=lora\n" in text
    result = runner_cli("estimate", "model=llama3_2_1b", "method=lora")
    assert result.returncode == 0, result.stderr[-2000:]
    printed = {line[:15]: line for line in result.stdout.splitlines()}
    assert list(printed) == [line[:15] for line in shown.splitlines()]
    for line in shown.splitlines():
        for words in ("not estimated", "at least"):
            assert (words in line) == (words in printed[line[:15]]), line
    # What needs the tokenizer names its source and the command that fetches it, as shown.
    (activations,) = [line for line in shown.splitlines() if line.startswith("activations")]
    assert printed[activations[:15]] == activations


def test_the_pages_held_out_share_evaluates_its_own_data(runner_cli, tmp_path: Path) -> None:
    """Cheap (4 steps): the held-out share the page offers for its 8-record my_data.jsonl,
    added to the page's own command, trains and evaluates; one that holds out no record is
    refused, quoting the share as typed."""
    text = PAGE.read_text()
    (page,) = [b for lang, b in blocks(text) if lang == "bash" and "my_data.jsonl <<" in b]
    records, _, command = page.partition("<<'EOF'\n")[2].partition("EOF\n")
    (tmp_path / "my_data.jsonl").write_text(records)
    train = shlex.split(command.replace("\\\n", " "))
    assert train[:2] == ["runner", "train"] and len(records.splitlines()) == 8
    (held_out,) = re.findall(r"`(dataset\.validation\.held_out=[^`]+)`", text)
    result = runner_cli(*train[1:], held_out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "eval loss:" in result.stdout and "status:        completed at step 4" in result.stdout
    outputs = tmp_path / "refused"
    result = runner_cli(
        *train[1:], "dataset.validation.held_out=5%", f"runtime.output_root={outputs}"
    )
    assert result.returncode == 2
    assert (
        "error: dataset.validation.held_out='5%': holds out 0 of the split's 8 records"
        in result.stderr
    )
    assert not outputs.exists()


@pytest.mark.docs
def test_every_command_of_getting_started_runs(tmp_path: Path) -> None:
    text = PAGE.read_text()
    body, skipped, runner_lines = script(text)
    for line, reason in skipped:
        print(f"not run: {line}\n    why: {reason}")
    with socket.socket() as probe:
        # The page's server takes deploy's default port; another server there would answer it.
        assert probe.connect_ex(("127.0.0.1", DEPLOY_PORT)) != 0, f"port {DEPLOY_PORT} is in use"
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # this environment's `runner` and `python`
    home = tmp_path / "hf_home"
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HF_HUB_OFFLINE="1", HF_HOME=str(home))
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "page.sh").write_text(body)
    # A session of its own: whatever the page leaves running (its server, where a command after
    # it failed) ends with the test, and nothing else does.
    page = subprocess.Popen(
        ["bash", str(tmp_path / "page.sh")],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = page.communicate(timeout=1800)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(page.pid, signal.SIGKILL)
        page.wait()
    ran = "\n".join(f"  {line}" for line in runner_lines)
    assert page.returncode == 0, f"exit {page.returncode}; runner lines:\n{ran}\n{out[-6000:]}"
    # What the page says a command prints, it printed: each `label:` of a ```text block.
    shown = {
        m.group(1) for lang, block in blocks(text) if lang == "text" for m in LABEL.finditer(block)
    }
    missing = sorted(label for label in shown if f"{label}:" not in out)
    assert not missing, f"the page shows {missing}, not printed:\n{out[-6000:]}"
