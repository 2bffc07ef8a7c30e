"""Seeded fuzzing of broadcast_state_dict on 4 gloo ranks: random layouts, views and options, with one bad rank in some
cases.

Every case's structure (names, dtypes, shapes, each rank's layout, which rank is bad and how) comes from one seed that
every rank shares; the values differ per rank. A good case must leave every destination (in place, or a ``load``
callable that keeps copies) holding the source's logical values bit for bit, the source untouched. A bad case (an
expanded, zero-stride, overlapping, nested, meta or mismatched tensor on one rank) must raise the same error type on
every rank, write nothing, and leave the group in step for the next case. All cases run in one task on one world.
"""

from __future__ import annotations

import math
import random
import warnings

import torch
from test_weight_transfer import digests
from world import init_world

CASES = 40
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
SOURCE_LAYOUTS = ("plain", "transposed", "strided", "view of", "conj", "neg", "expanded", "tied")
DEST_LAYOUTS = ("plain", "transposed", "strided", "conj", "neg", "inference")
DIRECT = 256 * 2**10  # a piece of at least this many bytes travels in place (with a larger bucket)
BAD = ("expanded", "zero stride", "overlap", "nested", "meta", "shape", "nested source", "meta source")


def _values(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)


def _laid_out(shape, dtype, layout, gen) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose memory is laid out as ``layout`` says (random values)."""
    if layout == "transposed" and len(shape) >= 2:
        return _values((*shape[:-2], shape[-1], shape[-2]), dtype, gen).transpose(-1, -2)
    if layout == "strided" and len(shape) >= 1:
        return _values((*shape[:-1], 2 * shape[-1]), dtype, gen)[..., ::2]
    if layout == "conj" and dtype.is_complex:
        return _values(shape, dtype, gen).conj()
    if layout == "neg" and dtype.is_floating_point:
        return torch._neg_view(_values(shape, dtype, gen))
    if layout == "expanded" and len(shape) >= 1:
        return _values((*shape[:-1], 1), dtype, gen).expand(shape)
    if layout == "inference":
        with torch.inference_mode():
            return _values(shape, dtype, gen)
    return _values(shape, dtype, gen)


def _case(seed: int, rank: int) -> dict:
    """Case ``seed`` as rank ``rank`` builds it: its state (or load callable), and what every rank must see."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    n = rng.randint(1, 7)
    bucket_bytes = rng.choice([64, 1024, 16384, 1 << 20])
    specs = []
    for i in range(n):
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 6) for _ in range(rng.randint(0, 3)))
        if (
            rng.random() < 0.2 and bucket_bytes >= 16384
        ):  # with a small bucket, a unit per few elements: slow, and no new case
            shape = (
                (rng.randint(200, 400), 300) if bucket_bytes > DIRECT else (rng.randint(5, 30), 300)
            )  # in place, or cut in pieces
        layout = rng.choice(SOURCE_LAYOUTS)
        if layout == "tied" and specs:  # the very same tensor as the first one: every rank holds that dtype and shape
            dtype, shape = specs[0][1], specs[0][2]
        specs.append(
            (
                f"t{i}.{str(dtype).removeprefix('torch.')}",
                dtype,
                shape,
                layout,
                [rng.choice(DEST_LAYOUTS) for _ in range(4)],
            )
        )
    bad = rng.choice(BAD) if rng.random() < 0.4 else None
    if bad in ("expanded", "zero stride", "overlap") and not any(math.prod(spec[2]) > 1 for spec in specs):
        bad = "shape"  # those need a tensor of more than one element
    bad_rank = 0 if bad is not None and bad.endswith("source") else rng.randint(1, 3)
    loader = rng.choice([r for r in (1, 2, 3) if r != bad_rank]) if rng.random() < 0.3 else None
    options = {"bucket_bytes": bucket_bytes, "async_op": rng.random() < 0.3}
    stats = rng.random() < 0.2
    state: dict[str, torch.Tensor] = {}
    for name, dtype, shape, src_layout, dst_layouts in specs:
        if rank == 0:
            if src_layout == "tied" and state:
                state[name] = state[specs[0][0]]
                continue
            if src_layout == "view of" and shape and shape[0] > 0:
                base = _values((shape[0] + 2, *shape[1:]), dtype, gen)
                state[name] = base[1 : shape[0] + 1]
                continue
            state[name] = _laid_out(shape, dtype, src_layout, gen)
        else:
            state[name] = _laid_out(shape, dtype, dst_layouts[rank], gen)
    if bad is not None and rank == bad_rank:
        _break(state, bad, gen)
    return {
        "state": state,
        "bad": bad,
        "bad_rank": bad_rank,
        "loader": loader,
        "options": options,
        "stats": stats,
        "specs": specs,
    }


