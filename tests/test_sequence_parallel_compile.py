"""torch.compile(fullgraph=True) of every sequence-parallel op and ulysses_attention on 2 gloo ranks: forward values
and gradients equal eager (float64), with the default lengths and with explicit uneven ones.

One block holds every op, each on its own input with its own output, and one graph holds the block twice (default and
uneven lengths), so one compile per backend covers every op while each op's forward and gradient are still compared
alone (inductor compiles are slow: one in the suite).
"""

from __future__ import annotations

import pytest
import torch
from sp_oracle import SP, Checks, assert_all_within, data

TOL = 1e-9
# (per-rank local lengths along the sequence or None for the defaults, the full length the scatters split)
CONFIGS = {"default": (None, 6), "uneven": ([3, 1], 4)}


def _block(xs: dict[str, torch.Tensor], lens: list[int] | None) -> dict[str, torch.Tensor]:
    """Every op on its own input; ``lens`` given explicitly to every op that takes lengths."""
    import rlightning_comm.sequence_parallel as sp

    heads = sp.all_to_all(xs["all_to_all"], 1, 2, SP, gather_sizes=lens)
    return {
        "all_to_all": heads,
        "all_to_all back": sp.all_to_all(heads * 1.5, 2, 1, SP, scatter_sizes=lens),
        "scatter r0=True": sp.scatter_to_sequence_parallel_region(xs["scatter r0=True"], seq_lens=lens),
        "scatter r0=False": sp.scatter_to_sequence_parallel_region(xs["scatter r0=False"], False, seq_lens=lens),
        "gather r0=True": sp.gather_from_sequence_parallel_region(xs["gather r0=True"], seq_lens=lens),
        "gather r0=False": sp.gather_from_sequence_parallel_region(xs["gather r0=False"], False, seq_lens=lens),
        "all_gather": sp.all_gather_from_sequence_parallel_region(xs["all_gather"], seq_lens=lens),
        "reduce_scatter": sp.reduce_scatter_to_sequence_parallel_region(xs["reduce_scatter"], seq_lens=lens),
        "ulysses_attention": sp.ulysses_attention(
            xs["ulysses q"], xs["ulysses k"], xs["ulysses v"], is_causal=True, seq_lens=lens
        ),
    }


def _inputs(rank: int, lens: list[int] | None, full: int) -> dict[str, torch.Tensor]:
    local = 3 if lens is None else lens[rank]
    shapes = {"full": (2, full, 4, 3), "local": (2, local, 4, 3)}
    kinds = {
        "all_to_all": "local",
        "scatter r0=True": "full",
        "scatter r0=False": "full",
        "gather r0=True": "local",
        "gather r0=False": "local",
        "all_gather": "local",
        "reduce_scatter": "full",
        "ulysses q": "local",
        "ulysses k": "local",
        "ulysses v": "local",
    }
    # scatter r0=False wants the same tensor on every rank; the others differ per rank.
    seeds = {name: (17 if name == "scatter r0=False" else 100 * rank + i) for i, name in enumerate(kinds)}
    return {name: data(seeds[name], shapes[kind])[0] for name, kind in kinds.items()}


