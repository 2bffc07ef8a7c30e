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
    assert rebuild in named and load in named, f"torch pickles a tensor with {sorted(named)}; _compat.TENSOR_PICKLE_GLOBALS is out of date"
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
        [sys.executable, "-c", "import sys, rlightning_comm; print('torch._dynamo' in sys.modules)"], capture_output=True, text=True, timeout=120, check=True
    )
    assert loaded.stdout.strip() == "False", loaded.stdout + loaded.stderr
