"""examples/vllm_engine_sync.py as its docstring shows it: an FSDP2 trainer and a vLLM CPU engine, exact tokens after
each of two syncs at a bucket size that splits every layer. Skipped where vLLM is not installed."""

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
    assert len(rounds) == 2 and all("27 of 27 tensors received" in r and "== Hugging Face's" in r for r in rounds)
    assert "OK" in proc.stdout.splitlines()
