"""Shared fixtures: reusable spawned worlds, and per-test cleanup of the parent process."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from world import World

_worlds: dict[int, World] = {}

# Files whose tests start interpreters of their own or compile (up to a minute each on 2 busy cores). They go first, so
# that under pytest-xdist they start early and the short tests fill in around them, instead of one of them starting last
# and running alone at the end.
SLOW_FIRST = (
    "test_ray_example.py",
    "test_multinode.py",
    "test_examples.py",
    "test_reshard_example.py",
    "test_sequence_parallel_compile.py",
    "test_readme.py",
    "test_bench.py",
    "test_compile_collectives.py",
    "test_sequence_parallel_ulysses.py",
    "test_launch.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the order within a file is kept


def _world(size: int) -> World:
    if size not in _worlds:
        _worlds[size] = World(size)
    return _worlds[size]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for w in _worlds.values():
        w.close()


@pytest.fixture(autouse=True, scope="module")
def _engine_processes_end_with_their_module() -> Iterator[None]:
    """After each module: the processes of a vLLM engine it started (children of this process, named ``VLLM::...``) that
    outlived their engine's shutdown are ended, bounded, so that the next module in this pytest worker starts clean."""
    yield
    try:
        import psutil
    except ImportError:  # no vLLM here either
        return
    left = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    _, alive = psutil.wait_procs(left, timeout=10)
    for p in alive:
        p.kill()  # ours: children of this process
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def world1() -> World:
    return _world(1)


@pytest.fixture
def world2() -> World:
    return _world(2)


@pytest.fixture
def world4() -> World:
    return _world(4)


@pytest.fixture
def world8() -> World:
    return _world(8)


@pytest.fixture
def world(request: pytest.FixtureRequest) -> World:
    """Indirectly parametrised by size: ``@pytest.mark.parametrize("world", [1, 2, 4, 8], indirect=True)``."""
    return _world(request.param)


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    from rlightning_comm import CommContext

    CommContext().destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
