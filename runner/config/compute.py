"""The compute and dtype groups: the device, the processes and nodes, how they meet, and the
precision.

The node layout of a multi-node job may come from the platform it runs on
(runner.config.platforms); what the recipe records is concrete: a device, counts, an endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from runner.config.fields import integer, override_key
from runner.config.platforms import check_platform, refuse_torchrun_worker
from runner.errors import NULL, UserError

# typing's Optional: the form OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP045


@dataclass
class Compute:
    """The compute group, as the user types it."""

    device: str = "auto"
    # An int, or auto; several keys come from the platform a multi-node job runs on.
    nproc_per_node: Any = 1
    nnodes: Any = 1
    max_restarts: int = integer(0, 0)
    collective_timeout_s: int = integer(600, 1)
    platform: Optional[str] = None
    detected: Any = None
    node_rank: Any = None
    master_addr: Any = None
    master_port: Any = None
    rdzv_backend: Optional[str] = None
    rdzv_timeout_s: Optional[int] = integer(None, 1)


@dataclass
class ComputeRecipe:
    """The recipe's compute section: concrete counts, and where the processes meet."""

    device: str = MISSING
    nproc_per_node: int = 1
    nnodes: int = 1
    # Where the node layout was read from (none, or a platform's name) and how processes meet.
    platform: str = "none"
    # One machine: the agent hosts the rendezvous on a free local port.
    rdzv_endpoint: str = "localhost:0"
    rdzv_timeout_s: Optional[int] = None
    max_restarts: int = 0
    collective_timeout_s: int = 600


@dataclass
class Dtype:
    """The dtype group: parameter, optimizer-state and compute precision."""

    name: str = "auto"


DTYPES = ("fp32", "bf16_mixed", "bf16")


def resolve_device(
    compute: DictConfig, overrides: Sequence[str] = (), gpus_here: bool = True
) -> tuple[str, int]:
    """(device, processes per node) for the compute group, checked against this machine's GPUs
    where `gpus_here` (runner estimate prices a GPU layout from any machine: gpus_here=False);
    `overrides` (the command line) tell which one chose the device, for a message."""
    import torch

    has_cuda = torch.cuda.is_available()
    device = compute.device
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    if device not in ("cpu", "cuda"):
        raise UserError("compute.device", device, "give cpu, cuda or auto")
    if device == "cuda" and not has_cuda and gpus_here:
        key, given = _device_given(overrides, device)
        raise UserError(
            key,
            given,
            "no CUDA GPU is visible on this machine; use compute=cpu "
            "(or leave compute unset to pick what is here)",
        )
    nproc = compute.nproc_per_node
    if nproc == "auto":
        nproc = torch.cuda.device_count() if device == "cuda" else 1
        if nproc == 0:  # a GPU layout priced on a machine without one
            raise UserError(
                "compute.nproc_per_node",
                "auto",
                "auto counts the GPUs visible here, and none is; give the number of GPUs per "
                "node to price (e.g. compute.nproc_per_node=8)",
            )
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        typed: object = NULL if nproc is None else nproc
        raise UserError("compute.nproc_per_node", typed, "give an integer >= 1 or auto")
    if device == "cuda" and gpus_here and nproc > torch.cuda.device_count():
        raise UserError(
            "compute.nproc_per_node",
            nproc,
            f"only {torch.cuda.device_count()} GPU(s) are visible; give at most that many",
        )
    return str(device), nproc


def resolve_dtype(name: str, device: str) -> str:
    """auto: mixed bf16 (fp32 master weights) on a GPU with bf16, else fp32. A GPU layout priced
    on a machine that shows none (runner estimate) is taken to have bf16, as GPUs from Ampere on
    do."""
    import torch

    if name == "auto":
        if device != "cuda":
            return "fp32"
        has_bf16 = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        return "bf16_mixed" if has_bf16 else "fp32"
    if name not in DTYPES:
        raise UserError("dtype", name, f"choose one of: {', '.join(DTYPES)}")
    return name


def _device_given(overrides: Sequence[str], device: str) -> tuple[str, str]:
    """(key, value) of the last override that chose the device (compute=multi_gpu,
    compute.device=cuda); compute.device and its value where none did (an experiment file)."""
    for override in reversed(overrides):
        if (key := override_key(override)) in ("compute", "compute.device"):
            return key, override.partition("=")[2]
    return "compute.device", device


def checked_int(value: Any, key: str, minimum: int) -> int:
    """A compute key the platform may fill (so typed Any in Compute), as an integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(key, value, f"give an integer >= {minimum}")
    return value


def resolve_compute(
    compute: DictConfig, overrides: Sequence[str] = (), gpus_here: bool = True
) -> ComputeRecipe:
    """The recipe's compute section: device and counts checked against this machine (its GPUs
    only where `gpus_here`), and how the processes meet (the same on every node)."""
    device, nproc_per_node = resolve_device(compute, overrides, gpus_here)
    nnodes = checked_int(compute.nnodes, "compute.nnodes", 1)
    refuse_torchrun_worker()
    resolved = ComputeRecipe(
        device=device,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        # Typed and bounded by Compute.
        max_restarts=compute.max_restarts,
        collective_timeout_s=compute.collective_timeout_s,
    )
    if compute.platform is not None and compute.detected is None:
        # +compute.platform=slurm on compute=cpu: only multi_node reads one (and says what it
        # detected, always).
        raise UserError(
            "compute.platform",
            compute.platform,
            "a single-machine compute option reads no platform; give compute=multi_node "
            f"compute.platform={compute.platform}",
        )
    if compute.platform is None:  # a single-machine compute option
        if nnodes != 1:
            raise UserError(
                "compute.nnodes",
                nnodes,
                "several nodes need compute=multi_node (it reads the rendezvous from the "
                "platform or compute.master_addr)",
            )
        return resolved
    check_platform(compute.platform)  # multi_node's resolver checked its own
    resolved.platform = compute.platform
    resolved.rdzv_timeout_s = compute.rdzv_timeout_s
    resolved.rdzv_endpoint = _rendezvous(compute, nnodes)
    return resolved


def _rendezvous(compute: DictConfig, nnodes: int) -> str:
    """Where the nodes of a multi-node option meet: node 0's address and port."""
    if compute.rdzv_backend != "c10d":
        raise UserError("compute.rdzv_backend", compute.rdzv_backend, "only c10d is supported")
    if compute.node_rank is not None:
        node_rank = checked_int(compute.node_rank, "compute.node_rank", 0)
        if node_rank >= nnodes:
            raise UserError(
                "compute.node_rank", node_rank, f"give 0 to {nnodes - 1} (compute.nnodes={nnodes})"
            )
    if nnodes == 1:  # one node hosts the rendezvous itself, as on one machine
        return ComputeRecipe.rdzv_endpoint
    if compute.master_addr is None:
        raise UserError(
            "compute.master_addr",
            None,
            f"compute.nnodes={nnodes} and no platform gives the rendezvous address; give "
            "compute.master_addr=HOST of node 0 (the same on every node)",
        )
    port = checked_int(compute.master_port, "compute.master_port", 1)
    if port > 65535:  # torch's rendezvous refused it with a traceback, the run left created
        raise UserError("compute.master_port", port, "give a port from 1 to 65535")
    host = str(compute.master_addr)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
