"""Communicator contract in one process: delegation, custom backends, local validation."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from counting import backend_calls
from torch.distributed import ReduceOp
from typing_extensions import override

from rlightning_comm import (
    CommContext,
    Communicator,
    GlooCommunicator,
    NcclCommunicator,
    collective,
    register_communicator,
)
from rlightning_comm.communicators import get_communicator_class, registered_communicators


@register_communicator("recording-test")
class RecordingCommunicator(GlooCommunicator):
    """Records every call, then does the real gloo collective."""

    calls: ClassVar[list[tuple[str, tuple[Any, ...]]]] = []

    def _record(self, name: str, *args: Any) -> None:
        type(self).calls.append((name, args))

    @override
    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        self._record("all_reduce", tensor, op, async_op)
        return super().all_reduce(tensor, op, async_op)

    @override
    def all_gather(self, output_tensor, input_tensor, async_op=False):
        self._record("all_gather", output_tensor, input_tensor, async_op)
        return super().all_gather(output_tensor, input_tensor, async_op)

    @override
    def broadcast(self, tensor, src=0, async_op=False):
        self._record("broadcast", tensor, src, async_op)
        return super().broadcast(tensor, src, async_op)

    @override
    def gather(self, tensor, gather_list=None, dst=0, async_op=False):
        self._record("gather", tensor, gather_list, dst, async_op)
        return super().gather(tensor, gather_list, dst, async_op)

    @override
    def scatter(self, tensor, scatter_list=None, src=0, async_op=False):
        self._record("scatter", tensor, scatter_list, src, async_op)
        return super().scatter(tensor, scatter_list, src, async_op)

    @override
    def broadcast_object_list(self, object_list, src=0, **options):
        self._record("broadcast_object_list", object_list, src)
        return super().broadcast_object_list(object_list, src, **options)

    @override
    def all_reduce_dict(self, dictionary, op=ReduceOp.SUM, dtype=torch.float32):
        self._record("all_reduce_dict", dictionary, op, dtype)
        return super().all_reduce_dict(dictionary, op, dtype)

    @override
    def barrier(self):
        self._record("barrier")
        return super().barrier()

    @override
    def reduce(self, tensor, dst=0, op=ReduceOp.SUM, async_op=False):
        self._record("reduce", tensor, dst, op, async_op)
        return super().reduce(tensor, dst, op, async_op)

    @override
    def reduce_scatter(self, output, input_, op=ReduceOp.SUM, async_op=False):
        self._record("reduce_scatter", output, input_, op, async_op)
        return super().reduce_scatter(output, input_, op, async_op)

    @override
    def all_gather_object(self, object_list, obj, **options):
        self._record("all_gather_object", object_list, obj)
        return super().all_gather_object(object_list, obj, **options)

    @override
    def send(self, tensor, dst, async_op=False):
        self._record("send", tensor, dst, async_op)
        return super().send(tensor, dst, async_op)

    @override
    def recv(self, tensor, src, async_op=False):
        self._record("recv", tensor, src, async_op)
        return super().recv(tensor, src, async_op)


@register_communicator("from-base-test")
class FromBaseCommunicator(Communicator):
    """A backend written against the abstract base only."""

    backend: ClassVar[str] = "gloo"
    supported_reduce_ops: ClassVar[frozenset[Any]] = frozenset({ReduceOp.SUM, ReduceOp.MAX})

    @property
    @override
    def device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU; got {tensor.device}")


@register_communicator("cuda-only-gloo-test")
class CudaOnlyGloo(GlooCommunicator):
    """Narrows gloo's devices to CUDA and leaves the fast path's device test alone."""

    @override
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        if not tensor.is_cuda:
            raise ValueError(f"{name}: cuda-only-gloo-test takes CUDA tensors; got {tensor.device}")


@pytest.fixture
def ctx(tmp_path) -> CommContext:
    context = CommContext()
    context.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store", timeout=30)
    return context


T = torch.ones(2)
U = torch.zeros(2)
# facade call -> (method name, the arguments the method must receive)
DELEGATION = [
    (lambda m: collective.all_reduce(T, m, ReduceOp.MAX, True), ("all_reduce", (T, ReduceOp.MAX, True))),
    (lambda m: collective.all_gather(T, U, m), ("all_gather", (T, U, False))),
    (lambda m: collective.broadcast(T, m, src=0, async_op=True), ("broadcast", (T, 0, True))),
    (lambda m: collective.gather(T, m, [T], 0), ("gather", (T, [T], 0, False))),
    (lambda m: collective.scatter(T, m, [T], 0), ("scatter", (T, [T], 0, False))),
    (lambda m: collective.broadcast_object_list(["x"], m, 0), ("broadcast_object_list", (["x"], 0))),
    (
        lambda m: collective.all_reduce_dict({"a": 1}, m, ReduceOp.SUM, torch.float64),
        ("all_reduce_dict", ({"a": 1}, ReduceOp.SUM, torch.float64)),
    ),
    (lambda m: collective.barrier(m), ("barrier", ())),
    (lambda m: collective.reduce(T, m, 0, ReduceOp.MAX, True), ("reduce", (T, 0, ReduceOp.MAX, True))),
    (lambda m: collective.reduce_scatter(T, U, m, ReduceOp.SUM), ("reduce_scatter", (T, U, ReduceOp.SUM, False))),
    (lambda m: collective.all_gather_object([None], {"a": 1}, m), ("all_gather_object", ([{"a": 1}], {"a": 1}))),
    # A one-rank world has no peer: the call reaches the method, whose check refuses this rank as its own peer.
    (lambda m: collective.send(T, m, 0, True), ("send", (T, 0, True))),
    (lambda m: collective.recv(U, m, 0), ("recv", (U, 0, False))),
]


@pytest.mark.parametrize(("call", "expected"), DELEGATION, ids=[e[0] for _, e in DELEGATION])
def test_each_facade_calls_the_method_of_the_same_name(ctx, call, expected):
    comm = ctx.init_group([0], "recorded", backend="recording-test")
    assert isinstance(comm, RecordingCommunicator) and get_communicator_class("recording-test") is RecordingCommunicator
    RecordingCommunicator.calls.clear()
    name, args = expected
    if name in ("send", "recv"):
        with pytest.raises(ValueError, match=f"{'dst' if name == 'send' else 'src'}=0 is this rank"):
            call("recorded")
        result = None
    else:
        result = call("recorded")
    # all_reduce_dict reduces its packed buffer through self.all_reduce, so an override sees that too.
    inner = ["all_reduce"] if name == "all_reduce_dict" else []
    assert [c[0] for c in RecordingCommunicator.calls] == [name, *inner]
    got = RecordingCommunicator.calls[0][1]
    assert len(got) == len(args)
    for g, a in zip(got, args):
        assert g is a or g == a
    if name in ("all_reduce", "broadcast", "reduce"):
        assert result is not None and result.wait()


def test_a_backend_subclassing_the_base_works_and_keeps_its_capabilities(ctx):
    comm = ctx.init_group([0], "custom", backend="from-base-test")
    assert isinstance(comm, FromBaseCommunicator) and comm.world_size == 1
    t = torch.tensor([2.0])
    collective.all_reduce(t, "custom", op=ReduceOp.MAX)
    assert t.item() == 2.0
    assert collective.all_reduce_dict({"a": 3}, "custom") == {"a": 3.0}
    with pytest.raises(
        ValueError,
        match=r"reduce op .*PRODUCT.* is not supported by FromBaseCommunicator .*supported: \['MAX', 'SUM'\]",
    ):
        collective.all_reduce(t, "custom", op=ReduceOp.PRODUCT)


def test_registry_rejects_non_communicators_and_name_clashes():
    with pytest.raises(TypeError, match="expects a Communicator subclass"):
        register_communicator("not-a-comm")(dict)
    with pytest.raises(ValueError, match="already registered to GlooCommunicator"):
        register_communicator("gloo")(RecordingCommunicator)
    with pytest.raises(TypeError, match="non-empty str"):
        register_communicator("")
    assert (
        register_communicator("gloo")(GlooCommunicator) is GlooCommunicator
    )  # re-registering the same class is a no-op
    assert {"gloo", "nccl"} <= set(registered_communicators())


def test_communicator_base_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Communicator(None, [0], "x")


def _raises(error, message, fn, *args, **kwargs):
    with pytest.raises(error, match=message):
        fn(*args, **kwargs)


def test_bad_inputs_fail_locally_before_any_collective(ctx):
    with backend_calls() as started:
        _bad_input_calls(ctx)
    assert started == {}, f"a collective started despite bad input: {started}"


def _bad_input_calls(ctx):
    g = "GLOBAL"
    comm = ctx.get_communicator(g)
    base_tensor = torch.arange(8.0)
    _raises(TypeError, "tensor must be a torch.Tensor; got list", collective.all_reduce, [1.0], g)
    _raises(
        ValueError,
        r"tensor must be contiguous; got a tensor of shape \(4,\) with stride \(2,\)",
        collective.all_reduce,
        base_tensor[::2],
        g,
    )
    _raises(
        ValueError,
        "not defined on complex tensors",
        collective.all_reduce,
        torch.ones(2, dtype=torch.complex64),
        g,
        ReduceOp.MAX,
    )
    _raises(
        ValueError,
        "bitwise reduce op .* needs an integer or bool tensor; got torch.float32",
        collective.all_reduce,
        torch.ones(2),
        g,
        ReduceOp.BAND,
    )
    _raises(
        ValueError,
        "AVG needs a floating-point tensor with GlooCommunicator; got torch.int64",
        collective.all_reduce,
        torch.ones(2, dtype=torch.int64),
        g,
        ReduceOp.AVG,
    )
    _raises(ValueError, "not supported by GlooCommunicator", collective.all_reduce, torch.ones(2), g, "SUM")
    _raises(
        ValueError,
        r"output_tensor must have shape \(2, 3\) or \(1, 2, 3\)",
        collective.all_gather,
        torch.empty(3, 3),
        torch.ones(2, 3),
        g,
    )
    _raises(
        ValueError, "torch.float64", collective.all_gather, torch.empty(2, 3, dtype=torch.float64), torch.ones(2, 3), g
    )
    _raises(
        ValueError,
        r"src=1 is not a global rank of mode 'GLOBAL'; expected one of \[0\]",
        collective.broadcast,
        torch.ones(1),
        g,
        1,
    )
    _raises(
        TypeError,
        "src=True is not a global rank of mode 'GLOBAL': expected an int",
        collective.broadcast,
        torch.ones(1),
        g,
        True,
    )
    _raises(ValueError, "dst=-1 is not a global rank", collective.gather, torch.ones(1), g, [torch.ones(1)], -1)
    _raises(
        TypeError, "gather_list must be a list of 1 tensors; got NoneType", collective.gather, torch.ones(1), g, None, 0
    )
    _raises(
        ValueError,
        "gather_list must hold one tensor per rank: expected 1; got 2",
        collective.gather,
        torch.ones(1),
        g,
        [torch.ones(1)] * 2,
        0,
    )
    _raises(
        ValueError,
        r"gather_list\[0\] must match the tensor argument: expected shape \(1,\)",
        collective.gather,
        torch.ones(1),
        g,
        [torch.ones(2)],
        0,
    )
    _raises(
        ValueError,
        r"scatter_list\[0\] must match the tensor argument.*torch.int64",
        collective.scatter,
        torch.ones(1),
        g,
        [torch.ones(1, dtype=torch.int64)],
        0,
    )
    _raises(TypeError, "object_list must be a list", collective.broadcast_object_list, ("a",), g)
    _raises(TypeError, "dictionary must be a Mapping; got list", collective.all_reduce_dict, [1], g)
    _raises(
        TypeError,
        "value for key 'b' must be a number or a tensor; got str",
        collective.all_reduce_dict,
        {"a": 1, "b": "x"},
        g,
    )
    _raises(ValueError, "input_ must hold world_size", comm.reduce_scatter, torch.ones(2), torch.ones(3))
    _raises(
        ValueError,
        "input_split_sizes must have 1 entries summing to dim 0 = 3",
        comm.all_to_all_single,
        torch.ones(3),
        torch.ones(3),
        None,
        [2],
    )


def test_every_collective_has_a_local_check_with_its_parameters(ctx):
    import inspect

    from rlightning_comm.communicators.base import COLLECTIVES

    for op in COLLECTIVES:
        public, check = (
            inspect.signature(getattr(Communicator, op)),
            inspect.signature(getattr(Communicator, f"_check_{op}")),
        )
        assert [(p.name, p.kind, p.default) for p in public.parameters.values()] == [
            (p.name, p.kind, p.default) for p in check.parameters.values()
        ], op
    # A check raises the op's own error and never communicates; on good input it returns None.
    comm = ctx.get_communicator()
    with backend_calls() as started:
        _raises(
            TypeError,
            "output_split_sizes must be a list of 1 ints .*; got int 4",
            comm._check_all_to_all_single,
            torch.ones(4),
            torch.ones(4),
            4,
        )
        assert comm._check_all_to_all_single(torch.ones(4), torch.ones(4), [4], [4]) is None
        assert comm._check_gather(torch.ones(1), [torch.ones(1)], 0) is None
    assert started == {}


def test_nccl_communicator_refuses_cpu_tensors_before_any_collective(ctx):
    nccl = NcclCommunicator(dist.group.WORLD, [0], "gpu")
    with backend_calls() as started:
        with pytest.raises(
            ValueError, match="tensor is on cpu; NcclCommunicator \\(mode 'gpu'\\) expects a CUDA tensor"
        ):
            nccl.all_reduce(torch.ones(1))
        with pytest.raises(ValueError, match="not supported by NcclCommunicator"):
            nccl._check_reduce_op(ReduceOp.BAND, torch.int64)
    assert started == {}


def test_communicator_properties_and_extra_ops(ctx):
    comm = ctx.get_communicator()
    assert (comm.rank, comm.world_size, comm.ranks, comm.group, comm.mode, comm.is_member) == (
        0,
        1,
        (0,),
        dist.group.WORLD,
        "GLOBAL",
        True,
    )
    assert "GlooCommunicator(mode='GLOBAL', ranks=[0], member=True)" == repr(comm)
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0))
    out = torch.empty(3)
    comm.all_to_all_single(out, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))


def test_debug_mode_and_stats_cover_every_collective():
    import inspect as _inspect

    from rlightning_comm.communicators.base import COLLECTIVES
    from rlightning_comm.debug import _checks as debug
    from rlightning_comm.stats import TRACKED_OPS

    # Every public method that takes part in a collective is in the one list both features read.
    extension_points = {
        "setup_process",
        "bind_device",
        "check_device",
        "on_device",
    }  # what subclasses override, not collectives
    public = {
        n for n, f in _inspect.getmembers(Communicator, _inspect.isfunction) if not n.startswith("_")
    } - extension_points
    assert set(COLLECTIVES) == public
    assert debug.OPS == TRACKED_OPS == COLLECTIVES
    assert set(debug._DESCRIBE) == set(COLLECTIVES)  # each has a fingerprint


def test_sequence_parallel_ops_apply_the_communicators_device_rule(ctx, monkeypatch):
    from rlightning_comm.sequence_parallel import all_to_all

    started = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: started.append(1))
    # An NCCL communicator that claims two ranks: the op must refuse a CPU tensor before any collective.
    nccl = NcclCommunicator(dist.group.WORLD, [0, 1], "fake-nccl")
    with pytest.raises(
        ValueError, match="input_ is on cpu; NcclCommunicator \\(mode 'fake-nccl'\\) expects a CUDA tensor"
    ):
        all_to_all(torch.ones(1, 4, 2, 3), 1, 2, nccl)
    assert started == []


def test_a_subclass_that_narrows_check_device_is_held_to_it_on_every_op(ctx):
    # GlooCommunicator's fast path takes two CPU tensors without calling check_device; a subclass that refuses CPU
    # tensors there, and does not say how to test its devices fast, must get its own check on every call.
    comm = ctx.init_group([0], "cuda-only", backend="cuda-only-gloo-test")
    assert CudaOnlyGloo.on_device(torch.ones(1), torch.ones(1)) is False
    x, out = torch.ones(4), torch.zeros(4)
    calls = [
        lambda: comm.all_reduce(x),
        lambda: comm.all_gather(out, x),
        lambda: comm.broadcast(x, 0),
        lambda: comm.gather(x, [out], 0),
        lambda: comm.scatter(out, [x], 0),
        lambda: comm.reduce_scatter(out, x),
        lambda: comm.all_to_all_single(out, x),
    ]
    for call in calls:
        with backend_calls() as sent, pytest.raises(ValueError, match="cuda-only-gloo-test takes CUDA tensors"):
            call()
        assert sent == {}, sent
    assert torch.equal(x, torch.ones(4)) and torch.equal(out, torch.zeros(4))


class _NoWorkGroup:
    """A stand-in process group that does each op of a one-rank group in the call and returns no work, as NCCL does for
    blocking calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _done(self, name: str) -> None:
        self.calls.append(name)

    def allreduce(self, tensors, opts):
        self._done("allreduce")

    def broadcast(self, tensors, opts):
        self._done("broadcast")

    def all_gather_single(self, output, input_, opts):
        output.copy_(input_.reshape(output.shape))
        self._done("all_gather_single")

    def reduce_scatter_single(self, output, input_, opts):
        output.copy_(input_.reshape(output.shape))
        self._done("reduce_scatter_single")

    def all_to_all_single(self, output, input_, output_splits, input_splits, opts):
        output.copy_(input_)
        self._done("all_to_all_single")

    def gather(self, outputs, inputs, opts):
        outputs[0][0].copy_(inputs[0])
        self._done("gather")

    def scatter(self, outputs, inputs, opts):
        outputs[0].copy_(inputs[0][0])
        self._done("scatter")

    def barrier(self, opts):
        self._done("barrier")