def _break(state: dict, bad: str, gen) -> None:
    name, t = next(
        (k, v)
        for k, v in state.items()
        if v.numel() > 1 or bad in ("nested", "meta", "shape", "nested source", "meta source")
    )
    if bad == "expanded":
        state[name] = torch.zeros(1, dtype=t.dtype).expand(t.shape)
    elif bad == "zero stride":  # stride 0 on the first dimension of more than one element, contiguous elsewhere
        k = next(d for d, n in enumerate(t.shape) if n > 1)
        strides = list(torch.empty(*t.shape[:k], 1, *t.shape[k + 1 :]).stride())
        strides[k] = 0
        state[name] = torch.zeros(t.numel() // t.shape[k], dtype=t.dtype).as_strided(t.shape, strides)
    elif bad == "overlap":
        other = next((k for k in state if k != name and state[k].numel()), None)
        flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
        state[name] = flat[: t.numel()].view(t.shape)
        if other is None or state[other].dtype != t.dtype or state[other].numel() > t.numel():
            state[name + ".again"] = flat[1:].view(t.shape)  # a name the source lacks: refused too, as a mismatch
        else:
            state[other] = flat[1 : 1 + state[other].numel()].view(state[other].shape)
    elif bad in ("nested", "nested source"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state[name] = torch.nested.nested_tensor([torch.zeros(1), torch.zeros(2)])
    elif bad in ("meta", "meta source"):
        state[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    elif bad == "shape":
        state[name] = torch.zeros((*t.shape, 2), dtype=t.dtype)


def _is_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_nested and not t.is_meta


def _fuzz(rank: int, size: int, url: str, first: int, cases: int) -> list:
    from rlightning_comm import WeightSyncReport, broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1, 2, 3])
    out = []
    for seed in range(first, first + cases):
        case = _case(seed, rank)
        state = case["state"]
        if case["stats"]:
            ctx.enable_stats()
        before = digests((k, v) for k, v in state.items() if _is_tensor(v))
        loaded: dict[str, torch.Tensor] = {}

        def load(named, loaded=loaded) -> None:
            for name, t in named:
                assert name not in loaded, name
                loaded[name] = t.clone()

        arg = load if rank == case["loader"] else state
        outcome: tuple = ("ok",)
        try:
            handle = broadcast_state_dict(arg, **case["options"])
            if not isinstance(handle, WeightSyncReport):  # async_op: the handle's wait() returns the report
                handle.wait()
        except (TypeError, ValueError) as err:
            outcome = ("refused", type(err).__name__)
        finally:
            if case["stats"]:
                ctx.disable_stats()
                ctx.reset_stats()
        after = digests(loaded.items()) if arg is load else digests((k, v) for k, v in state.items() if _is_tensor(v))
        # The group is still in step: a small good transfer after every case.
        check = {"x": torch.full((3,), float(rank))}
        broadcast_state_dict(check)
        out.append(
            {
                "seed": seed,
                "bad": case["bad"],
                "outcome": outcome,
                "before": before,
                "after": after,
                "check": check["x"].tolist(),
            }
        )
    return out


def test_fuzzed_layouts_arrive_bit_identical_and_bad_ranks_raise_everywhere(world4) -> None:
    results = world4.run(_fuzz, 1000, CASES, timeout=240)
    kinds = {"ok": 0, "refused": 0}
    for k in range(CASES):
        per_rank = [r[k] for r in results]
        source = per_rank[0]
        assert all(r["check"] == [0.0, 0.0, 0.0] for r in per_rank), per_rank
        assert source["after"] == source["before"], source  # the source is only read
        outcomes = {r["outcome"] for r in per_rank}
        assert len(outcomes) == 1, (source["seed"], source["bad"], outcomes)
        outcome = outcomes.pop()
        kinds[outcome[0]] += 1
        if source["bad"] is not None:
            assert outcome[0] == "refused", (source["seed"], source["bad"], outcome)
            for r in per_rank[1:]:
                assert r["after"] == r["before"] or r["after"] == {}, (
                    source["seed"],
                    "a refused case wrote a destination",
                )
            continue
        assert outcome == ("ok",), (source["seed"], outcome)
        for rank, r in enumerate(per_rank[1:], start=1):
            assert r["after"] == source["before"], (
                source["seed"],
                rank,
                {n for n in source["before"] if r["after"].get(n) != source["before"][n]},
            )
    assert kinds["ok"] >= CASES // 3 and kinds["refused"] >= 4, kinds
