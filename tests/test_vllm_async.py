"""In-flight updates through the "rlightning" backend: an AsyncLLM engine (vLLM's CPU build, tensor_parallel_size=2)
that receives each version in the background while it generates, from a 3-rank FSDP2 trainer publishing with
``async_op=True``; the driver only pauses (``mode="keep"``) around vLLM's reload.

One engine serves the tests of this module, in order (starting one takes most of a minute on 2 busy cores): a version
staged while requests are in flight (the trainer's publish completes before the driver's update, the engine still
generating), applied in a pause that holds the reload only; a request submitted after the resume with the new
version's ``cache_salt`` gives exactly the Hugging Face model's tokens on the new weights although an in-flight request
cached its prompt under the old ones; a superseded version discarded, a stale one refused on every member; a trainer
rank SIGKILLed mid-publish: the engine generates on without a stall, ``update_weights`` of the lost version raises
naming it, and the re-formed mode publishes it again. Skipped where vLLM is not installed.

The prompt fills two of the CPU engine's 128-token KV blocks (vLLM's CPU platform default), so the prefix cache serves
later requests on it (``num_cached_tokens`` is asserted): without a per-version salt a request after the update reuses
the old version's blocks and its tokens differ from the Hugging Face model's on the new weights (the hazard the salt
guards against, shown), and with the salt they equal them.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import queue
import threading
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm_backend_trainer import MEMBERS, TRAINERS, replacement, trainer  # noqa: E402

BOUND = 300  # seconds: the longest any wait of these tests lasts
NEW_TOKENS = 16
IN_FLIGHT_TOKENS = 300  # long enough to stay in flight across an update
CONFIG = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
BLOCK = 128  # tokens per KV block: vLLM's CPU platform default (its block_size when none is given)
PROMPT_LENGTH = 2 * BLOCK + 44  # two whole blocks, which the prefix cache keeps, and a partial one, which it does not


class Session:
    """The engine (driven on an event loop of its own thread), the trainer processes, and the oracle's tokens."""

    def __init__(self, llm, loop, orders, replies, procs, folder):
        self.llm, self.loop, self.orders, self.replies, self.procs = llm, loop, orders, replies, procs
        self.folder = folder
        self.tokens: dict[int, list[int]] = {}  # version -> the Hugging Face model's tokens on the prompt
        self.ids = itertools.count()
        import torch

        gen = torch.Generator().manual_seed(3)
        self.prompt = torch.randint(0, CONFIG["vocab_size"], (PROMPT_LENGTH,), generator=gen).tolist()

    def run(self, coro, timeout: float = BOUND):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def order(self, *order, ranks=range(TRAINERS)) -> None:
        for r in ranks:
            self.orders[r].put(order)

    def collect(self, kind: str, ranks) -> dict[int, tuple]:
        got, deadline = {}, time.monotonic() + BOUND
        while set(got) != set(ranks):
            try:
                rank, what, *rest = self.replies.get(timeout=1)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in self.procs.items() if r in ranks and p.exitcode not in (None, 0)}
                if dead or time.monotonic() > deadline:
                    missing = set(ranks) - set(got)
                    raise AssertionError(f"no {kind!r} reply from ranks {missing} (exits {dead})") from None
                continue
            assert what != "error", f"trainer rank {rank} failed:\n{rest[0]}"
            assert what == kind or (kind == "synced" and what == "failed"), (rank, what, rest)
            got[rank] = (what, *rest)
        return got

    def step(self, version: int) -> list[int]:
        """An optimizer step, and the Hugging Face model's greedy tokens on the prompt for the weights it gives."""
        self.order("step", 100 * version)
        self.collect("stepped", range(TRAINERS))
        self.order("tokens", [self.prompt], NEW_TOKENS)
        self.tokens[version] = self.collect("tokens", [0])[0][1][0]
        return self.tokens[version]

    def publish(self, version: int, ranks=range(TRAINERS), **options) -> None:
        self.order("publish", version, {"atomic": True, **options}, ranks=ranks)
        self.collect("published", ranks)

    def wait(self, ranks=range(TRAINERS)) -> dict[int, tuple]:
        self.order("wait", ranks=ranks)
        return self.collect("synced", ranks)

    async def _apply(self, version: int):
        start = time.monotonic()
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self.llm.start_weight_update()
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
            await self.llm.finish_weight_update(weight_version=str(version))
        finally:
            await self.llm.resume_generation()
        return time.monotonic() - start

    def apply(self, version: int) -> float:
        """The keep-mode flow of the docs: pause, vLLM's update calls, resume; the seconds from pause to resume."""
        return self.run(self._apply(version))

    def generate(self, salt: str | None, max_tokens: int = NEW_TOKENS, arrivals: list | None = None):
        """A future of one greedy request on the prompt: its final output (token ids, weight-version spans, and how many
        prompt tokens the prefix cache served)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": self.prompt, **({"cache_salt": salt} if salt is not None else {})}

        async def one():
            final = None
            async for out in self.llm.generate(prompt, params, request_id=f"r{next(self.ids)}"):
                final = out
                if arrivals is not None:
                    arrivals.append((time.monotonic(), len(out.outputs[0].token_ids)))
            out = final.outputs[0]
            return list(out.token_ids), out.weight_versions, final.num_cached_tokens

        return asyncio.run_coroutine_threadsafe(one(), self.loop)

    def reports(self) -> list[dict]:
        from rlightning_comm.integrations.vllm import WeightSyncWorker  # noqa: F401 - the extension's methods

        return self.run(self.llm.collective_rpc("weight_sync_report"))


def WeightTransferUpdateRequest(**kwargs):  # noqa: N802 - vLLM's request, imported late
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest as Request

    return Request(**kwargs)


def _init_request(address: str):
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    info = {"address": address, "rank": TRAINERS, "world_size": MEMBERS, "timeout": 60, "background": {"atomic": True}}
    return WeightTransferInitRequest(init_info=info)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from transformers import Qwen2Config
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    tmp = tmp_path_factory.mktemp("async")
    config_dir = str(tmp / "tiny-qwen2")
    Qwen2Config(**CONFIG).save_pretrained(config_dir)
    spawn = mp.get_context("spawn")
    orders, replies = {r: spawn.Queue() for r in range(TRAINERS)}, spawn.Queue()
    procs = {
        r: spawn.Process(target=trainer, args=(r, str(tmp / "store"), config_dir, orders[r], replies), daemon=True)
        for r in range(TRAINERS)
    }
    for p in procs.values():
        p.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    llm = None
    try:
        args = AsyncEngineArgs(
            model=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=1024,
            max_num_seqs=8,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            enable_prefix_caching=True,
            weight_transfer_config=WeightTransferConfig(backend="rlightning"),
            worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker",
        )

        async def start():
            return AsyncLLM.from_engine_args(args)

        llm = asyncio.run_coroutine_threadsafe(start(), loop).result(BOUND)
        s = Session(llm, loop, orders, replies, procs, str(tmp))
        s.address = s.collect("address", range(TRAINERS))[0][1]
        s.order("lr", 2e-3)  # small steps: the tiny model's tokens stay varied (at 0.02 they collapse to one)
        s.run(llm.init_weight_transfer_engine(_init_request(s.address)))
        yield s
    finally:
        # The trainers leave first: the workers' armed receive then ends (their peers are gone), and the engine's
        # processes can exit when it shuts down.
        for q in orders.values():
            q.put(None)
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()  # by its pid: ours
        if llm is not None:
            llm.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        _reap_engine_processes()


def _reap_engine_processes(grace: float = 10.0) -> None:
    """End the engine's processes (children of this process) that outlive its shutdown: they would outlive the module
    and be counted by the next one in this pytest worker."""
    import psutil

    left = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    _, alive = psutil.wait_procs(left, timeout=grace)
    for p in alive:
        p.kill()  # ours: children of this process
    psutil.wait_procs(alive, timeout=grace)


def test_a_version_received_while_generating_is_applied_in_a_short_pause(session) -> None:
    s = session
    s.step(1)
    s.publish(1)
    s.wait()
    s.apply(1)
    tokens, spans, _ = s.generate("w1").result(BOUND)
    assert tokens == s.tokens[1]
    tokens, _, cached = s.generate(None).result(BOUND)  # unsalted: its prompt's blocks cached under version 1
    assert tokens == s.tokens[1] and cached == 0, cached
    assert s.generate(None).result(BOUND)[2] == 2 * BLOCK  # the CPU engine's prefix cache serves whole blocks

    # Requests in flight, one of them caching the prompt's blocks under version 1.
    arrivals: list = []
    in_flight = [s.generate("w1", IN_FLIGHT_TOKENS, arrivals) for _ in range(3)]
    deadline = time.monotonic() + BOUND
    while len(arrivals) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    # One large step, so that version 1's keys and values change version 2's greedy tokens (below): after a step at
    # 2e-3 the unsalted request reused 256 stale tokens and still gave version 2's 16 tokens, hiding the hazard.
    s.order("lr", 2e-2)
    expected = s.step(2)
    s.order("lr", 2e-3)
    s.publish(2)
    published = time.monotonic()
    replies = s.wait()  # every worker staged version 2, in the background
    staged = time.monotonic()
    assert all(r[0] == "synced" and r[1]["version"] == 2 for r in replies.values()), replies
    during = [n for t, n in arrivals if published <= t <= staged]
    assert len(during) >= 2, (published, staged, arrivals[-5:])  # the engine generated during the receive
    assert s.run(s.llm.get_weight_version()) == "1"  # staged, not applied
    assert not any(f.done() for f in in_flight)

    pause = s.apply(2)
    workers = s.reports()
    assert [w["version"] for w in workers] == [2, 2]
    assert all(w["transfer_s"] < 0.05 for w in workers), workers  # nothing left to receive: the pause held the reload
    assert pause < 5.0, pause

    # A request submitted after the resume, with the new version's salt: exactly the new model's tokens, the old
    # version's cached blocks not reused; a second one reuses the blocks the first computed with the new weights.
    assert not any(f.done() for f in in_flight)
    fresh, spans, cached = s.generate("w2").result(BOUND)
    assert fresh == expected and cached == 0, (fresh, expected, cached)
    assert [(sp.version, sp.start, sp.end) for sp in spans] == [("2", 0, NEW_TOKENS)]
    again, _, cached = s.generate("w2").result(BOUND)
    assert again == expected and cached == 2 * BLOCK, (again, expected, cached)
    # Without a per-version salt: the prompt's blocks computed by version 1 are reused, and the tokens are not the new
    # model's (keys and values of the old weights attended to by the new ones).
    stale, spans, cached = s.generate(None).result(BOUND)
    assert cached == 2 * BLOCK and [sp.version for sp in spans] == ["2"], (cached, spans)
    assert stale != expected, (stale, expected)
    print(f"pause {pause * 1e3:.0f} ms, reload {max(w['load_s'] for w in workers) * 1e3:.0f} ms")

    for f in in_flight:
        tokens, spans, _ = f.result(BOUND)
        versions = [sp.version for sp in spans]
        assert versions == ["1", "2"] and spans[-1].end == IN_FLIGHT_TOKENS, spans


def test_a_superseded_version_is_discarded_and_a_stale_one_refused(session) -> None:
    s = session
    s.step(3)
    s.publish(3)
    expected = s.step(4)  # the publish captured version 3: the trainer steps on at once
    s.publish(4)  # queued on the trainer until the engine has applied (or discarded) version 3
    assert all(r[0] == "synced" and r[1]["version"] == 3 for r in s.wait().values())
    s.apply(4)  # version 3 is staged: superseded, discarded; version 4 received and applied
    assert all(r[0] == "synced" and r[1]["version"] == 4 for r in s.wait().values())
    assert s.generate("w4").result(BOUND)[0] == expected
    assert s.run(s.llm.get_weight_version()) == "4"

    with pytest.raises(Exception, match="version 3 refused: stale, the engine serves version 4"):
        s.apply(3)
    s.publish(2)  # a stale publish: refused on every member, the trainer ranks included
    for rank, reply in s.wait().items():
        assert reply[0] == "failed" and reply[1] == "CommMismatchError", (rank, reply)
        assert "version 2 refused" in reply[2] and "has committed version 4" in reply[2], reply
    assert s.generate("w4").result(BOUND)[0] == expected
    assert s.run(s.llm.collective_rpc("weight_version")) == [4, 4]


def test_a_trainer_rank_killed_mid_publish_leaves_the_engine_generating(session) -> None:
    s = session
    expected = s.step(5)
    s.order("checkpoint", s.folder)  # what the replacement resumes from
    s.collect("saved", range(TRAINERS))
    arrivals: list = []
    in_flight = s.generate("w4", IN_FLIGHT_TOKENS, arrivals)
    while len(arrivals) < 20 and not in_flight.done():
        time.sleep(0.05)
    s.order("arm", ranks=[2])
    s.publish(5, bucket_bytes=4096)
    killed = time.monotonic()
    for rank, reply in s.wait(ranks=[0, 1]).items():
        assert reply[0] == "failed" and reply[1] == "PeerLostError" and reply[3] == 2, (rank, reply)
    s.procs[2].join(timeout=BOUND)
    assert s.procs[2].exitcode == -9  # SIGKILL, mid-transfer
    tokens, spans, _ = in_flight.result(BOUND)
    times = [t for t, _ in arrivals if t >= killed]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times and max(gaps, default=0.0) < 1.0, gaps  # no stall: the engine generated on
    assert [sp.version for sp in spans] == ["4"]

    with pytest.raises(Exception, match=r"PeerLostError.*version 5 was not received") as raised:
        s.apply(5)
    assert "still serves version 4" in str(raised.value)
    assert s.generate("w4").result(BOUND)[0] == s.tokens[4]

    # A replacement from the checkpoint and the survivors re-form the mode; the engine joins it again.
    spawn = mp.get_context("spawn")
    s.orders[2] = spawn.Queue()
    s.procs[2] = spawn.Process(target=replacement, args=(2, s.folder, s.address, s.orders[2], s.replies), daemon=True)
    s.procs[2].start()
    s.collect("started", [2])
    s.order("connect", s.address, ranks=[0, 1])
    s.run(s.llm.init_weight_transfer_engine(_init_request(s.address)))
    s.collect("connected", range(TRAINERS))
    s.publish(5)
    assert all(r[0] == "synced" and r[1]["version"] == 5 for r in s.wait().values())
    s.apply(5)
    assert s.generate("w5").result(BOUND)[0] == expected
    assert s.run(s.llm.collective_rpc("weight_version")) == [5, 5]