def test_a_backend_that_returns_no_work_is_waited_on_by_no_one(ctx):
    # torch's wrappers guard each blocking op with `elif work is not None: work.wait()`; NCCL's blocking calls return
    # None.
    stand_in = _NoWorkGroup()
    comm = GlooCommunicator(stand_in, [0], "no-work")
    x = torch.arange(4.0)
    ours, theirs = x.clone(), x.clone()
    comm.all_reduce(ours)
    dist.all_reduce(theirs)
    assert torch.equal(ours, theirs)
    out = torch.empty(4)
    comm.all_gather(out, x)
    assert torch.equal(out, x)
    comm.broadcast(ours, 0)
    gathered = [torch.empty(4)]
    comm.gather(x, gathered, 0)
    assert torch.equal(gathered[0], x)
    scattered = torch.empty(4)
    comm.scatter(scattered, [x], 0)
    assert torch.equal(scattered, x)
    comm.reduce_scatter(out, x)
    comm.all_to_all_single(out, x)
    comm.barrier()
    assert comm.all_reduce_dict({"loss": 2.0, "n": 3}) == {"loss": 2.0, "n": 3.0}
    objs = [{"a": 1}]
    comm.broadcast_object_list(objs, 0)
    assert objs == [{"a": 1}]
    handle = comm.all_reduce(ours, async_op=True)
    assert handle.wait() is True and handle.is_completed() is True and handle.get_future().wait() is None
    assert set(stand_in.calls) == {
        "allreduce",
        "broadcast",
        "all_gather_single",
        "reduce_scatter_single",
        "all_to_all_single",
        "gather",
        "scatter",
        "barrier",
    }


