"""profile: torch.profiler over a few training steps, written into the run directory.

`profile.enabled=true` profiles the steps profile.start_step to start_step + steps - 1 on rank 0
(the first steps compile, where compile=true, and warm the allocator: the default starts at 3)
and writes RUN_DIR/profile/:

- trace.json: the Chrome trace (ui.perfetto.dev or chrome://tracing opens it): each op on the
  host and, on CUDA, each kernel on the GPU;
- ops.txt: the ops that took longest (self time on the device: kernels on CUDA, ops on the CPU);
- summary.json: a step's milliseconds by kind (`KINDS`), the device's busy time and the wall
  time, so that two runs (scripts/gpu/gpu_report.py: runner and the bare loop) read side by side.

Profiling costs host time, so the profiled steps are slower than the others (and their wall
time runs high beside the kernels' where the host is what the GPU waits for); the steps around
them are not affected.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.autograd.profiler_util import EventList

log = logging.getLogger("runner.recipe")

# An op's or kernel's kind, by the first pattern its name matches (CUDA kernels: cuBLAS's and
# CUTLASS's matrix products, flash and flex attention's kernels, the fused AdamW and foreach
# kernels, the copy and cast kernels; CPU ops: aten's). Whatever matches none is "other"
# (inductor's fused elementwise kernels, norms, RoPE, indexing).
KINDS = (
    ("attention", r"flash|fmha|attention|flex|sdpa|cudnn"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|aten::(mm|addmm|bmm|_addmm_activation)$"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach|_fused_sgd|clip"),
    ("copy", r"memcpy|memset|copy_kernel|aten::copy_|aten::_to_copy"),
)


def kind_of(name: str) -> str:
    """The kind of an op or kernel named `name` (KINDS), else "other"."""
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def summarize(averages: EventList, *, on_cuda: bool, steps: int, wall_s: float) -> dict[str, Any]:
    """A profiled window's milliseconds a step, from its ops' averages (the profiler's
    key_averages): by kind, the sum of the kinds (`busy`: the device's kernels on CUDA, the
    ops' self time on the CPU) and the wall time."""
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
    for event in averages:
        if on_cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            micros = event.self_device_time_total
        else:
            micros = event.self_cpu_time_total
        by_kind[kind_of(event.key)] += micros / 1000 / steps
    return {
        "device": "cuda" if on_cuda else "cpu",
        "steps": steps,
        "ms_per_step": {kind: round(ms, 3) for kind, ms in by_kind.items()},
        "busy_ms": round(sum(by_kind.values()), 3),
        "wall_ms": round(wall_s * 1000 / steps, 3),
    }


def write_profile(
    out_dir: Path, prof: torch.profiler.profile, averages: EventList, summary: dict[str, Any]
) -> None:
    """trace.json, ops.txt (from the ops' averages) and summary.json in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out_dir / "trace.json"))
    sort_by = "self_device_time_total" if summary["device"] == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=sort_by, row_limit=40)  # type: ignore[no-untyped-call]
    (out_dir / "ops.txt").write_text(table + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Standard error closed to libkineto's lines as the profiler starts, stops and toggles
    ("USDT: ... profiler_start", at every KINETO_LOG_LEVEL): written from C++ straight to
    file descriptor 2, they would be the console's only lines that are not runner's."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs_compiled() -> int:
    """torch._dynamo's count of graphs compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StepProfiler:
    """Profiles steps `start` to `start + steps - 1` (the recipe's step numbers, from 1) and
    writes them into `out_dir`; on other ranks, or with `enabled` false, does nothing."""

    def __init__(
        self, *, enabled: bool, start: int, steps: int, device: torch.device, out_dir: Path
    ) -> None:
        self.enabled, self.start, self.last = enabled, start, start + steps - 1
        self.device, self.out_dir = device, out_dir
        self.prof: torch.profiler.profile | None = None
        self.started_at = 0.0
        self.graphs_before = 0

    def check_window(self, *, first_step: int, total_steps: int) -> None:
        """Warns when no profiled step is among this run's steps (first_step to total_steps)."""
        if self.enabled and (self.last < first_step or self.start > total_steps):
            log.warning(
                "profile: steps %d-%d are outside this run's steps %d-%d: nothing is profiled "
                "(set profile.start_step within them)",
                self.start,
                self.last,
                first_step,
                total_steps,
            )

    def before_step(self, step: int) -> None:
        """Step `step` is about to run: starts profiling at the window's first step."""
        if self.enabled and step == self.start:
            _synchronize(self.device)  # the steps before are not counted in the window
            self.prof = torch.profiler.profile(activities=_activities(self.device))
            with _kineto_quiet():
                self.prof.start()
            self.started_at = time.perf_counter()
            self.graphs_before = _graphs_compiled()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs between two steps (an evaluation, a checkpoint's save) left out of the
        window: its ops go uncollected and its time is not a step's (an evaluation inside the
        window read as a step five times as long)."""
        if self.prof is None:
            yield
            return
        _synchronize(self.device)
        paused_at = time.perf_counter()
        activities = _activities(self.device)
        with _kineto_quiet():  # "Toggling CPU activity with GPU activity on ...", on a CPU too
            self.prof.toggle_collection_dynamic(False, activities)
        try:
            yield
        finally:
            _synchronize(self.device)
            with _kineto_quiet():
                self.prof.toggle_collection_dynamic(True, activities)
            self.started_at += time.perf_counter() - paused_at

    def after_step(self, step: int) -> None:
        """Step `step` ran: at the window's last step, writes what was profiled (a run that
        stops inside the window writes it from `stop`)."""
        if self.prof is None or step < self.last:
            return
        self.stop(step)

    def stop(self, step: int) -> None:
        """Ends the window at `step` (its last, or the run's) and writes it."""
        if self.prof is None:
            return
        _synchronize(self.device)
        wall_s = time.perf_counter() - self.started_at
        with _kineto_quiet():
            self.prof.stop()
        # Averaged once (seconds over a large model's trace), for the summary and the table.
        averages = self.prof.key_averages()
        on_cuda, steps = self.device.type == "cuda", step - self.start + 1
        summary = summarize(averages, on_cuda=on_cuda, steps=steps, wall_s=wall_s)
        write_profile(self.out_dir, self.prof, averages, summary)
        self.prof = None
        compiled = _graphs_compiled() - self.graphs_before
        if compiled:
            # A batch of a new width (DPO's padded pairs) compiled again inside the window,
            # which then measured the compiler (26 s a step, "other" 94%).
            log.warning(
                "profile: %d graph(s) compiled during steps %d-%d, so the window measures "
                "compiling more than training; set profile.start_step past the compiles",
                compiled,
                self.start,
                step,
            )
        log.info(
            "profiled steps %d-%d: %.1f ms a step, %.1f ms of it in %s (%s)",
            self.start,
            step,
            summary["wall_ms"],
            summary["busy_ms"],
            "kernels" if summary["device"] == "cuda" else "ops",
            self.out_dir,
        )
