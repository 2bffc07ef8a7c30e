"""The NCCL-only Python paths, on CPU: the bounded wait, the device bound at bind time, the backend's own refusals.

No GPU here: a test-only subclass of ``NcclCommunicator`` takes CPU tensors (so ``backend`` is still ``"nccl"``) and a
stand-in process group plays ProcessGroupNCCL's part as torch 2.13's source describes it (a blocking call returns no
work; an async one returns a work whose ``wait()`` raises torch's own error text). ``torch.cuda`` functions are patched
where a CUDA call is needed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from typing_extensions import override

from rlightning_comm import CommContext, CommError, CommTimeoutError, NcclCommunicator
from rlightning_comm.communicators import nccl
from rlightning_comm.communicators.nccl import BLOCKING_WAIT_ENV

# torch 2.13's WorkNCCL: checkTimeout's text, rethrown by wait() in blocking-wait mode after aborting the communicator.
NCCL_TIMEOUT = (
    "[PG ID 1 PG GUID 1 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
    "NumelIn=4, "
    "NumelOut=4, Timeout(ms)=1500) ran for 1501 milliseconds before timing out."
)


class HostNccl(NcclCommunicator):
    """NCCL's Python paths with CPU tensors and buffers (test only)."""

    @property
    @override
    def device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def _barrier_device_ids(self) -> list[int] | None:
        return None

    @staticmethod
    @override
    def on_device(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (
            a.is_cpu and b.is_cpu and a.dtype in nccl._FAST and b.dtype in nccl._FAST
        )  # NCCL's own test, devices aside

    @override
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        if not tensor.is_cpu:
            raise ValueError(f"{name}: HostNccl takes CPU tensors")


class _Work:
    def __init__(self, error: str | None) -> None:
        self.error = error
        self.waits = 0

    def wait(self, *args: Any) -> bool:
        self.waits += 1
        if self.error:
            raise dist.DistBackendError(self.error)
        return True


class StandInNccl:
    """ProcessGroupNCCL as its source reads: ``asyncOp=False`` returns no work, ``asyncOp=True`` a work to wait on."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.launched: list[tuple[str, bool]] = []
        self.works: list[_Work] = []

    def _launch(self, name: str, opts: Any) -> _Work | None:
        self.launched.append((name, opts.asyncOp))
        if not opts.asyncOp:
            return None
        self.works.append(_Work(self.error))
        return self.works[-1]

    def allreduce(self, tensors, opts):
        return self._launch("allreduce", opts)

    def broadcast(self, tensors, opts):
        return self._launch("broadcast", opts)

    def all_gather_single(self, output, input_, opts):
        output.copy_(input_.reshape(output.shape))
        return self._launch("all_gather_single", opts)

    def barrier(self, opts):
        return self._launch("barrier", opts)

    def reduce_scatter_single(self, output, input_, opts):
        if (
            input_.is_complex()
        ):  # ProcessGroupNCCL._reduce_scatter_base does not view complex as real: no NCCL type for it
            raise TypeError(f"Input tensor data type is not supported for NCCL process group: {input_.dtype}")
        output.copy_(input_.reshape(output.shape))
        return self._launch("reduce_scatter_single", opts)


@pytest.fixture
def world(tmp_path) -> CommContext:
    ctx = CommContext()
    ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store", timeout=30)
    return ctx


def test_bounded_wait_launches_blocking_calls_as_async_and_waits_for_their_work(world):
    default, bounded = StandInNccl(), StandInNccl()
    plain = HostNccl(default, [0], "plain", timeout=1.5)
    waited = HostNccl(bounded, [0], "bounded", timeout=1.5, bounded_wait=True)
    assert (plain.bounded_wait, waited.bounded_wait) == (False, True)
    for comm in (plain, waited):
        comm.all_reduce(torch.ones(4))
        comm.broadcast(torch.ones(4), 0)
        comm.barrier()
        assert comm.all_reduce_dict({"loss": 1.0}) == {"loss": 1.0}
        comm.broadcast_object_list([{"a": 1}], 0)
    # Default: torch's blocking calls (no work to wait on, as NCCL returns none). Bounded: async launches, each waited
    # once.
    assert {a for _, a in default.launched} == {False} and not default.works
    assert {a for _, a in bounded.launched} == {True} and len(bounded.works) == len(bounded.launched) == 6
    assert all(w.waits == 1 for w in bounded.works)


def test_bounded_wait_turns_nccls_timeout_into_the_librarys_error(world):
    comm = HostNccl(StandInNccl(NCCL_TIMEOUT), [0], "TP", timeout=1.5, bounded_wait=True)
    with pytest.raises(
        CommTimeoutError, match=r"all_reduce on mode 'TP' timed out after 1.5 s \(the group's timeout\)"
    ) as info:
        comm.all_reduce(torch.ones(4))
    assert isinstance(info.value.__cause__, dist.DistBackendError)
    handle = comm.all_reduce(torch.ones(4), async_op=True)
    with pytest.raises(CommTimeoutError, match="all_reduce on mode 'TP' timed out"):
        handle.wait()
    with pytest.raises(CommTimeoutError, match="broadcast_object_list on mode 'TP' timed out"):
        comm.broadcast_object_list([1], 0)


def test_bounded_wait_is_a_world_setting_that_sets_torchs_blocking_wait(tmp_path, monkeypatch):
    monkeypatch.delenv(BLOCKING_WAIT_ENV, raising=False)
    ctx = CommContext()
    comm = ctx.init_distributed_env(
        world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store", timeout=30, bounded_wait=True
    )
    import os

    assert os.environ[BLOCKING_WAIT_ENV] == "1"  # before any NCCL group this context creates
    assert comm.bounded_wait is False  # gloo's calls wait within the timeout anyway
    with pytest.raises(Exception, match="already initialised"):
        ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store", timeout=30)
    assert (
        ctx.init_distributed_env(
            world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store", timeout=30, bounded_wait=True
        )
        is comm
    )


def test_bounded_wait_refuses_an_environment_that_turns_blocking_wait_off(tmp_path, monkeypatch):
    monkeypatch.setenv(BLOCKING_WAIT_ENV, "0")
    with pytest.raises(
        ValueError, match=r"bounded_wait=True needs TORCH_NCCL_BLOCKING_WAIT=1 .* sets TORCH_NCCL_BLOCKING_WAIT='0'"
    ):
        CommContext().init_distributed_env(
            world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store", timeout=30, bounded_wait=True
        )
    assert not dist.is_initialized()


class FakeCuda:
    """torch.cuda as a machine with ``count`` GPUs whose current device is per thread, as CUDA's is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        self.count = 4
        self.state = threading.local()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(self.state, "device", 0))
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(self.state, "device", torch.device(d).index))
        monkeypatch.delenv("LOCAL_RANK", raising=False)


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def _in_thread(fn):
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(10)
    return out[0]