def test_inside_torchs_coalescing_manager_calls_join_it_or_are_refused(ctx, monkeypatch):
    from torch.distributed.distributed_c10d import _coalescing_manager

    from rlightning_comm import CommError

    comm = ctx.get_communicator()
    coalesced = []
    real = dist.ProcessGroup.allreduce_coalesced
    monkeypatch.setattr(
        dist.ProcessGroup, "allreduce_coalesced", lambda pg, ts, opts: coalesced.append(len(ts)) or real(pg, ts, opts)
    )
    a, b = torch.arange(3.0), torch.arange(3.0) + 5
    with backend_calls() as sent:
        with _coalescing_manager(comm.group):
            comm.all_reduce(a)
            comm.all_reduce(b, ReduceOp.SUM)
            assert sent == {} and coalesced == []  # recorded by the manager, not issued one by one
            for name, call in (
                ("broadcast", lambda: comm.broadcast(a, 0)),
                ("gather", lambda: comm.gather(a, [torch.empty(3)], 0)),
                ("scatter", lambda: comm.scatter(a, [b], 0)),
                ("all_to_all_single", lambda: comm.all_to_all_single(torch.empty(3), b)),
                ("barrier", comm.barrier),
                ("all_reduce_dict", lambda: comm.all_reduce_dict({"x": 1.0})),
                ("broadcast_object_list", lambda: comm.broadcast_object_list([1], 0)),
            ):
                with pytest.raises(
                    CommError, match=rf"{name} on mode 'GLOBAL' was called inside torch's _coalescing_manager"
                ):
                    call()
        assert coalesced == [2]  # one call for both, when the manager exited
    assert torch.equal(a, torch.arange(3.0)) and torch.equal(b, torch.arange(3.0) + 5)
    assert sent == {}