def _both(default: dict[str, torch.Tensor], uneven: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block with the default lengths and with explicit uneven ones, in one graph (one compile for both)."""
    outs = {f"default {k}": v for k, v in _block(default, CONFIGS["default"][0]).items()}
    return outs | {f"uneven {k}": v for k, v in _block(uneven, CONFIGS["uneven"][0]).items()}


def _run(fn, xs: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    leaves = {c: {k: v.clone().requires_grad_() for k, v in x.items()} for c, x in xs.items()}
    outs = fn(leaves["default"], leaves["uneven"])
    # Each output its own weight: every op's gradient is checked through its own input.
    loss = sum((o.sin() * (i + 1)).sum() for i, o in enumerate(outs.values()))
    loss.backward()
    grads = {f"{c} {k}": v.grad for c, x in leaves.items() for k, v in x.items()}
    return {k: v.detach() for k, v in outs.items()}, grads


def _task(rank: int, size: int, url: str, backend: str) -> dict[str, float]:
    from world import init_world

    # Compiling on a loaded machine: a rank may wait in a collective while its peer still compiles.
    ctx = init_world(rank, size, url, timeout=300)
    ctx.init_group(list(range(size)), SP)
    chk = Checks()
    xs = {config: _inputs(rank, *CONFIGS[config]) for config in CONFIGS}
    want_out, want_grad = _run(_both, xs)
    torch._dynamo.reset()
    got_out, got_grad = _run(torch.compile(_both, fullgraph=True, backend=backend), xs)
    for name, want in want_out.items():
        chk.close(f"{backend} {name} forward", got_out[name], want)
    for name, want in want_grad.items():
        chk.close(f"{backend} {name} grad", got_grad[name], want)
    if backend == "aot_eager":
        _check_group_forms(chk, ctx, rank)
    return chk.errors


def _check_group_forms(chk: Checks, ctx, rank: int) -> None:
    """Every form of group compiles: a CommMode, its string, a Communicator, a ProcessGroup (the context's and
    WORLD)."""
    import torch.distributed as dist

    import rlightning_comm.sequence_parallel as sp
    from rlightning_comm import CommMode

    (x,) = data(rank, (2, 4, 4, 3))
    forms = {
        "mode": CommMode.SEQUENCE_PARALLEL,
        "communicator": ctx.get_communicator(SP),
        "group": ctx.get_group(SP),
        "WORLD": dist.group.WORLD,
    }
    for label, form in forms.items():
        torch._dynamo.reset()

        def fn(t: torch.Tensor, form=form) -> torch.Tensor:
            return sp.all_to_all(t, 1, 2, form)

        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
        chk.close(f"group form {label} compiles", got, fn(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_every_op_compiles_fullgraph_and_equals_eager(world2, backend) -> None:
    assert_all_within(world2.run(_task, backend, timeout=400), tol=TOL)


# Each round destroys the context and declares again, without torch._dynamo.reset(): the group name, this rank's
# position in it or both change between rounds, and the compiled function must follow (or refuse) every binding.
REDECLARATIONS = [[("SP", [0, 1])], [("SP", [1, 0])], [("OTHER", [1, 0]), ("SP", [0, 1])], [("SP", [0, 1])]]


def _redeclare_task(rank: int, size: int, url: str) -> dict[str, float]:
    from world import init_world

    import rlightning_comm.sequence_parallel as sp
    from rlightning_comm import CommContext

    def by_mode(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sp.scatter_to_sequence_parallel_region(x, False, mode="SP"), sp.all_gather_from_sequence_parallel_region(
            y, mode="SP"
        )

    def by_group(x: torch.Tensor, pg) -> torch.Tensor:  # its own function: its recompiles must not hide the other's
        return sp.scatter_to_sequence_parallel_region(x, False, mode=pg)

    torch._dynamo.reset()  # once, before the first round: never between rounds
    # backend="eager": what is frozen or guarded is dynamo's doing, and this backend compiles fastest.
    compiled, compiled_group = (torch.compile(f, fullgraph=True, backend="eager") for f in (by_mode, by_group))
    chk = Checks()
    (x,) = data(5, (2, 4, 3))  # the same on every rank, as scatter(rank0_only=False) wants
    ys = data(6, *[(2, 3, 3)] * size)  # global rank g holds ys[g]
    for i, declaration in enumerate(REDECLARATIONS):
        ctx = init_world(rank, size, f"{url}{i}")
        for mode, ranks in declaration:
            ctx.init_group(ranks, mode)
        ranks = dict(declaration)["SP"]
        me = ranks.index(rank)
        chunk = x.narrow(1, 2 * me, 2)  # the oracle: plain slicing and cat in the declared order
        gathered = torch.cat([ys[g] for g in ranks], 1)
        got = (*compiled(x, ys[rank]), compiled_group(x, ctx.get_group("SP")))
        for name, value, want in zip(
            ("scatter via mode", "all_gather via mode", "scatter via its ProcessGroup"), got, (chunk, gathered, chunk)
        ):
            chk.equal(f"round {i} {declaration} {name}", value, want)
        ctx.destroy()
    try:
        compiled(x, ys[rank])
        raised = ""
    except Exception as err:  # noqa: BLE001 - with fullgraph=True dynamo re-raises what the traced code raised as its own error
        raised = str(err)
    chk.true(
        "unbound after destroy() raises",
        "No communicator bound for mode 'SP'" in raised and not CommContext().is_initialized(),
    )
    return chk.errors


def test_compiled_ops_follow_a_new_binding_after_destroy_without_a_dynamo_reset(world2) -> None:
    assert_all_within(world2.run(_redeclare_task, timeout=300), tol=0.0)


def _shared_roles(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention's one tensor in three roles, and a key that is also the value."""
    import rlightning_comm.sequence_parallel as sp

    return sp.ulysses_attention(q, q, q), sp.ulysses_attention(q, k, k, is_causal=True)


def _shared_roles_task(rank: int, size: int, url: str) -> dict[str, float]:
    from sp_oracle import init_sp

    from rlightning_comm.sequence_parallel import sdpa_bshd

    init_sp(rank, size, url)
    chk = Checks()
    full_q, full_k, w1, w2 = data(
        9, *[(2, 6, 4, 3)] * 4
    )  # every rank builds the full tensors; rank r holds chunk r of the sequence
    # The oracle: the same attention on the full sequence on one process, and its autograd.
    oq, ok = full_q.clone().requires_grad_(), full_k.clone().requires_grad_()
    want = (sdpa_bshd(oq, oq, oq), sdpa_bshd(oq, ok, ok, is_causal=True))
    ((want[0] * w1).sum() + (want[1] * w2).sum()).backward()
    local = slice(3 * rank, 3 * rank + 3)
    torch._dynamo.reset()
    for label, fn in (
        ("eager", _shared_roles),
        ("compiled", torch.compile(_shared_roles, fullgraph=True, backend="aot_eager")),
    ):
        q, k = full_q[:, local].clone().requires_grad_(), full_k[:, local].clone().requires_grad_()
        got = fn(q, k)
        ((got[0] * w1[:, local]).sum() + (got[1] * w2[:, local]).sum()).backward()
        chk.close(f"{label} q, q, q forward", got[0], want[0][:, local])
        chk.close(f"{label} q, k, k forward", got[1], want[1][:, local])
        chk.close(f"{label} grad of q (three roles and one)", q.grad, oq.grad[:, local])
        chk.close(f"{label} grad of k (two roles)", k.grad, ok.grad[:, local])
    return chk.errors


def test_ulysses_with_one_tensor_in_two_roles_compiles_and_adds_up_its_gradients(world2) -> None:
    assert_all_within(world2.run(_shared_roles_task, timeout=300), tol=TOL)
