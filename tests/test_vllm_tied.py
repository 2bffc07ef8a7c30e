"""A model whose LM head is tied to its input embeddings (``tie_word_embeddings``: Qwen2.5 up to 3B, Llama 3.2, Gemma)
in a real vLLM engine (vLLM's CPU build, tensor_parallel_size=2): exact greedy tokens against the Hugging Face model on
the same weights after two versions through the "rlightning" backend, then two more through the worker extension.

On vLLM's CPU build the head computes with a packed copy of the embedding's weight that vLLM's reload does not pack
again (the integration does: :mod:`rlightning_comm.integrations.vllm._reload`); without that, the tokens differ from the
first sync on. One engine serves both ways (it has the backend and the extension) and one trainer process (member 0 of
the mode, the whole tied model) sends; skipped where vLLM is not installed (the main suite).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm_backend_trainer import whole_trainer  # noqa: E402

BOUND = 300  # seconds: the longest any wait of these tests lasts
NEW_TOKENS = 8
CONFIG = dict(
    vocab_size=1000,  # not a multiple of 64: vLLM pads the shared embedding and finishes it only at the end
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    initializer_range=0.1,
)
PROMPTS = [[11, 502, 7, 93, 640], [3, 3, 999, 250, 18, 77, 401, 5, 60], list(range(40, 77))]


def _reply(replies, proc, kind: str) -> tuple:
    deadline = time.monotonic() + BOUND
    while True:
        try:
            message = replies.get(timeout=1)
        except queue.Empty:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"no {kind!r} reply from the trainer (exit code {proc.exitcode})") from None
            continue
        assert message[1] != "error", f"the trainer failed:\n{message[2]}"
        assert message[1] == kind, message
        return message[2:]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A TP=2 vLLM CPU engine of a tiny tied Qwen2 with random weights, with the backend (connected as members 1 and
    2) and the worker extension, and the trainer process."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from transformers import Qwen2Config
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    config_dir = str(tmp_path_factory.mktemp("tied-qwen2"))
    Qwen2Config(**CONFIG).save_pretrained(config_dir)
    spawn = mp.get_context("spawn")
    orders, replies = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=whole_trainer, args=(config_dir, PROMPTS, NEW_TOKENS, 3, orders, replies), daemon=True)
    proc.start()
    llm = None
    try:
        llm = LLM(
            model=config_dir,
            load_format="dummy",  # random weights: everything served comes from the syncs
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            weight_transfer_config=WeightTransferConfig(backend="rlightning"),
            worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker",
        )
        (address,) = _reply(replies, proc, "address")
        llm.init_weight_transfer_engine({"init_info": {"address": address, "rank": 1, "world_size": 3}})
        yield llm, orders, replies, proc
    finally:
        if llm is not None:  # its workers, children of this process, would outlive the module (and confuse the next)
            llm.llm_engine.engine_core.shutdown()
        orders.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()  # by its pid: ours


def _tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_tied_model_gives_the_hugging_face_tokens_through_the_backend(engine) -> None:
    llm, orders, replies, proc = engine
    seen = []
    for version in (1, 2):
        orders.put(("sync", version, True))
        (expected,) = _reply(replies, proc, "tokens")
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version}})
        llm.finish_weight_update(weight_version=str(version))
        _reply(replies, proc, "synced")
        assert _tokens(llm) == expected, version
        seen.append(expected)
    assert seen[0] != seen[1]  # the second sync changed the tokens: a head stale by one version could not pass


def test_a_tied_model_gives_the_hugging_face_tokens_through_the_worker_extension(engine) -> None:
    from rlightning_comm.integrations.vllm import sync_weights

    llm, orders, replies, proc = engine
    seen = []
    # The model's state dict names the tied tensor twice (vLLM then loads the head itself); its named parameters once,
    # as a tied model's checkpoint does (vLLM then leaves the head's packed weight stale).
    for version, kind in ((3, "broadcast"), (4, "broadcast_params")):
        orders.put((kind, version, True))
        (expected,) = _reply(replies, proc, "tokens")
        sync_weights(llm, version=version)  # both workers receive the whole model
        _reply(replies, proc, "synced")
        assert _tokens(llm) == expected, (version, kind)
        assert llm.collective_rpc("weight_version") == [version, version]
        seen.append(expected)
    assert seen[0] != seen[1]
