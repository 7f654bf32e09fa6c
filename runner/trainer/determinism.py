"""Deterministic mode (runtime.deterministic=true): one kernel path on every x86-64 machine.

The same per-step losses on any machine with AVX2, whatever its core count and whether it has
AVX-512, need the same kernels doing the same arithmetic in the same order:
- ATen's CPU kernels pinned to their AVX2 build (ATEN_CPU_CAPABILITY, read once, when torch is
  first used, so it must be in the training processes' environment before they start);
- one intra-op thread (a parallel reduction adds in an order that depends on the thread count);
- MKL's conditional numerical reproducibility (MKL_CBWR) and oneDNN capped at AVX2;
- torch's deterministic algorithms, and on CUDA the cuBLAS workspace that they require.
The launcher starts the training processes with `pinned_environment()`; each process checks with
`apply_in_process()` that it runs on that path and records what it used in the manifest.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

from runner.errors import UserError

# The pinned kernel path, as ATEN_CPU_CAPABILITY names it and as torch reports it.
CPU_CAPABILITY = "avx2"
REPORTED_CAPABILITY = "AVX2"
# What an AVX2 build of ATen executes: AVX2 itself and the FMA instructions it is compiled with.
REQUIRED_CPU_FLAGS = ("avx2", "fma")
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": CPU_CAPABILITY,
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is no such file."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return None
    match = re.search(r"^flags\s*:\s*(.*)$", path.read_text(), re.M)
    return set(match.group(1).split()) if match else None


def check_machine() -> None:
    """Refuses deterministic mode on a machine that cannot run the pinned AVX2 kernels."""
    machine = platform.machine().lower()
    why = None
    if machine not in ("x86_64", "amd64"):
        why = f"this machine is {machine}, not x86-64"
    else:
        flags = _cpu_flags()
        missing = [f for f in REQUIRED_CPU_FLAGS if flags is not None and f not in flags]
        if missing:
            why = f"this CPU lacks {', '.join(missing)}"
    if why:
        raise UserError(
            "runtime.deterministic",
            True,
            f"deterministic mode pins ATen's {REPORTED_CAPABILITY} kernels so that losses are "
            f"the same on every x86-64 machine, and {why}; run it on an x86-64 machine with "
            "AVX2, or set runtime.deterministic=false (the numbers may then differ between "
            "machines)",
        )


def pinned_environment() -> dict[str, str]:
    """The environment variables that pin the kernel path of the training processes."""
    return dict(PINNED_ENV)


def apply_in_process() -> dict[str, Any]:
    """Deterministic algorithms and one thread in this (training) process; what it runs with.

    Raises if the process was started without the pinned environment: numbers from another path
    must never pass for deterministic ones.
    """
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability != REPORTED_CAPABILITY:
        raise RuntimeError(
            f"deterministic mode needs ATen's {REPORTED_CAPABILITY} kernels, and this process "
            f"runs {capability} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')}); "
            "start it through `runner train`, which sets the environment before torch loads"
        )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", PINNED_ENV["CUBLAS_WORKSPACE_CONFIG"])
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    return kernel_settings()


def kernel_settings() -> dict[str, Any]:
    """The kernel path and threads this process computes with, for the manifest."""
    import torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "intra_op_threads": torch.get_num_threads(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
