"""broadcast_state_dict into a ``load`` callable: an engine with fused weights loads a trainer's unfused names, in two
buffers."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_weight_transfer import digests
from torch import nn
from typing_extensions import Self
from world import init_world

from rlightning_comm.weights.broadcast._plan import build_plan, deliveries

LAYERS, WIDTH, VOCAB = 6, 48, 700
BUCKET = 32 * 2**10  # the model is about 17 buckets; the embedding (134 KB) and each layer (37 KB) are larger than one
# Two syncs at BUCKET, then buckets smaller than every weight (each cut in pieces) and one bucket for the whole model.
BUCKETS = (BUCKET, BUCKET, 1024, 64 * 2**20)


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
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # fused name -> the shards it holds so far
        self.open_after: list[list[str]] = []  # fused weights still waiting for a shard when a call returned

    def load_weights(self, weights) -> None:
        """vLLM's shape and its layer-by-layer habit: an iterable of (name, tensor); the unfused projections go to their
        slices of the fused one once all of them have arrived, the tensors kept as given until then (across calls, if a
        layer were split over two)."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        names = []
        with torch.no_grad():
            for name, tensor in weights:
                names.append(name)
                if name == "lm_head.weight":
                    continue  # tied to the embedding here too
                for part, shard in self.STACKED:
                    if f".{part}." in name:  # weight rows or bias entries of its shard
                        fused = name.replace(part, "qkv_proj")
                        waiting = self.pending.setdefault(fused, {})
                        waiting[shard] = tensor  # a reference, not a copy
                        if len(waiting) == (3 if fused.endswith("weight") else 2):  # q_proj has no bias
                            for k, kept in self.pending.pop(fused).items():
                                params[fused][k * WIDTH : (k + 1) * WIDTH].copy_(kept)
                        break
                else:
                    params[name].copy_(tensor)
        self.calls.append(names)
        self.open_after.append(sorted(self.pending))


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
    for step, bucket in enumerate(BUCKETS):
        if rank == 0:  # a training step changes every weight
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)
                trainer.steps.fill_(step + 1)
        with _Allocations() as allocations:
            if (
                trainer is not None
            ):  # the source, and a destination that loads in place: the two kinds mix in one transfer
                broadcast_state_dict(trainer, bucket_bytes=bucket)
            elif rank == 1:
                broadcast_state_dict(engine.load_weights, bucket_bytes=bucket)
            else:  # async, waited from the same thread
                broadcast_state_dict(engine.load_weights, bucket_bytes=bucket, async_op=True).wait()
        out[f"step{step}"] = digests((trainer.state_dict() if trainer is not None else _engine_view(engine)).items())
        out[f"alloc{step}"] = allocations.sizes
        out[f"calls{step}"] = len(engine.calls) if engine is not None else 0
    if engine is not None:
        out["calls"], out["open_after"] = engine.calls, engine.open_after
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
    steps = [f"step{k}" for k in range(len(BUCKETS))]
    assert len({str(trainer[step]) for step in steps}) == len(steps)  # every sync moves new weights
    for step in steps:
        assert in_place[step] == trainer[step]
        for r in (engine, engine_async):
            assert r[step] == trainer[step], (step, {n for n in trainer[step] if r[step].get(n) != trainer[step][n]})
    names = sorted(trainer["step0"])
    assert trainer["model_bytes"] > 12 * BUCKET
    embed_bytes = VOCAB * WIDTH * 4
    layer_bytes = (4 * WIDTH * WIDTH + 3 * WIDTH) * 4  # q, k, v, o and three biases
    assert layer_bytes > BUCKET
    for r in (engine, engine_async):
        calls = r["calls"]
        ends = [r[step.replace("step", "calls")] for step in steps]
        for lo, hi in itertools.pairwise([0, *ends]):
            assert sorted(n for c in calls[lo:hi] for n in c) == names  # every name once per sync
        first = calls[: ends[0]]
        # The engine kept the shards of a fused weight across calls if they came apart; they never did: every layer came
        # in one call, at every bucket size.
        assert r["open_after"] == [[]] * len(calls), r["open_after"]
        for call in calls:
            for i in {n.split(".")[1] for n in call if n.startswith("layers.")}:
                assert sum(n.startswith(f"layers.{i}.") for n in call) == 7, call
        # Two staging buffers on the first sync, none after: at most a bucket each, or one layer larger than a bucket.
        assert len(r["alloc0"]) <= 2 and sum(r["alloc0"]) <= embed_bytes + layer_bytes, r["alloc0"]
        assert r["alloc1"] == [], r["alloc1"]
        # The embedding (larger than a bucket) comes alone with its tied head.
        assert ["embed.weight", "lm_head.weight"] in first, first
    assert [r["raised"] for r in (trainer, engine, in_place)] == [None, None, None]
    raised = engine_async["raised"]
    assert (
        raised[0] == "engine refused a weight"
        and "load raised on bucket 2 of" in raised[1]
        and "the transfer completed" in raised[1]
    ), raised
    assert [r["check"] for r in (trainer, engine, engine_async, in_place)] == [[0.0, 0.0]] * 4


