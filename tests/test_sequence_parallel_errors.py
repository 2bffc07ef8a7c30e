"""Bad input to the sequence-parallel ops: a clear error on every rank, before any collective could hang a peer.

Cross-rank disagreements (which no local check can see) are debug mode's: tests/test_sequence_parallel_hot_path.py.
"""

from __future__ import annotations

import pytest
from sp_oracle import SP, init_sp


def _cases(rank: int, only_rank0_pg) -> dict:
    import torch

    import rlightning_comm.sequence_parallel as sp

    x = torch.zeros(2, 3, 4, 2)
    odd_heads = torch.zeros(2, 3, 3, 2)

    def wrong_shape_attn(q, k, v):
        return q[:, :1]

    return {
        "scatter_dim not divisible": lambda: sp.all_to_all(odd_heads, 1, 2, SP),
        "equal dims": lambda: sp.all_to_all(x, 1, -3, SP),
        "dim out of range": lambda: sp.all_to_all(x, 1, 4, SP),
        "float dim": lambda: sp.all_to_all(x, 1.0, 2, SP),
        "not a tensor": lambda: sp.all_to_all([1.0, 2.0], 0, 1, SP),
        "group None": lambda: sp.all_to_all(x, 1, 2, None),
        "group int": lambda: sp.all_to_all(x, 1, 2, 3),
        "unbound mode": lambda: sp.all_to_all(x, 1, 2, "NO_SUCH_MODE"),
        "gather_sizes length": lambda: sp.all_to_all(x, 1, 2, SP, gather_sizes=[3]),
        "gather_sizes mine": lambda: sp.all_to_all(x, 1, 2, SP, gather_sizes=[5, 5]),
        "gather_sizes type": lambda: sp.all_to_all(x, 1, 2, SP, gather_sizes=torch.tensor([3, 3])),
        "scatter_sizes sum": lambda: sp.all_to_all(x, 1, 2, SP, scatter_sizes=[1, 1]),
        "rank0_only not bool": lambda: sp.scatter_to_sequence_parallel_region(x, "yes"),
        "legacy not bool": lambda: sp.gather_from_sequence_parallel_region(x, True, legacy_grad_scale=1),
        "seq_lens sum": lambda: sp.scatter_to_sequence_parallel_region(x, seq_lens=[1, 1]),
        "seq_lens negative": lambda: sp.reduce_scatter_to_sequence_parallel_region(x, seq_lens=[-1, 4]),
        "gather dim out of range": lambda: sp.gather_from_sequence_parallel_region(x, dim=7),
        "ulysses heads": lambda: sp.ulysses_attention(odd_heads, odd_heads, odd_heads),
        "ulysses 3 dims": lambda: sp.ulysses_attention(x[0], x[0], x[0]),
        "ulysses lengths": lambda: sp.ulysses_attention(x, x[:, :2], x[:, :2]),
        "ulysses attn_fn": lambda: sp.ulysses_attention(x, x, x, "sdpa"),
        "ulysses attn_fn output": lambda: sp.ulysses_attention(x, x, x, wrong_shape_attn),
        "not a member (mode)": lambda: sp.gather_from_sequence_parallel_region(x, mode="ONLY_RANK0"),
        "not a member (ProcessGroup)": lambda: sp.all_to_all(x, 1, 2, only_rank0_pg),
    }


