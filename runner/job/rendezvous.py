"""The nodes' c10d rendezvous, with what runner adds to torch's: who each node is.

torch.distributed's dynamic rendezvous over a c10d store (the `c10d` backend of torchrun) does
the meeting; this handler wraps it, registered with torch's rendezvous registry as
`runner-c10d`, and adds three things the elastic agent does not know about a run:

- each node says who it is (node rank, host, run directory, recipe) in the round's store, and
  the nodes compare: nodes that met but train different runs or recipes stop at once, each
  with a message naming both values of each key that differs;
- it remembers who was in the group, so that a rendezvous that times out names the node that
  did not come back (a lost node the others waited for);
- the store that holds the rendezvous lives with node rank 0 whenever that rank is known
  (`is_host`), never with whichever node happened to start first, so that losing another node
  never takes the store with it;
- an agent stopped by a signal checks in at the agents' exit barrier (check_out), which torch
  skips on that path, so that the other nodes' agents, whose workers stopped with it, do not
  wait there for it (300 s).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
    create_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.utils.store import _barrier_nonblocking

BACKEND = "runner-c10d"
# The rendezvous parameter that carries this node's identity (JSON) to the handler.
IDENTITY_PARAMETER = "runner_identity"
_KEEP_ALIVE_S, _KEEP_ALIVE_ATTEMPTS = 5, 3  # torch's defaults (dynamic_rendezvous.create_handler)
# The key of the elastic agents' exit barrier (torch.distributed.elastic.agent.server.api).
_EXIT_BARRIER = "torchelastic/agent/terminal_state"


@dataclass(frozen=True)
class NodeIdentity:
    """What a node of a run says about itself in the rendezvous."""

    node_rank: int | None
    host: str
    run_dir: str
    # The recipe as its config hash reads it (runner.rundir.manifest.hashed_config): redacted,
    # without the keys that name the run rather than what it computes.
    config: dict[str, Any]

    def describe(self) -> str:
        rank = "node ?" if self.node_rank is None else f"node {self.node_rank}"
        return f"{rank} ({self.host})"


class NodesDisagree(RendezvousError):
    """Nodes that met in the rendezvous train different run directories or configs."""


class NodesMissing(RendezvousTimeoutError):
    """The rendezvous timed out; the message names the nodes that did not come."""

    def __init__(self, message: str, *, after_loss: bool) -> None:
        super().__init__(message)
        # Whether the group had met before (a node was lost), or never met.
        self.after_loss = after_loss


def register() -> None:
    """Makes `runner-c10d` a rendezvous backend of torch's registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    # torch's c10d handler reads only the parameters it knows, so ours can ride along.
    identity = NodeIdentity(**json.loads(params.get(IDENTITY_PARAMETER)))
    backend, store = create_backend(params)
    keep_alive = params.get_as_int("keep_alive_interval", _KEEP_ALIVE_S) or _KEEP_ALIVE_S
    attempts = params.get_as_int("keep_alive_max_attempt", _KEEP_ALIVE_ATTEMPTS)
    global _agent_handler
    _agent_handler = IdentifiedRendezvous(
        create_handler(store, backend, params),
        store=store,
        backend=backend,
        identity=identity,
        nnodes=params.max_nodes,
        # The address in torch's node descriptor (dynamic_rendezvous._NodeDescGenerator).
        agent_addr=params.local_addr or socket.getfqdn(),
        dead_after=timedelta(seconds=keep_alive * (attempts or _KEEP_ALIVE_ATTEMPTS)),
    )
    return _agent_handler


# The handler of this process's elastic agent (a launcher runs one), for check_out.
_agent_handler: IdentifiedRendezvous | None = None


def check_out() -> None:
    """Checks this node in at the agents' exit barrier after its agent stopped on a signal."""
    if _agent_handler is not None:
        _agent_handler.check_out()


