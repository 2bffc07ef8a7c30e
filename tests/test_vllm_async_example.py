"""examples/async_rl_vllm.py as its docstring shows it: an AsyncLLM engine (tensor_parallel_size=2, background receive)
generating throughout while a 3-rank FSDP2 trainer publishes every step. Checked from what the example prints: vLLM's
own per-token weight versions bound the staleness of every sample trained on, every published version was applied once
and in order with requests in flight, and the last version's greedy tokens equal the Hugging Face model's on the
trainer's final weights. Skipped where vLLM is not installed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from example_commands import documented, environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BOUND = 300  # seconds
STEPS = 4  # the example's default


def test_the_example_trains_on_bounded_stale_samples_and_ends_on_the_trainers_tokens() -> None:
    proc = subprocess.run(
        documented("async_rl_vllm.py"),
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK", proc.stdout
    (result,) = [json.loads(line[len("RESULT ") :]) for line in lines if line.startswith("RESULT ")]
    k = result["staleness"]

    # Staleness: the versions are vLLM's (CompletionOutput.weight_versions), each sample's oldest bounds it.
    assert [s["trainer"] for s in result["steps"]] == list(range(1, STEPS + 1))
    for step in result["steps"]:
        assert len(step["samples"]) == 3, step
        for versions in step["samples"]:
            assert versions and step["trainer"] - min(versions) <= k, (step, k)
            assert max(versions) <= step["trainer"], step  # no sample from a version the trainer has not published

    # Every published version applied exactly once, in order; the engine generated across every update.
    versions = list(range(1, STEPS + 2))
    assert result["published"] == versions and result["applied"] == versions, result
    assert all(p["in_flight"] > 0 for p in result["pauses"][1:]), result["pauses"]
    for spans in result["spans"]:  # each request's tokens: consecutive spans of increasing applied versions
        assert spans[0][1] == 0 and all(a[2] == b[1] and a[0] < b[0] for a, b in zip(spans, spans[1:])), spans
        assert {v for v, _, _ in spans} <= set(versions), spans
    assert sum(len(spans) > 1 for spans in result["spans"]) >= STEPS, result["spans"]  # spanned an update each time

    final = result["final"]
    assert final["weight_version"] == str(STEPS + 1)
    assert final["engine"] == final["hugging_face"], final
