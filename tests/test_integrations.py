"""The library core never imports an inference engine: ``import rlightning_comm`` leaves vLLM and the integrations
unimported, and the vLLM integration imports vLLM only when one of its methods runs."""

from __future__ import annotations

import subprocess
import sys

from example_commands import environment

CHECK = """
import sys
import rlightning_comm
import rlightning_comm.weights, rlightning_comm.context, rlightning_comm.connect
assert "vllm" not in sys.modules, "import rlightning_comm imported vllm"
assert "rlightning_comm.integrations" not in sys.modules, "import rlightning_comm imported its integrations"
from rlightning_comm.integrations.vllm import WeightSyncWorker, sync_weights
assert "vllm" not in sys.modules, "importing the vLLM integration imported vllm"
assert callable(sync_weights) and callable(WeightSyncWorker.receive_weights)
print("ok")
"""


def test_the_core_never_imports_vllm() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=environment(), capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
