"""CommContext in one process: configuration errors, environment, lifecycle, lookups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from world import free_port

from rlightning_comm import (
    CommContext,
    CommError,
    CommMode,
    GlooCommunicator,
    ModeNotBoundError,
    ParallelMode,
    collective,
)


@pytest.fixture
def url(tmp_path) -> str:
    return f"file://{tmp_path}/store"


@pytest.fixture
def ctx(url) -> CommContext:
    context = CommContext()
    context.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=url, timeout=30)
    return context


def test_context_is_a_process_wide_singleton():
    assert CommContext() is CommContext()


def test_modes_compare_equal_to_their_names():
    assert CommMode.GLOBAL == "GLOBAL" and ParallelMode.TENSOR_PARALLEL == CommMode.TENSOR_PARALLEL == "TENSOR_PARALLEL"
    seed = [
        "GLOBAL",
        "INTRA_NODE",
        "INTER_NODE",
        "TRAIN_DATA_PARALLEL",
        "DATA_PARALLEL",
        "TENSOR_PARALLEL",
        "SEQUENCE_PARALLEL",
        "WEIGHT_TRANSFER",
    ]
    # As in the seed, where ParallelMode extends CommMode, every CommMode name is a ParallelMode name too.
    assert [m.value for m in CommMode] == [m.value for m in ParallelMode] == seed
    for name in seed:
        p, c = getattr(ParallelMode, name), getattr(CommMode, name)
        assert p == c == name and hash(p) == hash(c) == hash(name) and str(p) == str(c) == name
        assert {c: 1}[p] == 1 and {name: 2}[p] == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_size": 0, "rank": 0}, ValueError, "world_size"),
        ({"world_size": 2, "rank": 2}, ValueError, r"0 <= rank < world_size; got rank=2, world_size=2"),
        ({"world_size": 2, "rank": -1}, ValueError, "rank"),
        ({"world_size": 1, "rank": 0, "timeout": 0}, ValueError, "timeout"),
        ({"world_size": 1, "rank": 0, "timeout": -5}, ValueError, "timeout"),
        (
            {"world_size": 1, "rank": 0, "backend": "mpi-ish"},
            KeyError,
            r"No communicator registered as 'mpi-ish'; registered: \[.*'gloo'.*'nccl'",
        ),
        ({"world_size": 1, "dist_url": "tcp://127.0.0.1:1"}, ValueError, "world_size and rank are required"),
    ],
)
def test_bad_distributed_config_fails_before_torch_distributed_is_touched(url, kwargs, error, message):
    kwargs = {"backend": "gloo", "dist_url": url, **kwargs}
    with pytest.raises(error, match=message):
        CommContext().init_distributed_env(**kwargs)
    assert not dist.is_initialized() and not CommContext().is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_without_cuda_is_a_clear_error(url):
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA"):
        CommContext().init_distributed_env(world_size=1, rank=0, dist_url=url)  # backend defaults to nccl
    assert not dist.is_initialized()


def test_env_url_reads_world_size_and_rank_from_the_environment(monkeypatch):
    for name, value in {
        "WORLD_SIZE": "1",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    comm = CommContext().init_distributed_env(backend="gloo")
    assert isinstance(comm, GlooCommunicator) and comm.world_size == 1 and CommContext().get_global_rank() == 0


@pytest.mark.parametrize(("missing", "value"), [("WORLD_SIZE", None), ("RANK", None), ("RANK", "zero")])
def test_env_url_with_missing_or_bad_variables_is_a_clear_error(monkeypatch, missing, value):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    if value is None:
        monkeypatch.delenv(missing)
    else:
        monkeypatch.setenv(missing, value)
    with pytest.raises(ValueError, match=missing):
        CommContext().init_distributed_env(backend="gloo")
    assert not dist.is_initialized()


def test_double_init_is_a_no_op_with_the_same_arguments_and_an_error_otherwise(ctx, url):
    again = ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=url, timeout=30)
    assert again is ctx.get_communicator(CommMode.GLOBAL)
    with pytest.raises(CommError, match="already initialised"):
        ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=url, timeout=60)
    first = ctx.init_group([0], "solo")
    assert ctx.init_group([0], "solo") is first
    with pytest.raises(CommError, match=r"mode 'solo' is already bound to ranks \[0\]"):
        ctx.init_group([0], "solo", timeout=5)


def test_a_world_initialised_by_the_caller_is_adopted_and_left_alone(url):
    dist.init_process_group("gloo", init_method=url, world_size=1, rank=0)
    ctx = CommContext()
    with pytest.raises(CommError, match="already initialised with world_size=1"):
        ctx.init_distributed_env(world_size=2, rank=1, backend="gloo", dist_url=url)
    ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=url)
    ctx.destroy()
    assert dist.is_initialized(), "destroy() must not tear down a world it did not create"


def test_lookups_accept_enum_and_string_and_list_the_bound_modes_when_missing(ctx):
    assert ctx.get_communicator("GLOBAL") is ctx.get_communicator(CommMode.GLOBAL) is ctx.get_communicator()
    with pytest.raises(
        ModeNotBoundError, match=r"No communicator bound for mode 'TENSOR_PARALLEL'; bound modes: \['GLOBAL'\]"
    ) as info:
        collective.all_reduce(torch.ones(1), ParallelMode.TENSOR_PARALLEL)
    assert isinstance(info.value, KeyError) and isinstance(info.value, CommError)
    with pytest.raises(TypeError, match="mode must be a CommMode, a ParallelMode or a str; got int 3"):
        ctx.get_communicator(3)
    with pytest.raises(TypeError, match="got list"):
        ctx.get_world_size([1])


def test_getters(ctx):
    assert ctx.is_initialized() and ctx.get_global_rank() == 0
    assert (
        ctx.get_world_size() == 1
        and ctx.get_local_rank(CommMode.GLOBAL) == 0
        and ctx.get_ranks_in_group("GLOBAL") == [0]
    )
    assert ctx.get_group(CommMode.GLOBAL) is dist.group.WORLD
    ctx.init_group([0], ParallelMode.SEQUENCE_PARALLEL)
    assert ctx.bound_modes() == ["GLOBAL", "SEQUENCE_PARALLEL"]
    assert ctx.get_communicator(CommMode.SEQUENCE_PARALLEL).device == torch.device("cpu")


def test_calls_before_init_are_clear_errors():
    ctx = CommContext()
    assert not ctx.is_initialized()
    with pytest.raises(CommError, match="not initialised"):
        ctx.get_global_rank()
    with pytest.raises(CommError, match="not initialised"):
        ctx.init_group([0], "x")
    with pytest.raises(ModeNotBoundError, match="bound modes: \\[\\]"):
        collective.barrier()
    ctx.destroy()  # harmless when nothing is initialised


@pytest.mark.parametrize(
    ("ranks", "kwargs", "error", "message"),
    [
        ([0, 1], {}, ValueError, r"rank 1 is out of range for world size 1"),
        ([0, 0], {}, ValueError, r"rank 0 appears more than once"),
        ([[0], [0]], {}, ValueError, r"groups must be disjoint"),
        ([], {}, ValueError, "non-empty list"),
        ([[0], []], {}, ValueError, "at least one rank"),
        ([0, [0]], {}, ValueError, "mixes ranks and lists"),
        ("0", {}, ValueError, "non-empty list"),
        ([0], {"backend": "nope"}, KeyError, r"registered: \["),
        ([0], {"timeout": 0}, ValueError, "timeout"),
    ],
)
def test_bad_group_config_fails_before_any_group_is_created(ctx, ranks, kwargs, error, message, monkeypatch):
    created = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: created.append(1))
    with pytest.raises(error, match=message):
        ctx.init_group(ranks, "bad", **kwargs)
    assert created == [] and "bad" not in ctx.bound_modes()


def test_global_is_reserved_for_init_distributed_env(ctx):
    with pytest.raises(ValueError, match="mode 'GLOBAL' is bound by init_distributed_env"):
        ctx.init_group([0], CommMode.GLOBAL)


def test_use_cpu_binds_gloo(ctx):
    assert isinstance(ctx.init_group([0], "cpu", use_cpu=True), GlooCommunicator)
    # As in the seed, use_cpu forces gloo even where backend names another one.
    assert isinstance(ctx.init_group([0], "cpu_over_nccl", "nccl", True), GlooCommunicator)
    assert ctx.get_group_config("cpu_over_nccl").backend == "gloo"


def test_destroy_then_init_again_in_one_process(ctx, tmp_path):
    ctx.init_group([0], "extra")
    ctx.destroy()
    assert not ctx.is_initialized() and not dist.is_initialized() and ctx.bound_modes() == []
    ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store2")
    t = torch.tensor([3.0])
    collective.all_reduce(t, "GLOBAL")
    assert t.item() == 3.0


def test_seed_getters_read_the_launchers_environment(ctx, monkeypatch):
    assert ctx.is_main_rank() is True
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ctx.get_in_node_rank() == 3 and ctx.get_local_world_size() == 8
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ValueError, match="environment variable LOCAL_RANK must be an integer; got 'first'"):
        ctx.get_in_node_rank()
    for name, getter in (("LOCAL_RANK", ctx.get_in_node_rank), ("LOCAL_WORLD_SIZE", ctx.get_local_world_size)):
        monkeypatch.delenv(name)
        with pytest.raises(
            CommError,
            match=f"reads the environment variable {name}, which is not set in this process; launch with torchrun",
        ):
            getter()
    for getter, mode in (
        (ctx.get_intra_node_process_group, "INTRA_NODE"),
        (ctx.get_inter_node_process_group, "INTER_NODE"),
    ):
        with pytest.raises(ModeNotBoundError, match=f"No communicator bound for mode '{mode}'"):
            getter()
        ctx.init_group([0], getattr(ParallelMode, mode))
        assert getter() is ctx.get_group(mode) is not None


def test_initialize_distributed_env_is_the_seeds_function(monkeypatch):
    import inspect

    from rlightning_comm import initialize_distributed_env

    params = inspect.signature(initialize_distributed_env).parameters
    positional = [(n, p.default) for n, p in params.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == [
        ("rank", inspect.Parameter.empty),
        ("world_size", inspect.Parameter.empty),
        ("backend", "nccl"),
        ("dist_url", "env://"),
        ("timeout", 1800),
    ]
    # Options beyond the seed's come after it, keyword-only, with defaults: every seed call means what it meant.
    assert [(n, p.default) for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY] == [
        ("bounded_wait", None)
    ]
    with pytest.raises(CommError, match="not initialised"):
        CommContext().is_main_rank()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    comm = initialize_distributed_env(0, 1, "gloo", "env://", 30)
    assert (
        comm is CommContext().get_communicator()
        and CommContext().get_group_config().timeout == 30.0
        and CommContext().is_main_rank()
    )


def test_per_call_declarations_build_up_the_modes_config(ctx):
    first = ctx.init_group([0], "per_call")
    assert ctx.init_group([0], "per_call") is first and ctx.init_group([[0]], "per_call") is first
    assert ctx.get_group_config("per_call").partition == ((0,),) and ctx.get_group_config("per_call").as_ranks() == [0]
    with pytest.raises(
        CommError, match=r"mode 'per_call' is already bound to ranks \[0\] \(backend 'gloo', timeout 30.0s\)"
    ):
        ctx.init_group([0], "per_call", timeout=5)


def test_destroy_switches_stats_off_like_debug_mode(ctx, url):
    # A reused process (a test world, a notebook) initialises again after destroy(): recording must not carry over,
    # since a wrapped communicator takes other paths (weight transfer broadcasts instead of sending point to point).
    ctx.enable_stats()
    collective.all_reduce(torch.ones(2), "GLOBAL")
    ctx.destroy()
    from rlightning_comm import stats

    assert not stats.is_enabled()
    ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=url + "2", timeout=30)
    comm = ctx.get_communicator("GLOBAL")
    assert "all_reduce" not in vars(comm)  # the class's own method: no stats wrapper
    assert ctx.stats()["GLOBAL"]["all_reduce"]["count"] == 1  # the figures stay until reset_stats()
