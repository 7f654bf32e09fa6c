"""gpu_report.py's table: each stage's outcome (`Stage`) made into rows of tokens/s, MFU and
detail, read from the stages' logs and run directories (gpu_logs.py), with ours/bare for each
training mode and the training arms' profiles side by side."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from gpu_logs import (
    deploy_rows,
    engine_rates,
    profile_rows,
    pytest_summary,
    pytest_tests,
    runner_rate,
    runner_totals,
)

MODES = ("eager", "compiled")
# Dense bf16 tensor-core peaks from NVIDIA's data sheets (without sparsity), matched against
# torch.cuda.get_device_name: the first entry whose words all appear in the name (so GH200
# comes before H200, L40S and L40 before L4).
PEAK_BF16 = [
    (("H100", "PCIe"), "H100 PCIe", 756e12),
    (("H100", "NVL"), "H100 NVL", 835e12),
    (("H100",), "H100 SXM", 989e12),
    (("GH200",), "GH200", 989e12),
    (("H200",), "H200", 989e12),
    (("B200",), "B200", 2250e12),
    (("A100",), "A100", 312e12),
    (("L40S",), "L40S", 362e12),
    (("A10G",), "A10G", 70e12),
    (("L40",), "L40", 181e12),
    (("L4",), "L4", 121e12),
]


@dataclass
class Stage:
    """One stage's outcome: `status` is ok, `failed (exit N)` or `overran its N s`."""

    name: str
    status: str
    seconds: float
    log: Path


def slug(name: str) -> str:
    """A stage's name as a file name: `train runner eager` -> train_runner_eager."""
    return re.sub(r"\W+", "_", name)


def peak_bf16(device_name: str) -> tuple[str, float] | None:
    """The GPU's label and dense bf16 FLOP/s, or None for a GPU not in PEAK_BF16."""
    for words, label, flops in PEAK_BF16:
        if all(word in device_name for word in words):
            return label, flops
    return None


def param_count(dims: dict) -> int:
    """Parameters of a Llama 3.2 model with these builder dimensions (embeddings, attention,
    MLP, RMSNorms; the output projection only when untied)."""
    embed, vocab, layers = dims["embed_dim"], dims["vocab_size"], dims["num_layers"]
    head_dim = embed // dims["num_heads"]
    attention = 2 * embed * embed + 2 * embed * head_dim * dims["num_kv_heads"]
    mlp = 3 * embed * dims["intermediate_dim"]
    per_layer = attention + mlp + 2 * embed
    output = 0 if dims["tie_word_embeddings"] else vocab * embed
    return vocab * embed + layers * per_layer + embed + output