@pytest.mark.parametrize("bucket", [64, 1024, 64 * 2**10, 2**20])
def test_deliveries_hand_over_whole_layers_in_buffers_of_at_most_a_bucket(bucket: int) -> None:
    manifest = [
        ("head.small", "torch.float32", (10,), -1),
        ("blocks.0.big", "torch.float32", (300, 300), -1),  # 360 KB: cut in pieces below 1 MiB buckets
        ("blocks.1.a", "torch.float32", (10,), -1),
        ("blocks.0.empty", "torch.int64", (0, 3), -1),
        ("head.tied", "torch.float32", (10,), 0),
        ("blocks.0.scalar", "torch.bfloat16", (), -1),
        ("blocks.1.mid", "torch.float16", (100, 100), -1),
        ("blocks.0.late", "torch.float32", (20,), -1),  # after a tensor of block 1 in the source's order
        ("blocks.2.experts.3.w", "torch.float32", (4, 4), -1),
    ]
    layer = {"head": "head", "blocks.0": "blocks.0", "blocks.1": "blocks.1", "blocks.2": "blocks.2"}
    layer_of = {e[0]: next(v for k, v in layer.items() if e[0].startswith(k + ".")) for e in manifest}
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=gen).to(getattr(torch, dtype[6:])) for _, dtype, shape, _ in manifest]
    values[4] = values[0]
    plan = build_plan(manifest, bucket, layered=True)
    out = deliveries(plan)
    assert [u for d in out for u in d.units] == list(range(len(plan.units)))  # every unit once, in order
    given = [manifest[index][0] for d in out for index, _ in d.tensors]
    assert sorted(given) == sorted(e[0] for e in manifest)  # every name once
    layer_bytes: dict[str, int] = {}
    for (name, _, _, alias), v in zip(manifest, values):
        if alias < 0:
            layer_bytes[layer_of[name]] = layer_bytes.get(layer_of[name], 0) + v.nbytes
    for d in out:
        layers = {layer_of[manifest[index][0]] for index, _ in d.tensors if manifest[index][3] < 0}
        assert d.nbytes <= bucket or len(layers) == 1, (layers, d.nbytes)
        assert d.nbytes <= max(bucket, max(layer_bytes.values())) + 16 * len(manifest)
        # Receive as the load pipeline does: each unit's pieces at the unit's offset; then read each tensor back.
        buffer = torch.zeros(d.nbytes, dtype=torch.uint8)
        written = torch.zeros(d.nbytes, dtype=torch.int64)
        for u, at in zip(d.units, d.offsets):
            for piece in plan.units[u].pieces:
                source = values[piece.index][piece.where] if piece.where else values[piece.index]
                buffer[at + piece.at : at + piece.at + piece.nbytes] = source.contiguous().view(-1).view(torch.uint8)
                written[at + piece.at : at + piece.at + piece.nbytes] += 1
        assert d.nbytes == 0 or int(written.max()) <= 1  # no two pieces overlap
        for index, at in d.tensors:
            v = values[index]
            got = buffer[at : at + v.nbytes].view(v.dtype).view(v.shape)
            assert torch.equal(got, v), manifest[index][0]
    for name in layer_of.values():  # each layer in exactly one delivery
        holders = [k for k, d in enumerate(out) for index, _ in d.tensors if layer_of[manifest[index][0]] == name]
        assert len(set(holders)) == 1, (name, holders)


def test_many_small_layers_share_buckets() -> None:
    # 100 layers of 400 B: a bucket per layer would cost the source a receipt each; whole layers share buckets instead.
    manifest = [(f"blocks.{i}.norm.weight", "torch.float32", (100,), -1) for i in range(100)]
    plan = build_plan(manifest, 16 * 2**10, layered=True)
    assert len(plan.units) == 3  # 40 layers (16000 B) a bucket
    assert [len(d.tensors) for d in deliveries(plan)] == [40, 40, 20]
