"""The private torch details in ``rlightning_comm._compat``: each test fails loudly when a torch release changes one."""

from __future__ import annotations

import io
import pickle
import pickletools

import pytest
import torch

from rlightning_comm import _compat


def _globals_named(payload: bytes) -> set[tuple[str, str]]:
    """The (module, name) globals a pickle names (protocol 2+: GLOBAL, or STACK_GLOBAL after two string pushes)."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(io.BytesIO(payload)):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
    return found


def test_tensor_pickle_names_exactly_the_globals_safe_mode_resolves():
    # What broadcast_object_list sends for a tensor (pickle.dumps, as torch's own sender does).
    named = _globals_named(pickle.dumps(torch.arange(6.0).view(2, 3)[:, 1]))
    rebuild, load = _compat.TENSOR_PICKLE_GLOBALS
    assert rebuild in named and load in named, (
        f"torch pickles a tensor with {sorted(named)}; _compat.TENSOR_PICKLE_GLOBALS is out of date"
    )
    assert named <= {rebuild, load, ("collections", "OrderedDict"), ("torch", "Size")}, sorted(named)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # what torch.load hands the safe unpickler
def test_rebuild_tensor_matches_torch_on_a_strided_view():
    base = torch.arange(12.0)
    storage = base.storage()
    view = _compat.rebuild_tensor(storage, 1, (2, 3), (4, 2))
    assert torch.equal(view, base.as_strided((2, 3), (4, 2), 1))
    assert view.data_ptr() == base.data_ptr() + 4  # a view of the same memory, not a copy


def _mixed_init_task(rank, size, url):
    """Rank 0 lets torch initialise from the URL; rank 1 goes through the library's own store: they must meet."""
    from datetime import timedelta

    import torch.distributed as dist

    from rlightning_comm import rendezvous

    if rank == 0:
        dist.init_process_group("gloo", init_method=url, world_size=size, rank=rank, timeout=timedelta(seconds=20))
    else:
        rendezvous.init_process_group("gloo", url, size, rank, timedelta(seconds=20))
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist()


def test_default_pg_store_prefix_interoperates_with_torch(world2):
    # If torch changes the prefix it puts on the store it makes from a URL, the two ranks never meet: a timeout here.
    assert world2.run(_mixed_init_task, timeout=60) == [[3.0, 3.0], [3.0, 3.0]]


def _adopted_store_task(rank, size, url):
    from datetime import timedelta

    import torch.distributed as dist

    from rlightning_comm import rendezvous

    dist.init_process_group("gloo", init_method=url, world_size=size, rank=rank, timeout=timedelta(seconds=20))
    store = rendezvous.world_store()  # a world the library did not make: torch's default store, through _compat
    store.set("compat/key", "value")
    return _compat.default_store().get("compat/key").decode()


def test_default_store_of_a_world_torch_made(world1):
    assert world1.run(_adopted_store_task, timeout=60) == ["value"]


def test_flat_collective_shims_resolve_to_torch_functions():
    import torch.distributed as dist

    assert _compat.all_gather_single in (getattr(dist, "all_gather_single", None), dist.all_gather_into_tensor)
    assert _compat.reduce_scatter_single in (getattr(dist, "reduce_scatter_single", None), dist.reduce_scatter_tensor)


def test_importing_the_library_does_not_import_dynamo():
    import subprocess
    import sys

    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, rlightning_comm; print('torch._dynamo' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert loaded.stdout.strip() == "False", loaded.stdout + loaded.stderr


def test_join_world_split_matches_the_split_torch_runs_on_non_members(monkeypatch):
    import inspect

    import torch.distributed as dist

    c10d = dist.distributed_c10d
    # torch still makes every non-member of a new group split a device-bound world's communicator, whatever the group's
    # backend; if this changes, the members' split in join_world_split would be one too many.
    helper = inspect.getsource(c10d._new_process_group_helper)
    assert "perform_nocolor_split" in helper and "bound_device_id" in helper
    assert callable(c10d._get_split_source) and callable(c10d._get_default_group)

    class World:
        bound_device_id = None

    monkeypatch.setattr(c10d, "_get_default_group", lambda: World)
    splits = []

    class Source:
        def perform_nocolor_split(self, device):
            splits.append(device)

    monkeypatch.setattr(c10d, "_get_split_source", lambda world: Source())
    _compat.join_world_split()
    assert splits == []  # an unbound world: torch splits nothing, nor do we
    World.bound_device_id = torch.device("cuda", 1)
    _compat.join_world_split()
    assert splits == [torch.device("cuda", 1)]


def test_coalescing_is_the_dict_torchs_coalescing_manager_fills(tmp_path):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    assert _compat.COALESCING is dist.distributed_c10d._world.pg_coalesce_state
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", world_size=1, rank=0)
    group = dist.group.WORLD
    assert group not in _compat.COALESCING
    with _coalescing_manager(group):
        assert group in _compat.COALESCING  # the test every communicator call makes
        dist.all_reduce(torch.ones(2))
        assert len(_compat.COALESCING[group]) == 1  # torch records its all_reduce for the manager
    assert group not in _compat.COALESCING
