"""The library core never imports an inference engine: ``import rlightning_comm`` leaves vLLM and the integrations
unimported, and the vLLM integration imports vLLM only when one of its methods runs (or vLLM creates its backend).
Where vLLM is installed (CI's second environment), the package's entry point registers the backend in a fresh process,
as vLLM loads its plugins, and ``update_info`` is checked as the backend checks it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from example_commands import environment

CHECK = """
import sys
import rlightning_comm
import rlightning_comm.weights, rlightning_comm.context, rlightning_comm.connect
assert "vllm" not in sys.modules, "import rlightning_comm imported vllm"
assert "rlightning_comm.integrations" not in sys.modules, "import rlightning_comm imported its integrations"
from rlightning_comm.integrations.vllm import BACKEND, WeightSyncWorker, register_backend, sync_weights
from rlightning_comm.integrations.vllm import _views
assert "vllm" not in sys.modules, "importing the vLLM integration imported vllm"
assert callable(sync_weights) and callable(WeightSyncWorker.receive_weights) and callable(register_backend)
assert BACKEND == "rlightning"
print("ok")
"""


def test_the_core_never_imports_vllm() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=environment(), capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


PLUGIN = """
from importlib.metadata import entry_points
(point,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rlightning"]
assert point.value == "rlightning_comm.integrations.vllm:register_backend", point.value
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
import sys
assert "rlightning_comm.integrations.vllm.backend" not in sys.modules, "registering imported the backend"
engine = WeightTransferEngineFactory._registry["rlightning"]()
assert engine.__name__ == "RLightningWeightTransferEngine", engine
print("ok")
"""


def test_the_entry_point_registers_the_backend_in_vllm() -> None:
    pytest.importorskip("vllm")
    out = subprocess.run(
        [sys.executable, "-c", PLUGIN], env=environment(), capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        "install the package where vLLM runs (pip install --no-deps -e .) so that its entry point is found\n"
        + out.stderr[-3000:]
    )


def test_update_info_passes_reshard_options_and_names_unknown_keys() -> None:
    pytest.importorskip("vllm")
    from rlightning_comm.integrations.vllm.backend import OPTIONS, RLightningWeightTransferEngine

    assert {"verify", "atomic"} <= set(OPTIONS) and not {"held", "wanted", "comm_mode", "version"} & set(OPTIONS)
    parse = RLightningWeightTransferEngine.parse_update_info.__get__(object.__new__(RLightningWeightTransferEngine))
    info = parse({"version": 4, "verify": True, "atomic": True})
    assert (info.version, info.options, info.problem) == (4, {"verify": True, "atomic": True}, None)
    kind, message = parse({"version": 4, "bogus": 1, "atomic": True}).problem
    assert kind is ValueError and "unknown keys ['bogus']" in message and "'verify'" in message
    assert "no 'version'" in parse({"atomic": True}).problem[1]
    assert parse([1]).problem[0] is TypeError