def test_the_device_is_bound_from_local_rank_and_used_by_every_entry_point_whatever_the_calling_thread(
    world, cuda, monkeypatch
):
    from rlightning_comm.communicators import _values
    from rlightning_comm.stats._recorder import _Recorder

    monkeypatch.setenv("LOCAL_RANK", "2")
    comm = NcclCommunicator(dist.group.WORLD, [0], "gpu")
    cuda.state.device = 3  # the calling thread's device changes after the bind
    staged = []
    monkeypatch.setattr(_values, "pack", lambda d, dtype, device, mode, checked: staged.append(device) or (None, None))
    monkeypatch.setattr(_values, "broadcast_objects", lambda objs, is_src, send, device: staged.append(device))
    events = []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self, stream):
            events.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    recorder = _Recorder()
    recorder.enabled = True
    recorder.attach(comm)

    def calls():
        assert comm.all_reduce_dict({"loss": 1.0}) == {}
        comm.broadcast_object_list([1], 0)
        return comm.device, comm._barrier_device_ids()

    assert _in_thread(calls) == (torch.device("cuda", 2), [2])  # a thread whose current device is 0
    assert staged == [torch.device("cuda", 2)] * 2
    assert events == ["stream of cuda:2"] * 4  # start and end of both calls, on the bound device's stream


