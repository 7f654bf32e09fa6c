"""The fork server that runs the CLI for the CPU tests stays off the GPU (tests/cli_forks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_forks import ForkedCli
from tests.conftest import forks

GPU_TESTS = Path(__file__).with_name("test_gpu.py")


def test_the_fork_server_sees_no_gpu_and_has_no_cuda_context(forked_cli: ForkedCli) -> None:
    assert forked_cli.probe() == {"initialized": False, "visible_devices": ""}


class _Items:
    """A pytest plugin that keeps the items a collection found."""

    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


def test_gpu_marked_tests_run_the_cli_in_fresh_interpreters(request: pytest.FixtureRequest):
    collected = _Items()
    code = pytest.main(
        ["--collect-only", "-q", "-n0", "-p", "no:cacheprovider", str(GPU_TESTS)],
        plugins=[collected],
    )
    assert code == pytest.ExitCode.OK and len(collected.items) > 10
    for item in collected.items:
        assert item.get_closest_marker("gpu") is not None, item.nodeid
        assert not forks(item, ("train",), None), item.nodeid
    assert forks(request.node, ("train",), None)  # a CPU test's command does go through it
