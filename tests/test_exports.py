"""The public names: exactly what the package promises, importable from the top level."""

from __future__ import annotations

import inspect

import rlightning_comm
from rlightning_comm import collective

EXPECTED = {
    "CommContext",
    "CommError",
    "CommMismatchError",
    "CommMode",
    "CommTimeoutError",
    "Communicator",
    "GlooCommunicator",
    "ModeLayout",
    "ModeNotBoundError",
    "NcclCommunicator",
    "ObjectRefusedError",
    "ParallelConfig",
    "ParallelMode",
    "PeerLostError",
    "StateDictTransfer",
    "TensorSlice",
    "WeightSyncReport",
    "WorkHandle",
    "broadcast_state_dict",
    "collective",
    "describe_layout",
    "format_layout",
    "initialize_distributed_env",
    "register_communicator",
    "reshard_state_dict",
    "run",  # rlightning_comm.launch.run
    # sequence parallelism
    "UlyssesAttention",
    "all_gather_from_sequence_parallel_region",
    "all_to_all",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "sequence_parallel",
    "sequence_split_sizes",
    "ulysses_attention",
}

SEED_SIGNATURES = {
    "all_gather": ["output_tensor", "input_tensor", "comm_mode", "async_op"],
    "all_reduce": ["tensor", "comm_mode", "op", "async_op"],
    "all_reduce_dict": ["dictionary", "comm_mode", "op", "dtype"],
    "broadcast": ["tensor", "comm_mode", "src", "async_op"],
    "broadcast_object_list": ["object_list", "comm_mode", "src"],
    "gather": ["tensor", "comm_mode", "gather_list", "dst", "async_op"],
    "scatter": ["tensor", "comm_mode", "scatter_list", "src", "async_op"],
}


# The seed's CommContext methods and their parameters (comm_context.py), so calls by keyword keep working.
CONTEXT_SEED_SIGNATURES = {
    "init_distributed_env": ["world_size", "rank", "backend", "dist_url", "timeout"],
    "init_group": ["ranks", "mode", "backend", "use_cpu"],
    **{name: ["comm_mode"] for name in ("get_group", "get_world_size", "get_local_rank", "get_ranks_in_group")},
    **{
        name: []
        for name in (
            "get_global_rank",
            "get_in_node_rank",
            "get_local_world_size",
            "get_intra_node_process_group",
            "get_inter_node_process_group",
            "is_main_rank",
            "is_initialized",
            "destroy",
        )
    },
}


def test_all_is_sorted_and_exactly_the_public_api():
    assert rlightning_comm.__all__ == sorted(rlightning_comm.__all__)
    assert set(rlightning_comm.__all__) == EXPECTED
    for name in rlightning_comm.__all__:
        assert getattr(rlightning_comm, name) is not None


def test_collective_keeps_the_seed_signatures():
    for name, params in SEED_SIGNATURES.items():
        assert list(inspect.signature(getattr(collective, name)).parameters)[: len(params)] == params, name


def test_context_keeps_the_seed_signatures():
    for name, params in CONTEXT_SEED_SIGNATURES.items():
        got = list(inspect.signature(getattr(rlightning_comm.CommContext, name)).parameters)[1:]
        assert got[: len(params)] == params and (params or not got), name
    params = inspect.signature(rlightning_comm.initialize_distributed_env).parameters
    assert list(params)[:5] == ["rank", "world_size", "backend", "dist_url", "timeout"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[5:])  # options beyond the seed's


def test_the_launcher_is_exported_with_its_signature():
    from rlightning_comm import launch

    assert rlightning_comm.run is launch.run
    params = inspect.signature(rlightning_comm.run).parameters
    assert list(params) == ["fn", "nproc", "args", "backend", "timeout", "bounded_wait"]
    assert (
        params["nproc"].default,
        params["backend"].default,
        params["timeout"].default,
        params["bounded_wait"].default,
    ) == (4, "gloo", 1800, False)


# Module paths users import or the docs name; each must keep importing after the package moves.
MODULE_PATHS = [
    "rlightning_comm.collective",
    "rlightning_comm.sequence_parallel",
    "rlightning_comm.context",
    "rlightning_comm.weights",
    "rlightning_comm.debug",
    "rlightning_comm.stats",
    "rlightning_comm.bench",
    "rlightning_comm.connect",
    "rlightning_comm.communicators",
    "rlightning_comm.communicators.base",
    "rlightning_comm.communicators.gloo",
    "rlightning_comm.communicators.nccl",
    "rlightning_comm.communicators.registry",
    "rlightning_comm.errors",
    "rlightning_comm.failures",
    "rlightning_comm.launch",
    "rlightning_comm.layout",
    "rlightning_comm.modes",
    "rlightning_comm.config",
    "rlightning_comm.topology",
    "rlightning_comm.rendezvous",
    "rlightning_comm.bandwidth",
]


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module or an attribute of one; a module of the package that imports an extra absent
    here (vLLM, for the backend) counts when its file exists."""
    import importlib
    import importlib.util

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):  # it exists, and imports an absent extra
                return cut == len(parts) and importlib.util.find_spec(name) is not None
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_documented_module_path_imports():
    import importlib

    for path in MODULE_PATHS:
        importlib.import_module(path)
    assert rlightning_comm.context.CommContext is rlightning_comm.CommContext
    assert rlightning_comm.weights.broadcast_state_dict is rlightning_comm.broadcast_state_dict


def test_every_dotted_name_in_the_docs_and_docstrings_resolves():
    """``rlightning_comm.x.y`` in README.md, docs/ or a docstring of the package names something that exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    texts = [
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "rlightning_comm").rglob("*.py")),
    ]
    dotted = re.compile(r"(?<![\w/.])rlightning_comm(?:\.[A-Za-z_]\w*)+")
    broken = set()
    for path in texts:
        for name in set(dotted.findall(path.read_text())):
            name = name.rstrip(".")
            if not _resolves(name):
                broken.add(f"{path.relative_to(root)}: {name}")
    assert not broken, sorted(broken)