def mfu(params: int, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: 6 FLOPs per parameter per trained token (forward and backward
    matmuls; attention's score FLOPs not counted) over the GPU's peak."""
    return 6 * params * tokens_per_s / peak_flops


def engine_concurrency(stage: Stage) -> str:
    """The clients profile_engine.py ran with, from its command line (its log's first line)."""
    found = re.search(r"--concurrency (\d+)", stage.log.read_text().split("\n", 1)[0])
    return found[1] if found else "?"


def train_figures(
    stage: Stage, out: Path, warmup: int
) -> tuple[float, list[float], dict[str, float]] | None:
    """A train arm's tokens/s, its windows' tokens/s, and what else it gave of its peak memory
    (GiB) and graph breaks; or None where the arm gave no tokens/s."""
    try:
        if "runner" in stage.name:
            run = out / slug(stage.name)
            rate, windows = runner_rate((run / "metrics.jsonl").read_text(), warmup)
            log = run / "train.log"
            return rate, windows, runner_totals(log.read_text() if log.is_file() else "")
        result = json.loads(stage.log.read_text().strip().splitlines()[-1])
        totals = {key: float(result[key]) for key in ("peak_gib", "graph_breaks") if key in result}
        return result["tokens_per_s"], result["window_tokens_per_s"], totals
    except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError):
        return None


def train_detail(per_window: list[float], totals: dict[str, float], compiled: bool) -> str:
    """A train row's detail: the windows' spread, peak memory, and graph breaks if compiled."""
    detail = [f"windows {min(per_window):,.0f}-{max(per_window):,.0f}"]
    if "peak_gib" in totals:
        detail.append(f"peak {totals['peak_gib']:.2f} GiB")
    if compiled and "graph_breaks" in totals:
        detail.append(f"{totals['graph_breaks']:.0f} graph breaks")
    return ", ".join(detail)


def last_words(stage: Stage, width: int = 120) -> str:
    """For a stage that did not end ok, its log's last line (a failure's exception, or where
    an overrun stopped), cut to `width` characters, after a colon; else ''."""
    if stage.status == "ok":
        return ""
    lines = [line.strip() for line in stage.log.read_text(errors="replace").splitlines()]
    said = [line for line in lines if line]
    return f": {said[-1][:width]}" if said else ""


# The stages whose figures are rows under their own (serving_rows), and what each one's log
# lacks when it gave none.
SERVING_STAGES = {
    "deploy": "no table in its log",
    "profile decode": "no step times in its log",
    "profile engine": "no repeat in its log",
}


def serving_rows(stage: Stage) -> list[tuple[str, float, str]]:
    """A serving stage's rows under its own: what, tokens/s, detail."""
    log = stage.log.read_text()
    if stage.name == "deploy":
        return deploy_figures(deploy_rows(log))
    if stage.name == "profile decode":
        return [
            (
                f"decode step, {rows} rows{' compiled' if compiled else ''} (no HTTP)",
                rate,
                f"{ms:.2f} ms a step",
            )
            for rows, ms, rate, compiled in profile_rows(log)
        ]
    repeats = sorted(engine_rates(log))
    if not repeats:
        return []
    spread = f"median of {len(repeats)}, {repeats[0]:,.0f}-{repeats[-1]:,.0f}"
    middle = repeats[(len(repeats) - 1) // 2]
    # Each part timed to the device's completion: on CUDA the engine no longer runs a step
    # ahead of the GPU there, so deploy's `engine alone` is the one to set beside HTTP.
    what = f"engine by part, no HTTP, c={engine_concurrency(stage)}"
    return [(what, middle, spread + "; each part waits for the GPU")]


def deploy_figures(rows: list[dict]) -> list[tuple[str, float, str]]:
    """Deploy's rows: what, tokens/s, and latency (or, from a run stopped before its table,
    the repeats that landed), with each server's share of the engine alone's tokens/s."""
    engine = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["side"] == "engine alone"}
    figures = []
    for row in rows:
        if row["repeats"] is None:
            detail = "p50 {p50_ms:,.0f} ms, p99 {p99_ms:,.0f} ms".format(**row)
        else:
            landed = row["repeats"]
            detail = f"stopped before its table: median of the {landed} repeat(s) that landed"
        alone = engine.get(row["concurrency"])
        if row["side"].startswith("runner deploy") and alone:
            detail += f", http/engine {row['tokens_per_s'] / alone:.2f}"
        figures.append((f"{row['side']} c={row['concurrency']}", row["tokens_per_s"], detail))
    return figures


def table(stages: list[Stage], out: Path, warmup: int, params: int, peak: float | None) -> str:
    """The report: one row per training arm, per deploy side and concurrency, and pytest's
    summary; then ours/bare for each training mode."""
    lines = [f"{'stage':28} {'status':20} {'s':>5} {'tokens/s':>10} {'MFU':>6}  detail"]
    rates: dict[str, float] = {}
    for stage in stages:
        head = f"{stage.name:28} {stage.status:20} {stage.seconds:>5.0f}"
        if stage.status == "skipped":
            lines.append(f"{head} {'':>10} {'':>6}  {stage.log.read_text().strip()}")
        elif stage.name.startswith("train"):
            found = train_figures(stage, out, warmup)
            if found is None:
                why = "no timed window in its log" + last_words(stage)
                lines.append(f"{head} {'-':>10} {'-':>6}  {why}")
                continue
            rate, per_window, totals = found
            rates[stage.name] = rate
            share = f"{mfu(params, rate, peak):.1%}" if peak else ""
            detail = train_detail(per_window, totals, stage.name.endswith("compiled"))
            lines.append(f"{head} {rate:>10,.0f} {share:>6}  {detail}")
        elif stage.name in SERVING_STAGES:
            figures = serving_rows(stage)
            why = "" if figures else SERVING_STAGES[stage.name] + last_words(stage)
            lines.append(f"{head} {'':>10} {'':>6}  {why}")
            lines += [
                f"  {what:53} {rate:>10,.0f} {'':>6}  {detail}" for what, rate, detail in figures
            ]
        else:
            text = stage.log.read_text()
            summary = pytest_summary(text) or "no summary in its log" + last_words(stage)
            lines.append(f"{head} {'':>10} {'':>6}  {summary}")
            for test, outcome, seconds in pytest_tests(text):
                took = "" if seconds is None else f", {seconds:.1f} s"
                lines.append(f"  {test:53} {'':>10} {'':>6}  {outcome}{took}")
    for arm, ours in rates.items():  # each runner arm beside the bare loop of its mode
        if not arm.startswith("train runner "):
            continue
        variant = arm.removeprefix("train runner ")  # eager, compiled, eager varlen
        bare = rates.get(f"train bare {variant.split()[0]}")
        if bare:
            lines.append(f"ours/bare {variant}: {ours / bare:.2f}")
    arms = [stage.name for stage in stages if stage.name.startswith("train")]
    return "\n".join(lines + profile_table(arms, out))


def profile_table(arms: list[str], out: Path) -> list[str]:
    """The train arms' profiled steps side by side (runner.trainer.profiling's summary.json,
    in each arm's directory under `out`): a step's milliseconds by kind, the kinds' sum (busy)
    and the wall time; none where no arm was profiled."""
    summaries = {}
    for arm in arms:
        path = out / slug(arm) / "profile" / "summary.json"
        if path.is_file():
            summaries[arm.removeprefix("train ")] = json.loads(path.read_text())
    if not summaries:
        return []
    columns = {
        arm: {**summary["ms_per_step"], "busy": summary["busy_ms"], "wall": summary["wall_ms"]}
        for arm, summary in summaries.items()
    }
    first = next(iter(summaries.values()))
    what = "kernels on the GPU" if first["device"] == "cuda" else "ops' self time on the CPU"
    lines = [f"profile, ms a step ({first['steps']} warm-up steps; by kind, {what}):"]
    width = max(17, *(len(arm) + 2 for arm in columns))  # "runner eager varlen" is 19 wide
    lines.append(f"  {'kind':10}" + "".join(f"{arm:>{width}}" for arm in columns))
    for kind in next(iter(columns.values())):
        values = "".join(f"{column.get(kind, 0.0):>{width}.1f}" for column in columns.values())
        lines.append(f"  {kind:10}{values}")
    return lines
