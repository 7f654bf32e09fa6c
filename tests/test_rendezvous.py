"""The nodes' rendezvous (runner.job.rendezvous) in one process, on a real c10d store: the
message of a rendezvous that times out names the node that did not come back, among three.

The loopback tests of tests/test_distributed.py and test_distributed_failures.py run it with real
nodes.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import asdict
from datetime import UTC, datetime, timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from runner.job.rendezvous import IdentifiedRendezvous, NodeIdentity, NodesDisagree, NodesMissing

RECIPE = {"max_steps": 5, "optimizer": {"lr": 0.001, "fused": None}, "model": {"name": "tiny"}}
NODES = [NodeIdentity(rank, f"host-{rank}", "/shared/run", RECIPE) for rank in range(3)]


class TorchHandler:
    """Stands in for torch's c10d handler: one rendezvous that completes, then a timeout."""

    def __init__(self, round_store: dist.Store) -> None:
        self.rounds = [RendezvousInfo(round_store, 0, 3, None)]

    def next_rendezvous(self) -> RendezvousInfo:
        if not self.rounds:
            raise RendezvousTimeoutError
        return self.rounds.pop()


def as_json(identity: NodeIdentity) -> str:
    return json.dumps(asdict(identity))


def handler(store: dist.Store, identity: NodeIdentity, others: list[NodeIdentity]):
    round_store = dist.PrefixStore("round-1", store)
    for rank, other in enumerate(others, start=1):
        round_store.set(f"runner/identity/{rank}", as_json(other))
        round_store.set(f"runner/introduced/{rank}", "1")
    return IdentifiedRendezvous(
        TorchHandler(round_store),  # type: ignore[arg-type]
        store=store,
        backend=C10dRendezvousBackend(store, "run"),
        identity=identity,
        nnodes=3,
        agent_addr="host-0",
        dead_after=timedelta(seconds=15),
    )


@pytest.fixture
def store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))


def test_a_timeout_after_a_loss_names_the_node_that_did_not_come_back(store) -> None:
    rendezvous = handler(store, NODES[0], NODES[1:])
    rendezvous.next_rendezvous()  # the group meets
    # Node 2 came back and waits (its agent is alive in the rendezvous state); node 1 did not.
    waiting = _NodeDesc("host-2", 4242, 0)
    store.set("runner/agent/host-2/4242", as_json(NODES[2]))
    state = _RendezvousState()
    state.wait_list.add(waiting)
    state.last_heartbeats[waiting] = datetime.now(UTC)
    state.last_heartbeats[_NodeDesc("host-1", 1111, 0)] = datetime.now(UTC) - timedelta(minutes=1)
    C10dRendezvousBackend(store, "run").set_state(pickle.dumps(state))
    with pytest.raises(NodesMissing) as missing:
        rendezvous.next_rendezvous()
    assert str(missing.value) == "node 1 (host-1) left the group and did not come back"
    assert missing.value.after_loss
    assert store.get(f"runner/agent/host-0/{os.getpid()}")  # this node said who it is


@pytest.mark.parametrize(
    ("run_dir", "recipe", "named"),
    [
        (
            "/shared/other",
            RECIPE,
            "node 1 (host-1) trains run directory /shared/other, node 0 (host-0) (this node) "
            "run directory /shared/run",
        ),
        # The values, not two config hashes: the lines to mend are found without a diff.
        (
            "/shared/run",
            RECIPE | {"max_steps": 6, "optimizer": {"lr": 0.001, "fused": True}, "seed": 7},
            "node 1 (host-1) trains max_steps=6, optimizer.fused=true, seed=7, "
            "node 0 (host-0) (this node) max_steps=5, optimizer.fused=null, seed=(not set)",
        ),
    ],
    ids=["run directory", "recipe keys"],
)
def test_nodes_that_train_different_runs_name_both_values(
    store, run_dir: str, recipe: dict, named: str
) -> None:
    other = NodeIdentity(1, "host-1", run_dir, recipe)
    rendezvous = handler(store, NODES[0], [other, NODES[2]])
    with pytest.raises(NodesDisagree) as disagree:
        rendezvous.next_rendezvous()
    assert str(disagree.value) == named
