"""How long the light paths take, each in a fresh interpreter, beside the interpreter alone.

    python scripts/bench/startup_times.py            # 7 runs of each, interleaved
    python scripts/bench/startup_times.py --runs 15

Prints the median and range (min-max) of each command's wall time and which heavy packages it
loaded (none is the point: `--help` and `import runner.api` must not pay for torch), and what a
training process started as a fresh interpreter pays before its first step, and what each of
the libraries it needs adds to torch's import. The
baselines: `python -c pass` (the interpreter's own start) and `import torch` (what a light
path would cost if it loaded torch). The runs are interleaved so that a slow moment of the
machine falls on every command alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "torchtune", "transformers", "datasets")
REPORT = f"import sys, json; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
COMMANDS = {
    "python -c pass (baseline)": "pass",
    "import torch (baseline)": "import torch",
    "runner --help": "from runner.cli import main; main(['--help'])",
    "runner validate --help": "from runner.cli import main; main(['validate', '--help'])",
    "runner train --help": "from runner.cli import main; main(['train', '--help'])",
    "import runner.api": "import runner.api",
    # What a training process started as a fresh interpreter imports before it trains; a worker
    # forked from `runner train` (a CPU run's) has it already (runner/job/launch.py).
    "a fresh worker's imports": "import runner.recipes.finetune",
    # What each library the recipe needs adds to torch (printed as the difference of medians):
    # torchtune imports torchao and through it torch._dynamo; datasets (torchtune.datasets needs
    # it); transformers, for the tokenizer.
    "import torch, torchtune": "import torch, torchtune",
    "import torch, datasets": "import torch, datasets",
    "import torch, transformers": "import torch, transformers",
}
ON_TORCH = ("import torch, torchtune", "import torch, datasets", "import torch, transformers")


def _time(statement: str) -> tuple[float, list[str]]:
    """Wall seconds of a fresh interpreter running `statement`, and the heavy modules it loaded."""
    code = "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    code += f"    try:\n        {statement}\n    except SystemExit:\n        pass\n{REPORT}"
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give 1 or more")
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    loaded: dict[str, list[str]] = {}
    for _ in range(args.runs):
        for name, statement in COMMANDS.items():
            seconds, loaded[name] = _time(statement)
            times[name].append(seconds)
    print(f"{'command':<28} {'median s':>9} {'range s':>13}  heavy packages loaded")
    for name, samples in times.items():
        spread = f"{min(samples):.2f}-{max(samples):.2f}"
        print(
            f"{name:<28} {statistics.median(samples):>9.2f} {spread:>13}  "
            f"{', '.join(loaded[name]) or '-'}"
        )
    torch_alone = statistics.median(times["import torch (baseline)"])
    for name in ON_TORCH:
        added = statistics.median(times[name]) - torch_alone
        print(f"{name.split(', ')[1]} adds {added:.2f} s to import torch (difference of medians)")


if __name__ == "__main__":
    main()
