"""broadcast_state_dict on real gloo worlds: bit-identical destinations, a bounded number of collectives, errors on
every rank."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch
from world import init_world

BIG = (300, 300)  # 360 KB of float32: at least 256 KiB, so it travels in place with the default bucket


def digests(named) -> dict[str, str]:
    """sha256 of each tensor's logical values (conjugate and negative views resolved), in logical order: equal digests
    mean bit-identical values."""
    out = {}
    for name, t in named:
        values = t.detach().cpu().resolve_conj().resolve_neg().reshape(-1).clone(memory_format=torch.contiguous_format)
        out[name] = hashlib.sha256(values.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _random(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)


def _state(rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every awkward case in one state dict; on rank 2 the layouts differ from the source's (same names, dtypes and
    shapes)."""
    gen = torch.Generator().manual_seed(rank)
    state = {
        f"{str(d).removeprefix('torch.')}": _random((5, 7), d, gen)
        for d in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.float64,
            torch.int64,
            torch.int8,
            torch.bool,
            torch.complex64,
        )
    }
    state["scalar"] = _random((), torch.float32, gen)
    state["scalar_bf16"] = _random((), torch.bfloat16, gen)
    state["empty"] = torch.zeros(0, 4)
    state["empty_i64"] = torch.zeros(0, dtype=torch.int64)
    state["wide"] = _random((2, 5000), torch.float32, gen)  # one row is more than the small bucket
    state["big"] = _random(BIG, torch.float32, gen)
    state["big_t"] = _random(BIG, torch.float32, gen).t()  # non-contiguous, travels staged
    state["strided"] = _random((6, 8), torch.float32, gen)[:, ::2]
    base = _random((8, 6), torch.float32, gen)  # shared storage: two views of one tensor
    state["q"], state["k"] = base[:4], base[4:]
    tied = _random((3, 4), torch.float32, gen)
    state["embed"] = tied
    # Tied on the source (sent once); rank 3 holds its own copy, which must get the same bytes.
    state["lm_head"] = tied if rank != 3 else _random((3, 4), torch.float32, gen)
    # Conjugate and negative views: read through their logical values on the source; a destination's own such views get
    # the source's logical values. "w_conj" is "w"'s storage on the source, but not the same tensor (not tied).
    w = _random((4, 3), torch.complex64, gen)
    state["w"], state["w_conj"] = (w, w.conj()) if rank == 0 else (w, _random((4, 3), torch.complex64, gen))
    state["c_conj"] = _random((5, 7), torch.complex64, gen).conj()
    state["c_big_conj"] = _random(BIG, torch.complex64, gen).conj()  # in place if it were plain
    state["neg"] = torch._neg_view(_random((6,), torch.float32, gen))
    state["neg_big"] = torch._neg_view(_random(BIG, torch.float32, gen))
    if rank == 1:  # plain destinations for the source's views
        for name in ("c_conj", "c_big_conj", "neg", "neg_big"):
            state[name] = state[name].resolve_conj().resolve_neg().clone()
    if (
        rank == 2
    ):  # contiguity differs per rank: this destination holds transposed storage where the source is contiguous
        # Random, not empty: a reused process may hand empty() the very bytes an earlier transfer left there.
        state["big"] = _random((BIG[1], BIG[0]), torch.float32, gen).t()
        state["big_t"] = _random(BIG, torch.float32, gen)
    return state, base


def _transfer_everything(rank: int, size: int, url: str, bucket_bytes: int) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1, 2, 3])
    state, base = _state(rank)
    before = digests(state.items())
    broadcast_state_dict(state, bucket_bytes=bucket_bytes)
    tied = state["embed"].data_ptr() == state["lm_head"].data_ptr()
    return {
        "before": before,
        "after": digests(state.items()),
        "tied": tied,
        "views_share_base": state["q"].data_ptr() == base.data_ptr(),
    }


@pytest.mark.parametrize("bucket_bytes", [16384, 1 << 20])
def test_every_dtype_and_layout_arrives_bit_identical(world4, bucket_bytes: int) -> None:
    results = world4.run(_transfer_everything, bucket_bytes, timeout=120)
    source = results[0]["before"]
    assert results[0]["after"] == source  # the source is only read
    for r, result in enumerate(results[1:], start=1):
        assert {k for k in source if result["before"][k] != source[k]} >= {
            "float32",
            "big",
            "big_t",
            "q",
            "lm_head",
            "scalar",
            "w_conj",
            "c_big_conj",
            "neg_big",
        }, r
        assert result["after"] == source, r
        assert result["views_share_base"]
    assert [r["tied"] for r in results] == [True, True, True, False]  # storage sharing is each rank's own


