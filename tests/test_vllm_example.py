"""examples/vllm_engine_sync.py as its docstring shows it: a 3-rank FSDP2 trainer into a vLLM CPU engine of
tensor_parallel_size=2 through the "rlightning" backend, exact tokens after each of two syncs (an optimizer step before
each) and the bytes within their bounds. Skipped where vLLM is not installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from example_commands import documented, environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BOUND = 300  # seconds


def test_the_example_gives_exact_tokens_twice() -> None:
    proc = subprocess.run(
        documented("vllm_engine_sync.py"),
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("== Hugging Face's" in r for r in rounds), proc.stdout
    assert "OK" in proc.stdout.splitlines()
