"""broadcast_state_dict into a ``load`` callable: an engine with fused weights loads a trainer's unfused names, in two
buffers."""

from __future__ import annotations

import itertools

import torch
from test_weight_transfer import digests
from torch import nn
from typing_extensions import Self
from world import init_world

from rlightning_comm.weights._plan import build_plan, deliveries

LAYERS, WIDTH, VOCAB = 6, 48, 700
BUCKET = 32 * 2**10  # the model is about 17 buckets; the embedding (134 KB) is larger than one


class Trainer(nn.Module):
    """Unfused attention projections, as a trainer holds them; the output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList()
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.q_proj, layer.k_proj, layer.v_proj = (
                nn.Linear(WIDTH, WIDTH, bias=False),
                nn.Linear(WIDTH, WIDTH),
                nn.Linear(WIDTH, WIDTH),
            )
            layer.o_proj = nn.Linear(WIDTH, WIDTH)
            self.layers.append(layer)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


class Engine(nn.Module):
    """The inference engine's layout: q, k and v in one fused projection (as vLLM's QKVParallelLinear), loaded by
    name."""

    STACKED = (("q_proj", 0), ("k_proj", 1), ("v_proj", 2))

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList()
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.qkv_proj = nn.Linear(WIDTH, 3 * WIDTH)
            layer.o_proj = nn.Linear(WIDTH, WIDTH)
            self.layers.append(layer)
        self.norm = nn.LayerNorm(WIDTH)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.calls: list[list[str]] = []

    def load_weights(self, weights) -> None:
        """vLLM's shape: an iterable of (name, tensor); each unfused projection goes to its slice of the fused one."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        names = []
        with torch.no_grad():
            for name, tensor in weights:
                names.append(name)
                if name == "lm_head.weight":
                    continue  # tied to the embedding here too
                for part, shard in self.STACKED:
                    if f".{part}." in name:  # weight rows or bias entries of its shard
                        params[name.replace(part, "qkv_proj")][shard * WIDTH : (shard + 1) * WIDTH].copy_(tensor)
                        break
                else:
                    params[name].copy_(tensor)
        self.calls.append(names)


def _engine_view(engine: Engine) -> dict[str, torch.Tensor]:
    """The engine's weights under the trainer's names (the oracle's side), q/k/v cut back out of the fused
    projection."""
    out = {
        "embed.weight": engine.embed.weight,
        "lm_head.weight": engine.embed.weight,
        "norm.weight": engine.norm.weight,
        "norm.bias": engine.norm.bias,
    }
    out["steps"] = engine.steps
    for i, layer in enumerate(engine.layers):
        for part, shard in Engine.STACKED:
            out[f"layers.{i}.{part}.weight"] = layer.qkv_proj.weight[shard * WIDTH : (shard + 1) * WIDTH]
            if part != "q_proj":
                out[f"layers.{i}.{part}.bias"] = layer.qkv_proj.bias[shard * WIDTH : (shard + 1) * WIDTH]
        out[f"layers.{i}.o_proj.weight"], out[f"layers.{i}.o_proj.bias"] = layer.o_proj.weight, layer.o_proj.bias
    return out