def _count(rank: int, size: int, url: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    gen = torch.Generator().manual_seed(rank)
    state = {f"small.{i}": torch.randn(16, generator=gen) for i in range(21)}
    state.update({f"big.{i}": torch.randn(*BIG, generator=gen) for i in range(3)})
    counts = []
    for call in range(3):
        if call == 2:  # a changed manifest (one more tensor on every rank) is agreed again
            state["extra"] = torch.full((5,), float(rank))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            broadcast_state_dict(state)
        found: dict[str, int] = {}
        for event in prof.events():
            if event.name.startswith("gloo:"):
                found[event.name] = found.get(event.name, 0) + 1
        counts.append(found)
    return {"counts": counts, "final": digests(state.items())}


def test_collectives_per_call_are_bounded_by_buckets_not_tensors(world2) -> None:
    """24 tensors (3 of at least 256 KiB, 21 small): 3 pieces in place and 1 bucket, plus one exchange of the verdicts.

    Over gloo each unit is a send from the source and a receive on the destination; the exchange is a send of the
    destination's words to group rank 0 and a send of the table back; the destination tells the source with one more
    message that its receives are posted, and with two receipts (the bucket's, the whole transfer's) that it received.
    The first call and a call after the manifest changed also broadcast the manifest (2 broadcasts: its size, then its
    bytes) and share each rank's verdict on it (a second exchange).
    """
    results = world2.run(_count)
    assert results[1]["final"] == results[0]["final"]
    for rank, result in enumerate(results):
        # 4 units from the source; 1 message of the exchange each way; 1 "posted" message and 2 receipts to the source
        moved = (
            {"gloo:send": 4 + 1, "gloo:recv": 1 + 1 + 2} if rank == 0 else {"gloo:send": 1 + 1 + 2, "gloo:recv": 4 + 1}
        )
        agreed = {"gloo:broadcast": 2, "gloo:send": moved["gloo:send"] + 1, "gloo:recv": moved["gloo:recv"] + 1}
        first, steady, changed = result["counts"]
        assert first == agreed
        assert steady == moved
        assert changed == agreed


def _transfer_cuda_over_gloo(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    state, _ = _state(rank)
    # Every other tensor on the GPU: gloo's sends read host memory, so those travel staged through the host buckets.
    state = {name: t.cuda() if i % 2 == 0 else t for i, (name, t) in enumerate(state.items())}
    devices = {name: str(t.device) for name, t in state.items()}
    before = digests(state.items())
    for bucket_bytes in (16384, 1 << 20):
        broadcast_state_dict(state, bucket_bytes=bucket_bytes)
    return {
        "before": before,
        "after": digests(state.items()),
        "devices": devices,
        "devices_after": {name: str(t.device) for name, t in state.items()},
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tensors need a GPU; this machine has none")
def test_cuda_tensors_over_gloo_arrive_bit_identical(world2) -> None:
    source, dst = world2.run(_transfer_cuda_over_gloo)
    assert dst["before"] != source["before"] and dst["after"] == source["before"] == source["after"]
    assert dst["devices_after"] == dst["devices"] == source["devices"] and "cuda:0" in source["devices"].values()


def _instrumented(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    gen = torch.Generator().manual_seed(rank)
    state = {
        "big": torch.randn(*BIG, generator=gen),
        "small": torch.randn(10, generator=gen),
        "ids": torch.arange(7) * rank,
    }
    # Conjugate views on the source into plain destination tensors: a broadcast of the view's bytes refused it, a copy
    # of its memory sent the conjugate.
    small, big = (
        torch.randn(4, generator=gen, dtype=torch.complex64),
        torch.randn(*BIG, generator=gen, dtype=torch.complex64),
    )
    state["cz"], state["cz_big"] = (small.conj(), big.conj()) if rank == 0 else (small, big)
    out = {"sent": digests(state.items())}
    if rank == 0:  # stats on the source only: every member must still choose the same way to move the units
        ctx.enable_stats()
    broadcast_state_dict(state)
    out["after_stats"] = digests(state.items())
    if rank == 0:
        out["stats"] = ctx.stats().get("WEIGHT_TRANSFER", {})
        ctx.disable_stats()
        ctx.reset_stats()
    with torch.no_grad():
        for t in state.values():
            t.add_(rank + 1)
    out["sent_debug"] = digests(state.items())
    ctx.set_debug(True)  # on every rank: each unit's broadcast is fingerprinted
    try:
        broadcast_state_dict(state)
    finally:
        ctx.set_debug(False)
    out["after_debug"] = digests(state.items())
    return out


def test_stats_on_one_rank_and_debug_mode_see_every_unit(world2) -> None:
    source, dst = world2.run(_instrumented)
    assert dst["sent"] != source["sent"] and dst["after_stats"] == source["sent"]
    assert dst["sent_debug"] != source["sent_debug"] and dst["after_debug"] == source["sent_debug"]
    # Three units, each a counted broadcast: "big" in place, "cz_big" staged (a conjugate view), and one bucket of
    # "small", "ids" and "cz" (aligned to 16 bytes).
    stats = source["stats"]
    assert stats["broadcast"]["count"] == 3, stats
    large, small = 300 * 300 * (4 + 8), 10 * 4 + 7 * 8 + 4 * 8
    assert large + small <= stats["broadcast"]["bytes"] <= large + small + 32, stats


def _async_and_threads(rank: int, size: int, url: str) -> dict:
    import torch.distributed as dist

    from rlightning_comm import CommMode, broadcast_state_dict, collective

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    gen = torch.Generator().manual_seed(rank)
    state = {"big": torch.randn(*BIG, generator=gen), "bias": torch.randn(7, generator=gen)}
    sent = digests(state.items())
    handle = broadcast_state_dict(state, async_op=True)
    pending = handle.is_completed()
    other = torch.ones(3)
    collective.all_reduce(other, CommMode.GLOBAL)  # other work on another mode while the transfer is in flight
    handle.wait()
    handle.wait()  # a second wait returns at once
    out = {
        "pending": pending,
        "done": handle.is_completed(),
        "async": digests(state.items()),
        "sent": sent,
        "other": other.tolist(),
    }
    # The next transfer is received from a second live thread (a weight-updater thread), the main thread waiting for it.
    with torch.no_grad():
        for t in state.values():
            t.add_(rank)
    sent, errors = digests(state.items()), []

    def receive() -> None:
        try:
            broadcast_state_dict(state)
        except BaseException as err:  # noqa: BLE001 - reported to the parent below
            errors.append(repr(err))

    if rank == 1:
        updater = threading.Thread(target=receive, name="weight-updater")
        updater.start()
        updater.join(timeout=30)
    else:
        receive()
    dist.barrier()
    return {**out, "errors": errors, "threaded": digests(state.items()), "sent2": sent}


def test_async_handle_and_a_receiving_thread(world2) -> None:
    source, dst = world2.run(_async_and_threads)
    assert source["pending"] is False and dst["pending"] is False
    assert source["done"] and dst["done"]
    assert source["other"] == dst["other"] == [2.0, 2.0, 2.0]
    assert dst["sent"] != source["sent"] and dst["async"] == source["sent"] == source["async"]
    assert source["errors"] == dst["errors"] == []
    assert dst["sent2"] != source["sent2"] and dst["threaded"] == source["sent2"]


def _named_list_with_non_member(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import CommMode, broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=2, dst_ranks=[0, 3])
    gen = torch.Generator().manual_seed(rank)
    named = [("w_t", torch.randn(6, 4, generator=gen).t()), ("ids", torch.arange(5) * (rank + 1))]
    before = digests(named)
    handle = broadcast_state_dict(named, comm_mode=CommMode.WEIGHT_TRANSFER, bucket_bytes=32, async_op=True)
    if handle is not None:
        handle.wait()
    from dataclasses import asdict

    from rlightning_comm import describe_layout

    view = asdict(describe_layout()["WEIGHT_TRANSFER"])
    # On the world, from global rank 3: the source is not group rank 0, which coordinates the handshake.
    world = {"x": torch.randn(300, 300, generator=gen), "y": torch.randn(3, generator=gen)}
    world_before = digests(world.items())
    broadcast_state_dict(world, comm_mode=CommMode.GLOBAL, src=3)
    return {
        "handle": handle is not None,
        "before": before,
        "after": digests(named),
        "view": view,
        "world_before": world_before,
        "world": digests(world.items()),
    }


def test_named_tensor_list_and_non_member(world4) -> None:
    results = world4.run(_named_list_with_non_member)
    assert [r["handle"] for r in results] == [True, False, True, True]  # the non-member (rank 1) gets None
    # Group ranks follow the declared order [src] + dst_ranks: the source is group rank 0; rank 1 is outside (no rank
    # there).
    assert [r["view"] for r in results] == [
        {"ranks": (2, 0, 3), "rank": 1, "world_size": 3, "backend": "gloo"},
        {"ranks": (2, 0, 3), "rank": None, "world_size": 3, "backend": "gloo"},
        {"ranks": (2, 0, 3), "rank": 0, "world_size": 3, "backend": "gloo"},
        {"ranks": (2, 0, 3), "rank": 2, "world_size": 3, "backend": "gloo"},
    ]
    source = results[2]["before"]
    assert results[2]["after"] == source
    assert results[0]["after"] == source and results[3]["after"] == source
    assert results[1]["after"] == results[1]["before"] != source  # the non-member is untouched
    assert [r["world"] for r in results] == [results[3]["world_before"]] * 4
    assert results[0]["world_before"] != results[3]["world_before"]


def _one_bad_rank(rank: int, size: int, url: str, case: str) -> dict:
    import warnings

    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1, 2, 3])
    state = {
        "a": torch.full((3,), float(rank)),
        "b": torch.full((2,), rank, dtype=torch.int64),
        "m": torch.full((2, 3), float(rank)),
        "c": torch.full((3,), -float(rank)),
    }
    broadcast_state_dict(state)  # a good call first: the plan is kept, the bad call must not ride on it
    with torch.no_grad():
        for t in state.values():
            t.fill_(rank)
    kwargs: dict = {}
    if case == "shape" and rank == 2:
        state["a"] = torch.zeros(4)
    if case == "missing" and rank == 3:
        del state["b"]
    if case == "dtype" and rank == 1:
        state["b"] = state["b"].to(torch.int32)
    if case == "source_not_tensor" and rank == 0:
        state["b"] = [1, 2]
    if case == "bucket_zero" and rank == 2:
        kwargs["bucket_bytes"] = 0
    if case == "src_outside" and rank == 3:
        kwargs["src"] = 7
    if case == "src_differs" and rank == 1:
        kwargs["src"] = 1
    if case == "not_a_state_dict" and rank == 3:
        state = "weights.pt"
    if case == "expanded" and rank == 2:  # copy_ into it raised mid-transfer
        state["a"] = torch.zeros(1).expand(3)
    if case == "zero_stride" and rank == 1:
        state["m"] = torch.zeros(3).as_strided((2, 3), (0, 1))
    if case in ("nested_dst", "nested_src") and rank == (3 if case == "nested_dst" else 0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype
            state["a"] = torch.nested.nested_tensor([torch.zeros(1), torch.zeros(2)])
    if case == "meta_src" and rank == 0:
        state["m"] = torch.empty(2, 3, device="meta")
    if case == "overlap" and rank == 1:  # two tensors over the same memory, separate on the source
        base = torch.zeros(7)
        state["m"], state["a"] = base[:6].view(2, 3), base[4:]
    if case == "tied_here" and rank == 2:  # one tensor under two names, two tensors on the source
        state["c"] = state["a"]
    if case == "source_load" and rank == 0:
        state = lambda named: None
    tensors = state.items() if isinstance(state, dict) else ()
    readable = [(k, v) for k, v in tensors if isinstance(v, torch.Tensor) and not v.is_nested and not v.is_meta]
    before = digests(readable)
    try:
        broadcast_state_dict(state, **kwargs)
        error = None
    except (TypeError, ValueError) as err:
        error = (type(err).__name__, str(err))
    untouched = digests(readable) == before
    good = {"a": torch.full((3,), float(rank))}
    broadcast_state_dict(good)  # the group is still in step
    return {"error": error, "untouched": untouched, "after": good["a"].tolist()}


NOT_A_STATE_DICT = (
    "a Mapping of names to tensors, an nn.Module, a list of (name, tensor) or (on a destination) a load callable; got "
    "str"
)


@pytest.mark.parametrize(
    ("case", "kind", "text"),
    [
        (
            "shape",
            "ValueError",
            "rank 2: these tensors do not match the source's (1 differ: 'a': source torch.float32 [3], here "
            "torch.float32 [4])",
        ),
        ("missing", "ValueError", "rank 3: these tensors do not match the source's (1 missing here: b)"),
        ("dtype", "ValueError", "'b': source torch.int64 [2], here torch.int32 [2]"),
        ("source_not_tensor", "TypeError", "rank 0: 'b' must be a torch.Tensor; got list"),
        ("bucket_zero", "ValueError", "rank 2: bucket_bytes must be a positive int; got 0"),
        (
            "src_outside",
            "ValueError",
            "rank 3: src=7 is not a global rank of mode 'WEIGHT_TRANSFER'; expected one of [0, 1, 2, 3]",
        ),
        ("src_differs", "ValueError", "the ranks name different sources (rank 0: 0, rank 1: 1, rank 2: 0, rank 3: 0)"),
        ("not_a_state_dict", "TypeError", f"rank 3: state_dict must be {NOT_A_STATE_DICT}"),
        (
            "expanded",
            "ValueError",
            "rank 2: 'a' (shape [3], strides [0]) has elements that share memory (an expanded or zero-stride view)",
        ),
        ("zero_stride", "ValueError", "rank 1: 'm' (shape [2, 3], strides [0, 1]) has elements that share memory"),
        ("nested_dst", "ValueError", "rank 3: 'a' must be a dense tensor; got a nested tensor"),
        ("nested_src", "ValueError", "rank 0: 'a' must be a dense tensor; got a nested tensor"),
        ("meta_src", "ValueError", "rank 0: 'm' is a meta tensor: it has no data to send"),
        (
            "overlap",
            "ValueError",
            "rank 1: 'm' and 'a' share memory here, but on the source they are not one tied tensor",
        ),
        (
            "tied_here",
            "ValueError",
            "rank 2: 'a' and 'c' are one tensor here, but on the source they are not one tied tensor",
        ),
        ("source_load", "TypeError", "rank 0: the source passed a callable: a load callable is for destinations"),
    ],
)
def test_one_rank_bad_raises_on_every_member_before_any_data_moves(world4, case: str, kind: str, text: str) -> None:
    for r in world4.run(_one_bad_rank, case, timeout=30):
        assert r["error"] is not None and r["error"][0] == kind and text in r["error"][1], r["error"]
        assert r["error"][1].startswith("broadcast_state_dict: nothing was transferred")
        assert r["untouched"]
        assert r["after"] == [0.0, 0.0, 0.0]


def test_bad_arguments_on_a_single_rank(tmp_path) -> None:
    from rlightning_comm import CommContext, ModeNotBoundError, broadcast_state_dict

    CommContext().init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store")
    with pytest.raises(ModeNotBoundError, match="WEIGHT_TRANSFER"):
        broadcast_state_dict({"a": torch.zeros(1)})
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int; got 0"):
        broadcast_state_dict({"a": torch.zeros(1)}, comm_mode="GLOBAL", src=0, bucket_bytes=0)
    with pytest.raises(ValueError, match=r"src=3 is not a global rank of mode 'GLOBAL'; expected one of \[0\]"):
        broadcast_state_dict({"a": torch.zeros(1)}, comm_mode="GLOBAL", src=3)


def _declared_source(rank: int, size: int, url: str) -> int:
    from rlightning_comm import CommError, broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=1, dst_ranks=[0])
    assert (
        ctx.get_transfer_source() == 1 and ctx.get_local_rank("WEIGHT_TRANSFER") == 1 - rank
    )  # the source is group rank 0
    with pytest.raises(
        CommError, match=r"rank 0 is declared in two different groups, \[1, 0\] \(declared before\) and \[0, 1\]"
    ):
        ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    t = torch.full((3,), float(rank))
    broadcast_state_dict({"t": t})  # the default src is the declared source
    assert t.tolist() == [1.0, 1.0, 1.0]
    ctx.init_group([0, 1], "OTHER")
    with pytest.raises(ValueError, match="src is required: mode 'OTHER' was not bound by init_weight_transfer_group"):
        broadcast_state_dict({"t": t}, comm_mode="OTHER")
    return ctx.get_transfer_source()


def test_default_source_is_the_declared_one(world2) -> None:
    assert world2.run(_declared_source) == [1, 1]


def _source_stages_more(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    gen = torch.Generator().manual_seed(rank)
    # Buckets of 1 KiB: two small tensors fill the first bucket, the third opens the last one. The large tensor travels
    # in place here but is staged on the source (transposed there): the source needs the first bucket's receipt before
    # it can send it, while this rank posted every receive at once.
    state = {f"small{i}": torch.randn(100, generator=gen) for i in range(3)}
    big = torch.randn(64, 64, generator=gen)
    state["big"] = big.t().contiguous().t() if rank == 0 else big
    broadcast_state_dict(state, bucket_bytes=1024)
    return digests(state.items())


def test_a_source_that_stages_more_than_a_destination_gets_its_receipts(world2) -> None:
    source, destination = world2.run(_source_stages_more, timeout=30)
    assert destination == source