def test_a_subclass_with_a_mis_shaped_extension_point_fails_when_it_is_created():
    with pytest.raises(TypeError) as info:

        class OneArgument(GlooCommunicator):
            def check_device(self, tensor):  # the name argument is missing
                pass

            def on_device(self, a, b):  # a method, not a @staticmethod
                return True

            def device(self):  # not a property
                return torch.device("cpu")

    text = str(info.value)
    assert text.startswith("OneArgument does not fit the Communicator contract:")
    for problem in (
        "check_device must be a method check_device(self, tensor, name) -> None",
        "on_device must be a @staticmethod on_device(a, b) -> bool; got a method that also takes self",
        "device must be a property (decorate it with @property); got function",
    ):
        assert problem in text, text
    with pytest.raises(TypeError, match="_check_device is now named check_device: rename the override"):

        class OldName(GlooCommunicator):
            def _check_device(self, tensor, name):
                pass


def test_registering_an_incomplete_subclass_lists_what_it_lacks():
    class Incomplete(Communicator):
        supported_reduce_ops = frozenset({ReduceOp.SUM})

    with pytest.raises(TypeError) as info:
        register_communicator("incomplete-test")(Incomplete)
    text = str(info.value)
    assert text.startswith("Incomplete cannot be registered:")
    for problem in (
        "check_device is missing (still abstract)",
        "device is missing (still abstract)",
        "backend is missing",
    ):
        assert problem in text, text
    assert "incomplete-test" not in registered_communicators()
    with pytest.raises(TypeError, match=r"backend must be a non-empty str naming a torch.distributed backend; got 3"):

        class BadBackend(GlooCommunicator):
            backend = 3
