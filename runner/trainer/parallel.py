"""Where a training process runs and how its model is spread over the ranks: the rank, the
device, the precision of the dtype group, FSDP2 sharding, activation checkpointing, compilation,
and the votes the ranks take in each step (whether to stop, how many forward passes), on one
node over a gloo group of their own so that the host never waits for the GPU to read them."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from runner.models.activation_memory import keep_fewer_activations
from runner.models.backends import Backend
from runner.models.torchtune_boundary import set_activation_checkpointing

# The dtype group: (dtype of the trained parameters, gradients and optimizer state; compute dtype).
# bf16_mixed keeps fp32 master weights, which small AdamW updates do not round away.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_mixed": (torch.float32, torch.bfloat16),
}


@dataclass(frozen=True)
class Placement:
    """This process's rank among world_size, its device, the dtype group's two dtypes, and the
    gloo group the ranks vote over (largest_on_any_rank; None in a process alone, or with ranks
    on several nodes)."""

    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    compute_dtype: torch.dtype
    vote_group: dist.ProcessGroup | None = None

    @property
    def is_rank_zero(self) -> bool:
        """Whether this process writes the run directory (status, metrics, checkpoints)."""
        return self.rank == 0


def placement(device: str, precision: str, collective_timeout_s: int) -> Placement:
    """This process's place: compute.device (`cuda`: the local rank's GPU) and dtype.name; with
    several processes on one node, every rank makes the vote group here, at the same point (it
    is a collective), waiting as long as the default group (compute.collective_timeout_s)."""
    distributed = dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    here = torch.device(f"cuda:{local_rank}" if device == "cuda" else "cpu")
    if device == "cuda":
        torch.cuda.set_device(here)
    dtype, compute_dtype = PRECISIONS[precision]
    # Over NCCL, reading a vote waits for every kernel queued before it, and the GPU idles while
    # the host builds the next batch; over gloo it waits only for the other ranks' hosts. A CPU
    # run, whose default group is gloo already, makes one too (about 1 ms), so that it votes
    # as a GPU run does. Across nodes the votes stay on the default group: gloo binds the
    # address a node's hostname resolves to, which on many Linux installs is a loopback one
    # (/etc/hosts' 127.0.1.1) that other nodes cannot reach, where NCCL finds its own route.
    world = dist.get_world_size() if distributed else 1
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    timeout = timedelta(seconds=collective_timeout_s)
    votes = dist.new_group(backend="gloo", timeout=timeout) if distributed and one_node else None
    return Placement(
        rank=dist.get_rank() if distributed else 0,
        world_size=world,
        device=here,
        dtype=dtype,
        compute_dtype=compute_dtype,
        vote_group=votes,
    )


def prepare_model(
    model: torch.nn.Module,
    backend: Backend,
    place: Placement,
    *,
    activation_checkpointing: bool,
    compile: bool,
) -> torch.nn.Module:
    """Fewer activations kept for backward (runner.models.activation_memory), activation
    checkpointing, FSDP2 sharding over the ranks and compilation, as set."""
    keep_fewer_activations(model, place.device)
    if activation_checkpointing:
        set_activation_checkpointing(model, auto_wrap_policy=backend.layer_classes(model))
    if place.world_size > 1:
        policy = MixedPrecisionPolicy(param_dtype=place.compute_dtype, reduce_dtype=torch.float32)
        # fully_shard's default mesh is CUDA whenever CUDA is visible, which would move a
        # compute=cpu run's weights onto the GPU: the mesh is on the run's device.
        mesh = init_device_mesh(place.device.type, (place.world_size,))
        for layer in backend.layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    if compile:
        for layer in backend.layers(model):
            layer.compile()
    return model


def compile_counts() -> str:
    """torch._dynamo's own counts in this process so far: graph breaks, and graphs compiled
    (one more than needed for each recompile)."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    return f"{breaks} graph breaks, {counters['stats']['unique_graphs']} graphs compiled"


def peak_memory(place: Placement) -> str | None:
    """The device's peak memory allocated by torch so far (CUDA), or None on the CPU."""
    if place.device.type != "cuda":
        return None
    return f"{torch.cuda.max_memory_allocated(place.device) / 2**30:.2f} GiB"


def autocast(place: Placement) -> contextlib.AbstractContextManager[object]:
    """Mixed precision in one process: bf16 compute over the fp32 parameters (sharded over
    several processes, FSDP2's policy casts them instead)."""
    if place.compute_dtype == place.dtype or place.world_size > 1:
        return contextlib.nullcontext()
    return torch.autocast(place.device.type, dtype=place.compute_dtype)


def any_rank(flag: bool, place: Placement) -> bool:
    """Whether `flag` is set on any rank; every rank joins, so all agree at the same step."""
    return largest_on_any_rank(int(flag), place) > 0


def all_ranks_sum(count: torch.Tensor, host_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` (on the device) and `host_count` (on the host), each summed over the ranks in one
    all-reduce on the device; both unread. The host's count is filled in on the device (no copy,
    which would wait for the device)."""
    both = torch.stack([count.float(), torch.full((), float(host_count), device=count.device)])
    dist.all_reduce(both)
    return both[0], both[1]


def largest_on_any_rank(value: int, place: Placement) -> int:
    """The largest of the ranks' `value`s, every rank joining: on one node a CPU all-reduce over
    the vote group, which waits for the other ranks' hosts to reach it, never for this rank's
    GPU; across nodes an all-reduce on the run's device, whose read waits for it."""
    if place.world_size == 1:  # no collective in a process alone
        return value
    on_host = place.vote_group is not None
    votes = torch.tensor(value, device="cpu" if on_host else place.device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=place.vote_group)  # None: the default
    return int(votes.item())
