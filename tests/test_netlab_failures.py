"""A link cut in the middle of an atomic versioned sync, in the network lab: 1 trainer and 3 engines in a connected mode
(the relay chain 0 -> 1 -> 2 -> 3), each on a host of its own; the link of the source, of the middle relay or of the
last engine is cut at about 40% of the transfer (its port leaves the lab's bridge: no reset reaches anyone).

Expected of the library: every member's call, the cut member's too, raises :class:`PeerLostError` within 1.25 times
``liveness_timeout`` of the cut plus 1 s (the survivors naming the cut member); nothing commits (every engine on the old
version, by its bytes); once the link is back, the mode re-forms with ``connect`` and the next sync is exact. The
oracle: SHA-256 of each engine's bytes against the state's definition, computed here.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from netlab_hosts import HostFailed, Hosts, netlab

from rlightning_comm import PeerLostError

pytestmark = pytest.mark.skipif(netlab.unavailable() is not None, reason=str(netlab.unavailable()))

MODE = "NETLAB_CUT"
LIVENESS = 2.0
TIMEOUT = 20.0  # the collectives' timeout
BOUND = 1.25 * LIVENESS + 1.0  # seconds from the cut to every member's PeerLostError
SLACK = 1.5  # what a loaded 2-core machine may add before a late answer counts as a hang
RATE = "1gbit"
TENSORS, ELEMENTS = 8, 1 << 20  # 32 MiB of float32
NBYTES = TENSORS * ELEMENTS * 4
CUT_AT = 0.4  # of the state's bytes through the cut host's link
ROLES = {"source": 0, "middle relay": 1, "last engine": 3}


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(ELEMENTS, generator=g) for i in range(TENSORS)}


def _sha(state: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def _member(conn, host: int, address: str) -> None:
    """Connect, sync version 1, sync version 2 on the test's word (a link is cut meanwhile), report; re-form and sync
    version 2 again on the test's word."""
    from rlightning_comm import CommContext, broadcast_state_dict

    ctx = CommContext()
    live = _state(0) if host else None

    def sync(version: int) -> None:
        state = _state(version) if host == 0 else live
        broadcast_state_dict(state, MODE, src=0, version=version, atomic=True)

    def connect() -> None:
        ctx.connect(MODE, rank=host, world_size=4, address=address, timeout=TIMEOUT, liveness_timeout=LIVENESS)

    try:
        connect()
        sync(1)
        conn.send(("synced",))
        conn.recv()
        try:
            sync(2)
            outcome = None
        except Exception as err:  # noqa: BLE001 - the outcome is the report
            outcome = (type(err).__name__, str(err), getattr(err, "member", None))
        conn.send(("cut", outcome, time.monotonic(), live and _sha(live), ctx.get_weight_version(MODE)))
        conn.recv()
        connect()
        sync(2)
        conn.send(("resynced", live and _sha(live), ctx.get_weight_version(MODE)))
        conn.recv()
    finally:
        ctx.destroy()


def cut_during_sync(cut: int, wait: float) -> dict:
    """Run the scenario with ``cut``'s link cut once 40% of the state's bytes went through it (the source's sending, or
    the cut engine's receiving, by its bridge port's counters); the members' outcomes, waited for at most ``wait`` s
    after the cut (``"hung"`` for one that had not answered by then)."""
    with netlab.Lab(4, netlab.parse_rate(RATE)) as lab, Hosts(lab, _member, f"{lab.addresses[0]}:29521") as hosts:
        hosts.gather(90)
        watch = 0 if cut == 0 else 1  # the source's sending, or the cut engine's receiving
        start = lab.port_bytes(cut)[watch]
        for h in range(4):
            hosts.send(h, "go")
        deadline, moved = time.monotonic() + 30, 0
        while moved < CUT_AT * NBYTES and time.monotonic() < deadline:
            time.sleep(0.002)
            moved = lab.port_bytes(cut)[watch] - start
        lab.cut(cut)
        cut_at = time.monotonic()
        outcomes: dict[int, tuple] = {}
        for h in range(4):
            try:
                outcomes[h] = hosts.recv(h, max(0.0, cut_at + wait - time.monotonic()))
            except HostFailed as err:
                outcomes[h] = ("hung", str(err))
        out = {"moved": moved, "cut_at": cut_at, "outcomes": outcomes}
        lab.restore(cut)
        if any(o[0] == "hung" for o in outcomes.values()):
            return out
        for h in range(4):
            hosts.send(h, "reform")
        out["resynced"] = hosts.gather(60)
        for h in range(4):
            hosts.send(h, "leave")
    return out


def _check(role: str, out: dict) -> None:
    cut, old, new = ROLES[role], _sha(_state(1)), _sha(_state(2))
    late = {h: o for h, o in out["outcomes"].items() if o[0] == "hung"}
    assert not late, f"{role} cut: members {sorted(late)} had not returned {BOUND + SLACK:g} s after the cut: {late}"
    for h, (_, outcome, end, sha, version) in out["outcomes"].items():
        assert outcome is not None, f"{role} cut: member {h}'s sync succeeded (cut after {out['moved']} bytes)"
        kind, message, member = outcome
        assert kind == PeerLostError.__name__, f"{role} cut: member {h} raised {kind}: {message}"
        assert h == cut or member == cut, f"{role} cut: member {h} named member {member}, expected {cut}: {message}"
        assert end - out["cut_at"] <= BOUND + SLACK, f"{role} cut: member {h} took {end - out['cut_at']:.2f} s"
        if h:
            assert (sha, version) == (old, 1), f"{role} cut: engine {h} committed something: version {version}"
    for h, (_, sha, version) in enumerate(out["resynced"]):
        if h:
            assert (sha, version) == (new, 2), f"{role} cut, re-formed: engine {h} holds version {version}, bytes {sha}"


@pytest.mark.parametrize("role", list(ROLES))
def test_a_link_cut_mid_sync_fails_every_member_in_bounded_time_commits_nothing_and_the_mode_reforms(role):
    _check(role, cut_during_sync(ROLES[role], BOUND + SLACK))