class IdentifiedRendezvous(RendezvousHandler):
    """torch's c10d rendezvous handler, plus each node's identity (see the module's doc)."""

    def __init__(
        self,
        inner: RendezvousHandler,
        *,
        store: Store,
        backend: C10dRendezvousBackend,
        identity: NodeIdentity,
        nnodes: int,
        agent_addr: str,
        dead_after: timedelta,
    ) -> None:
        self._inner, self._store, self._backend = inner, store, backend
        self._identity, self._nnodes, self._dead_after = identity, nnodes, dead_after
        # This agent as torch's rendezvous state names it (dynamic_rendezvous._NodeDesc).
        self._agent_key = _agent_key(agent_addr, os.getpid())
        # Who was in the group the last time it met: {group rank: identity}, and its store.
        self._members: dict[int, NodeIdentity] = {}
        self._round_store: Store | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            # Which waiting agent is which node, for the message of a rendezvous that times out.
            self._store.set(self._agent_key, json.dumps(asdict(self._identity)))
            info = self._inner.next_rendezvous()
            self._members, self._round_store = self._introduce(info), info.store
        except RendezvousTimeoutError as err:
            raise NodesMissing(self._missing(), after_loss=bool(self._members)) from err
        except (ValueError, RuntimeError, TimeoutError) as err:
            # As torch's c10d backend reports a store it cannot reach.
            raise RendezvousConnectionError(f"the rendezvous store is gone: {err}") from err
        return info

    def check_out(self) -> None:
        """What torch's exit barrier does for an agent, without waiting for the others."""
        if self._round_store is not None:
            _barrier_nonblocking(self._round_store, len(self._members), _EXIT_BARRIER)

    def _introduce(self, info: RendezvousInfo) -> dict[int, NodeIdentity]:
        """Each node's identity, read from the round's store; NodesDisagree if any differs."""
        store, world = info.store, info.world_size
        store.set(f"runner/identity/{info.rank}", json.dumps(asdict(self._identity)))
        members = {
            rank: NodeIdentity(**json.loads(store.get(f"runner/identity/{rank}")))
            for rank in range(world)
        }
        # Every node has read every identity before any leaves (the store's host among them).
        store.set(f"runner/introduced/{info.rank}", "1")
        store.wait([f"runner/introduced/{rank}" for rank in range(world)])
        for other in members.values():
            theirs, mine = _differences(other, self._identity)
            if theirs:
                raise NodesDisagree(
                    f"{other.describe()} trains {theirs}, {self._identity.describe()} "
                    f"(this node) {mine}"
                )
        return members

    def _missing(self) -> str:
        """The nodes the rendezvous waited for in vain, as a phrase."""
        present = {self._identity.node_rank}
        try:
            present |= self._waiting_node_ranks()
        except Exception:  # noqa: BLE001 - only the message loses its detail
            return f"fewer than {self._nnodes} nodes joined"
        missing = [rank for rank in range(self._nnodes) if rank not in present]
        if None in present or not missing:
            return f"{len(present)} of {self._nnodes} nodes joined"
        last_seen = {m.node_rank: m for m in self._members.values()}
        named = ", ".join(
            last_seen[rank].describe() if rank in last_seen else f"node {rank}" for rank in missing
        )
        if self._members:
            return f"{named} left the group and did not come back"
        return f"{named} did not join"

    def _waiting_node_ranks(self) -> set[int | None]:
        """The node ranks of the agents alive in the rendezvous now (its state, as torch's
        dynamic rendezvous keeps it in the store, and the agents' keys set above)."""
        found = self._backend.get_state()
        if found is None:
            return set()
        # Written by torch's rendezvous, which reads it the same way.
        state = pickle.loads(found[0])
        alive_since = datetime.now(UTC) - self._dead_after
        ranks: set[int | None] = set()
        for node, heartbeat in state.last_heartbeats.items():
            key = _agent_key(node.addr, node.pid)
            if heartbeat >= alive_since and self._store.check([key]):
                ranks.add(json.loads(self._store.get(key))["node_rank"])
        return ranks

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _agent_key(addr: str, pid: int) -> str:
    return f"runner/agent/{addr}/{pid}"


def _differences(theirs: NodeIdentity, mine: NodeIdentity, most: int = 6) -> tuple[str, str]:
    """What two nodes train differently, as each one's side of the message: the run directory,
    then each recipe key whose value differs (`max_steps=6`); two empty strings if nothing."""
    sides: tuple[list[str], list[str]] = ([], [])
    if theirs.run_dir != mine.run_dir:
        sides[0].append(f"run directory {theirs.run_dir}")
        sides[1].append(f"run directory {mine.run_dir}")
    their_keys, my_keys = _leaves(theirs.config), _leaves(mine.config)
    differ = [
        k
        for k in sorted(their_keys.keys() | my_keys.keys())
        if their_keys.get(k, _NONE) != my_keys.get(k, _NONE)
    ]
    for side, keys in zip(sides, (their_keys, my_keys), strict=True):
        side += [f"{k}={_shown(keys.get(k, _NONE))}" for k in differ[:most]]
        if len(differ) > most:
            side.append(f"and {len(differ) - most} more keys")
    return ", ".join(sides[0]), ", ".join(sides[1])


_NONE = "(not set)"


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested recipe as {dotted key: value}."""
    if isinstance(tree, dict) and tree:
        return {
            k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()
        }
    return {prefix.removesuffix("."): tree}


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def parameters(identity: NodeIdentity) -> dict[str, Any]:
    """The rendezvous configs (LaunchConfig.rdzv_configs) that carry `identity`, and make node
    rank 0, where known, the host of the rendezvous store."""
    configs: dict[str, Any] = {IDENTITY_PARAMETER: json.dumps(asdict(identity))}
    if identity.node_rank is not None:
        configs["is_host"] = identity.node_rank == 0
    return configs