def test_without_local_rank_the_device_is_the_binding_threads_current_one(world, cuda):
    cuda.state.device = 1
    comm = NcclCommunicator(dist.group.WORLD, [0], "gpu")
    cuda.state.device = 0
    assert _in_thread(lambda: comm.device) == comm.device == torch.device("cuda", 1)


def test_local_rank_must_name_a_visible_gpu(world, cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(
        ValueError,
        match=(
            r"LOCAL_RANK=4 names no GPU of this process: expected 0 <= LOCAL_RANK < 4 "
            r"\(torch.cuda.device_count\(\)\)"
        ),
    ):
        NcclCommunicator(dist.group.WORLD, [0], "gpu")
    with pytest.raises(ValueError, match="LOCAL_RANK=4 names no GPU"):  # init_group refuses before any group is created
        world.init_group([0], "GPU", backend="nccl")
    assert "GPU" not in world.bound_modes()
    cuda.count = 1  # each process sees its own GPU only (CUDA_VISIBLE_DEVICES, Ray's num_gpus=1)
    assert NcclCommunicator(dist.group.WORLD, [0], "gpu").device == torch.device("cuda", 0)
    cuda.count = 4
    monkeypatch.setenv("LOCAL_RANK", "2")
    NcclCommunicator.setup_process()
    assert cuda.state.device == 2


def test_an_nccl_world_is_bound_to_its_device(tmp_path, cuda, monkeypatch):
    from rlightning_comm import rendezvous
    from rlightning_comm.context import CommContext as Context

    monkeypatch.setenv("LOCAL_RANK", "3")
    seen = []
    real = rendezvous.init_process_group

    def init(backend, url, world_size, rank, timeout, device_id=None):
        seen.append((backend, device_id))
        real("gloo", url, world_size, rank, timeout)  # a CPU machine: gloo stands in for the world NCCL would make

    monkeypatch.setattr(rendezvous, "init_process_group", init)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    Context().init_distributed_env(
        world_size=1, rank=0, backend="nccl", dist_url=f"file://{tmp_path}/store", timeout=30
    )
    assert seen == [("nccl", torch.device("cuda", 3))] and cuda.state.device == 3
    assert Context().get_communicator().device == torch.device("cuda", 3)


def test_members_of_a_gloo_group_take_part_in_the_world_split(world, monkeypatch):
    from rlightning_comm import _compat

    joined = []
    monkeypatch.setattr(_compat, "join_world_split", lambda: joined.append(1))
    world.init_group([0], "HOST", backend="gloo")
    assert joined == [1]  # a no-op on this unbound world; on an NCCL world bound to a device it is the members' split


class _Tensorish:
    """What NcclCommunicator's fast test reads of a tensor (no CUDA tensor can exist here)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.is_cuda, self.dtype = True, dtype

    def get_device(self) -> int:
        return 0


def test_nccls_fast_test_passes_only_the_dtypes_it_moves_and_reduces():
    taken = {
        dt
        for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool)
        if NcclCommunicator.on_device(_Tensorish(dt), _Tensorish(dt))
    }
    assert taken == {torch.float32, torch.bfloat16, torch.int64, torch.bool}
    for dt in (torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.float8_e4m3fn, torch.complex64):
        assert not NcclCommunicator.on_device(_Tensorish(dt), _Tensorish(dt)), dt  # to the full checks


def test_nccl_refuses_what_it_cannot_move_or_reduce_before_anything_is_sent(world, monkeypatch):
    group = StandInNccl()
    comm = HostNccl(group, [0], "TP")
    ReduceOp = dist.ReduceOp
    for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.int16):
        for call in (
            lambda t: comm.all_reduce(t),
            lambda t: comm.broadcast(t, 0),
            lambda t: comm.all_gather(torch.empty(4, dtype=t.dtype), t),
            lambda t: comm.reduce_scatter(torch.empty(4, dtype=t.dtype), t),
        ):
            with pytest.raises(
                ValueError,
                match=rf"is {dtype}, which HostNccl \(mode 'TP'\) cannot move; expected one of: bfloat16, bool, ",
            ):
                call(torch.zeros(4, dtype=dtype))
    with pytest.raises(ValueError, match="dtype is torch.uint16, which HostNccl"):
        comm.all_reduce_dict({"x": 1}, dtype=torch.uint16)
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor with HostNccl; got torch.bool"):
        comm.all_reduce(torch.zeros(4, dtype=torch.bool), ReduceOp.AVG)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    nccl._unreducible.cache_clear()
    try:
        for dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            with pytest.raises(ValueError, match=rf"HostNccl \(mode 'TP'\) cannot reduce {dtype} tensors"):
                comm.all_reduce(torch.zeros(4, dtype=dtype))
            with pytest.raises(ValueError, match="cannot reduce"):
                comm.reduce_scatter(torch.empty(4, dtype=dtype), torch.zeros(4, dtype=dtype))
        assert group.launched == []  # nothing reached the backend
        comm.all_reduce(torch.zeros(4, dtype=torch.float8_e4m3fn))  # NCCL >= 2.24 reduces e4m3fn and e5m2
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
        nccl._unreducible.cache_clear()
        with pytest.raises(ValueError, match="cannot reduce torch.float8_e5m2 tensors"):
            comm.all_reduce(torch.zeros(4, dtype=torch.float8_e5m2))
    finally:
        nccl._unreducible.cache_clear()
    # Moving fp8 is fine: the full checks take it, the backend gets it.
    comm.broadcast(torch.zeros(4, dtype=torch.float8_e5m2), 0)
    comm.all_gather(torch.empty(4, dtype=torch.float8_e4m3fnuz), torch.zeros(4, dtype=torch.float8_e4m3fnuz))
    assert [name for name, _ in group.launched] == ["allreduce", "broadcast", "all_gather_single"]


class _Refusing(StandInNccl):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.raised = error

    def allreduce(self, tensors, opts):
        raise self.raised


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (ValueError("Tensors must be CUDA and dense"), ValueError),
        (TypeError("Cannot use ReduceOp.AVG with boolean inputs"), TypeError),
        (RuntimeError("Unsupported Float8 type for NCCL reduction"), CommError),
        (
            NotImplementedError("Could not run 'c10d::allreduce_' with arguments from the 'NestedTensorCPU' backend."),
            CommError,
        ),
    ],
    ids=["value", "type", "fp8", "not implemented"],
)
def test_a_backends_own_refusal_is_reported_as_one_and_the_group_still_works(world, raised, expected):
    comm = HostNccl(_Refusing(raised), [0], "TP")
    with pytest.raises(
        expected,
        match=(
            r"all_reduce on mode 'TP' was refused by the backend's own check on this rank"
            r".*the group still works here"
        ),
    ) as info:
        comm.all_reduce(torch.ones(4))
    assert "a peer is gone" not in str(info.value) and info.value.__cause__ is raised
    assert not comm._lock._is_owned()  # released: the next call may go


def test_a_peer_gone_on_nccl_still_says_so():
    from rlightning_comm.failures import comm_failure

    gone = dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:2087, remote process exited or there was a network error, NCCL version "
        "2.27.3"
    )
    assert "a peer is gone" in str(comm_failure(gone, "TP", "all_reduce", 30.0))


def test_complex_reduce_scatter_goes_as_real_pairs(world):
    comm = HostNccl(StandInNccl(), [0], "TP")
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    out = torch.zeros(2, dtype=torch.complex64)
    comm.reduce_scatter(out, x)  # SUM over one rank: the input itself
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match="not defined on complex tensors"):
        comm.reduce_scatter(out, x, dist.ReduceOp.MAX)