class _Allocations:
    """Every uint8 ``torch.empty`` of at least 1 KiB while active: the staging buffers the transfer allocates."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __enter__(self) -> Self:
        self._empty = torch.empty

        def empty(*args, **kwargs):
            t = self._empty(*args, **kwargs)
            if t.dtype == torch.uint8 and t.numel() >= 1024:
                self.sizes.append(t.numel())
            return t

        torch.empty = empty
        return self

    def __exit__(self, *exc) -> None:
        torch.empty = self._empty


def _sync(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1, 2, 3])
    torch.manual_seed(rank)
    out: dict = {}
    trainer, engine = (Trainer(), None) if rank in (0, 3) else (None, Engine())
    for step in range(2):
        if rank == 0:  # a training step changes every weight
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)
                trainer.steps.fill_(step + 1)
        with _Allocations() as allocations:
            if (
                trainer is not None
            ):  # the source, and a destination that loads in place: the two kinds mix in one transfer
                broadcast_state_dict(trainer, bucket_bytes=BUCKET)
            elif rank == 1:
                broadcast_state_dict(engine.load_weights, bucket_bytes=BUCKET)
            else:  # async, waited from the same thread
                broadcast_state_dict(engine.load_weights, bucket_bytes=BUCKET, async_op=True).wait()
        out[f"step{step}"] = digests((trainer.state_dict() if trainer is not None else _engine_view(engine)).items())
        out[f"alloc{step}"] = allocations.sizes
    if engine is not None:
        out["calls"] = engine.calls
    out["model_bytes"] = sum(t.nbytes for t in Trainer().state_dict().values())
    # A load that raises on its second bucket: only that rank raises (once the transfer is complete, the bucket in a
    # note).
    failing = Engine()

    def load(weights) -> None:
        if failing.calls:
            raise RuntimeError("engine refused a weight")
        failing.load_weights(weights)

    try:
        broadcast_state_dict(
            trainer if trainer is not None else load if rank == 2 else failing.load_weights, bucket_bytes=BUCKET
        )
        out["raised"] = None
    except RuntimeError as err:
        out["raised"] = [str(err), *getattr(err, "__notes__", [])]
    check = {"x": torch.full((2,), float(rank))}
    broadcast_state_dict(check)  # the group is in step
    out["check"] = check["x"].tolist()
    return out


def test_a_fused_engine_loads_the_trainers_names_within_two_buffers(world4) -> None:
    trainer, engine, engine_async, in_place = world4.run(_sync, timeout=120)
    assert trainer["step0"] != trainer["step1"]
    for step in ("step0", "step1"):
        assert in_place[step] == trainer[step]
        for r in (engine, engine_async):
            assert r[step] == trainer[step], {n for n in trainer[step] if r[step].get(n) != trainer[step][n]}
    names = sorted(trainer["step0"])
    assert trainer["model_bytes"] > 12 * BUCKET
    embed_bytes = VOCAB * WIDTH * 4
    for r in (engine, engine_async):
        calls = r["calls"]
        half = len(calls) // 2
        assert (
            len(calls) == 2 * half and sorted(n for c in calls[:half] for n in c) == names
        )  # every name once per sync
        # Two staging buffers on the first sync, none after: at most a bucket each, or one tensor larger than a bucket.
        assert len(r["alloc0"]) <= 2 and sum(r["alloc0"]) <= BUCKET + embed_bytes, r["alloc0"]
        assert r["alloc1"] == [], r["alloc1"]
        # The embedding (larger than a bucket) comes alone with its tied head.
        assert ["embed.weight", "lm_head.weight"] in calls[:half], calls[:half]
    assert [r["raised"] for r in (trainer, engine, in_place)] == [None, None, None]
    raised = engine_async["raised"]
    assert (
        raised[0] == "engine refused a weight"
        and "load raised on bucket 2 of" in raised[1]
        and "the transfer completed" in raised[1]
    ), raised
    assert [r["check"] for r in (trainer, engine, engine_async, in_place)] == [[0.0, 0.0]] * 4


def test_deliveries_cover_every_name_once_in_buffers_of_at_most_a_bucket() -> None:
    manifest = [
        ("small", "torch.float32", (10,), -1),
        ("big", "torch.float32", (300, 300), -1),  # 360 KB: in place for an in-place destination, cut in pieces here
        ("empty", "torch.int64", (0, 3), -1),
        ("tied", "torch.float32", (10,), 0),
        ("scalar", "torch.bfloat16", (), -1),
        ("mid", "torch.float16", (100, 100), -1),
    ]
    bucket = 64 * 2**10
    plan = build_plan(manifest, bucket)
    out = deliveries(plan)
    given = [manifest[index][0] for d in out for index, _ in d.tensors]
    assert sorted(given) == sorted(e[0] for e in manifest)
    assert [u for d in out for u in d.units] == list(range(len(plan.units)))  # every unit once, in order
    for d in out:
        names = {manifest[index][0] for index, _ in d.tensors} - {"empty"}  # no bytes: it goes with the first delivery
        assert d.nbytes <= bucket or names == {"big"}, (names, d.nbytes)
        spans = sorted((at, at + plan.units[u].nbytes) for u, at in zip(d.units, d.offsets))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and (
            not spans or spans[-1][1] <= d.nbytes
        )  # units do not overlap
    big = next(d for d in out if {manifest[i][0] for i, _ in d.tensors} - {"empty"} == {"big"})
    assert big.nbytes == 300 * 300 * 4 and big.offsets[0] == 0 and list(big.offsets) == sorted(big.offsets)
    tied = next(d for d in out if any(manifest[i][0] == "tied" for i, _ in d.tensors))
    offsets = {manifest[i][0]: at for i, at in tied.tensors}
    assert offsets["tied"] == offsets["small"]  # the same view, in the same call
