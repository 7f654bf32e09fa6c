"""The Python work of `runner deploy`'s engine per token, which a noisy host does not move.

    python scripts/serving/engine_calls.py --checkpoint DIR [--source TREE ...] [--prompts 16]

Wall time on a shared two-core machine moves by a third between identical runs, so a change of
a few percent in the engine cannot be timed there. What its thread does can be counted: this
loads the checkpoint as `runner deploy` does (CPU, fp32, one torch thread) and answers
`--prompts` prompts (bench_deploy.py's) one after another, greedy, 64 new tokens at most, with
cProfile on the engine's thread, and prints the Python function calls it made per generated
token and its process CPU time. Each `--source` (a runner source tree, e.g. an older commit
unpacked with `git archive REV | tar -x -C DIR`) runs in a fresh interpreter with that tree
first on sys.path, interleaved with this one over `--repeats`; the calls are the same in every
repeat, the CPU time is not (its median and range are shown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
HERE = SCRIPTS.parents[1]

# Runs in the child interpreter, with the measured tree first on sys.path; it uses only what
# every tree since the engine's first version has: load_checkpoint, the engine, SamplingRequest.
CHILD = """
import asyncio, cProfile, json, pstats, sys, time
from pathlib import Path
tree, checkpoint, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, tree)
import torch
torch.set_num_threads(1)
from runner.deploy import engine as engine_module
from runner.deploy.generation import SamplingRequest
from runner.deploy.loading import load_checkpoint
sys.path.insert(0, sys.argv[4])
from deploy_clients import prompts

profile = cProfile.Profile()
loop = engine_module.TransformersEngine._loop
def profiled_loop(self, *args):  # the loop's arguments differ between trees
    profile.enable()
    try:
        loop(self, *args)
    finally:
        profile.disable()
engine_module.TransformersEngine._loop = profiled_loop
loaded = load_checkpoint(checkpoint, device="cpu", dtype="fp32", max_model_len=None)
engine = engine_module.TransformersEngine(loaded, max_batch_size=64, max_queue=256)
prompt_ids = [loaded.tokenizer(text)["input_ids"] for text in prompts(count)]

async def answer_all():
    tokens = 0
    for ids in prompt_ids:
        request = SamplingRequest(ids, 64, 0.0, 1.0, None, [], 1, False)
        async for event in engine.submit([request]).events():
            if event.finish_reason is not None:
                tokens += event.completion_tokens
    return tokens

asyncio.run(answer_all())  # warm-up, not counted
profile.clear()
cpu = time.process_time()
tokens = asyncio.run(answer_all())
cpu = time.process_time() - cpu
engine.close()
calls = pstats.Stats(profile).total_calls
print(json.dumps({"tokens": tokens, "calls": calls, "cpu_s": cpu}))
"""


def measure(tree: Path, checkpoint: Path, count: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(checkpoint), str(count), str(SCRIPTS)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"{tree}: the measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint dir")
    parser.add_argument("--source", type=Path, action="append", default=[], help="another tree")
    parser.add_argument("--prompts", type=int, default=16, help="prompts answered, one at a time")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each tree")
    args = parser.parse_args()
    trees = [HERE, *(source.resolve() for source in args.source)]
    runs: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.repeats):
        for tree in trees:
            runs[tree].append(measure(tree, args.checkpoint.resolve(), args.prompts))
    print(f"{args.checkpoint}: {args.prompts} prompts one at a time, greedy, CPU, fp32, 1 thread")
    print(f"{'tree':40} {'tokens':>7} {'calls/token':>12} {'CPU s':>7} {'range':>12}")
    for tree, results in runs.items():
        tokens = results[0]["tokens"]
        per_token = [r["calls"] / r["tokens"] for r in results]
        cpu = [r["cpu_s"] for r in results]
        label = "this tree" if tree == HERE else str(tree)
        print(
            f"{label:40} {tokens:>7.0f} {statistics.median(per_token):>12.0f} "
            f"{statistics.median(cpu):>7.2f} {min(cpu):>5.2f}-{max(cpu):<6.2f}"
        )


if __name__ == "__main__":
    main()