def _task_errors(rank: int, size: int, url: str) -> dict[str, tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from rlightning_comm.sequence_parallel import all_to_all

    ctx = init_sp(rank, size, url)
    ctx.init_group([0], "ONLY_RANK0")
    only_rank0_pg = dist.new_group([0])
    out: dict[str, tuple[str, str]] = {}
    for name, call in _cases(rank, only_rank0_pg).items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as err:  # noqa: BLE001 - the parent checks type and message
            out[name] = (type(err).__name__, str(err))
    # Nobody was left inside a collective: a real one still lines up and is right.
    x = torch.arange(8.0).view(1, 2, 4) + 10 * rank
    y = all_to_all(x, 1, 2, "SEQUENCE_PARALLEL")
    out["still in step"] = (
        "ok"
        if torch.equal(
            y,
            torch.cat([torch.arange(8.0).view(1, 2, 4)[..., 2 * rank : 2 * rank + 2] + 10 * r for r in range(size)], 1),
        )
        else "wrong",
        "",
    )
    return out


EXPECTED = {
    "scatter_dim not divisible": ("ValueError", ["scatter_dim 2 has size 3", "group size 2"]),
    "equal dims": ("ValueError", ["must differ"]),
    "dim out of range": ("ValueError", ["scatter_dim=4", "out of range"]),
    "float dim": ("TypeError", ["gather_dim must be an int"]),
    "not a tensor": ("TypeError", ["input_ must be a torch.Tensor", "list"]),
    "group None": ("TypeError", ["group must be a CommMode", "NoneType"]),
    "group int": ("TypeError", ["group must be a CommMode", "int"]),
    "unbound mode": ("ModeNotBoundError", ["NO_SUCH_MODE", "bound modes"]),
    "gather_sizes length": ("ValueError", ["gather_sizes must hold 2"]),
    "gather_sizes mine": ("ValueError", ["this rank's input length along dim 1, 3", "got 5"]),
    "gather_sizes type": ("TypeError", ["gather_sizes must be a list"]),
    "scatter_sizes sum": ("ValueError", ["scatter_sizes must sum to", "4"]),
    "rank0_only not bool": ("TypeError", ["rank0_only must be a bool"]),
    "legacy not bool": ("TypeError", ["legacy_grad_scale must be a bool"]),
    "seq_lens sum": ("ValueError", ["seq_lens must sum to", "3"]),
    "seq_lens negative": ("ValueError", ["non-negative"]),
    "gather dim out of range": ("ValueError", ["dim=7"]),
    "ulysses heads": ("ValueError", ["3 heads", "group size 2"]),
    "ulysses 3 dims": ("ValueError", ["4 dims"]),
    "ulysses lengths": ("ValueError", ["local sequence length"]),
    "ulysses attn_fn": ("TypeError", ["attn_fn must be callable"]),
    "ulysses attn_fn output": ("ValueError", ["attn_fn must return"]),
    "still in step": ("ok", [""]),
}


def test_bad_input_raises_clearly_on_every_rank_without_hanging(world2) -> None:
    results = world2.run(_task_errors, timeout=60)
    for rank, got in enumerate(results):
        for name, (kind, fragments) in EXPECTED.items():
            assert got[name][0] == kind, f"rank {rank}, {name}: expected {kind}, got {got[name]}"
            for fragment in fragments:
                assert fragment in got[name][1], f"rank {rank}, {name}: {fragment!r} not in {got[name][1]!r}"
    # Rank 0 alone is the group ONLY_RANK0 (size 1: the identity); rank 1 is not a member and is told so.
    assert results[0]["not a member (mode)"][0] == "no error"
    assert (
        results[1]["not a member (mode)"][0] == "CommError" and "not a member" in results[1]["not a member (mode)"][1]
    )
    assert results[1]["not a member (ProcessGroup)"][0] == "CommError"


def _task_peer_skips(rank: int, size: int, url: str) -> tuple[str, str]:
    import torch
    from world import init_world

    from rlightning_comm.sequence_parallel import all_to_all

    ctx = init_world(rank, size, url, timeout=2)
    ctx.init_group(list(range(size)), SP)
    if rank == 1:
        return ("skipped", "")  # rank 1 never joins: rank 0 must fail within the group's timeout, not hang
    try:
        all_to_all(torch.zeros(1, 2, 4, 2), 1, 2, SP, gather_sizes=[2, 2])
    except Exception as err:  # noqa: BLE001 - the parent checks type and message
        return (type(err).__name__, str(err))
    return ("no error", "")


def test_a_peer_that_never_joins_fails_with_the_library_error(world2) -> None:
    # A timeout if rank 1 is still connected, a broken-group error once it has left: both are the library's CommError.
    kind, message = world2.run(_task_peer_skips, timeout=60)[0]
    assert kind in ("CommTimeoutError", "CommError"), (kind, message)
    assert "all_to_all_single on mode 'SEQUENCE_PARALLEL'" in message, message


def test_sequence_split_sizes_rejects_negative_length() -> None:
    from rlightning_comm.sequence_parallel import sequence_split_sizes

    with pytest.raises(ValueError, match="length=-1"):
        sequence_split_sizes(-1, 2)
