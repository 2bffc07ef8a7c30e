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


def _engine(workers: int = 2):
    """The backend as vLLM's worker holds it, without an engine: only what parsing reads (no tensor-parallel group, so
    this process is the engine's reporting worker)."""
    from types import SimpleNamespace

    from rlightning_comm.integrations.vllm.backend import RLightningWeightTransferEngine

    engine = object.__new__(RLightningWeightTransferEngine)
    engine.parallel_config = SimpleNamespace(tensor_parallel_size=workers)
    return engine


def test_update_info_passes_reshard_options_and_raises_value_error_naming_what_is_wrong() -> None:
    pytest.importorskip("vllm")
    from rlightning_comm.integrations.vllm.backend import OPTIONS

    assert {"verify", "atomic"} <= set(OPTIONS) and not {"held", "wanted", "comm_mode", "version"} & set(OPTIONS)
    parse = _engine().parse_update_info
    info = parse({"version": 4, "verify": True, "atomic": True})
    assert (info.version, info.options, info.problem) == (4, {"verify": True, "atomic": True}, None)
    for bad, says in [
        (
            {"version": 4, "bogus": 1, "atomic": True},
            r"update_info has unknown keys \['bogus'\]; expected 'version' and",
        ),
        ({"atomic": True}, r"update_info has no 'version'; expected 'version' and any of \[.*'verify'"),
        ("version=4", r"update_info must be a dict; got str"),
    ]:
        with pytest.raises(ValueError, match=says):  # vLLM's contract for parse_update_info
            parse(bad)


@pytest.mark.parametrize(
    ("init", "says"),
    [
        ([1], r"init_info must be a dict with keys \['address', 'rank', 'world_size', .*; got list"),
        ({"address": "h:1/s", "rank": 2}, r"init_info: missing keys \['world_size'\], unknown keys \[\]"),
        ({"address": "h:1/s", "rank": 1, "world_size": 3, "bogus": 1}, r"unknown keys \['bogus'\]; the keys are"),
        ({"address": "h:1/s", "rank": "1", "world_size": 3}, r"init_info\['rank'\] must be an int; got str '1'"),
        ({"address": "h:1/s", "rank": True, "world_size": 3}, r"init_info\['rank'\] must be an int; got bool"),
        ({"address": 7, "rank": 1, "world_size": 3}, r"address and mode must be strings; got 7, 'WEIGHT_SYNC'"),
        ({"address": "h:1/s", "rank": 2, "world_size": 3}, r"rank 2 with world_size 3 leaves no room for this engine"),
        ({"address": "h:1/s", "rank": -1, "world_size": 3}, r"rank -1 with world_size 3 leaves no room"),
    ],
)
def test_a_malformed_init_info_raises_value_error(init, says) -> None:
    pytest.importorskip("vllm")
    with pytest.raises(ValueError, match=says):  # vLLM's contract for parse_init_info
        _engine(workers=2).parse_init_info(init)


def test_a_well_formed_init_info_is_typed() -> None:
    pytest.importorskip("vllm")
    info = _engine(workers=2).parse_init_info({"address": "h:1/s", "rank": 1, "world_size": 3, "timeout": 5.0})
    assert (info.address, info.rank, info.world_size, info.mode, info.timeout) == ("h:1/s", 1, 3, "WEIGHT_SYNC", 5.0)


RELOAD = """
import contextlib, logging, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload, initialize_layerwise_reload, record_metadata_for_reloading)
from rlightning_comm.integrations.vllm._reload import RELOAD_LOGGER, reloading

class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8), requires_grad=False)

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary, self.norm, self.missing = get_rope(32, 64), Norm(), Norm()

class Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.said = []
    def emit(self, record):
        self.said.append(record.getMessage())

with set_current_vllm_config(VllmConfig()):
    model = Model()
    record_metadata_for_reloading(model)  # what vLLM's loader does at load time
    said = Said()
    logging.getLogger(RELOAD_LOGGER).addHandler(said)
    for around in (contextlib.nullcontext(), reloading(model)):
        said.said.clear()
        with around, torch.no_grad():
            initialize_layerwise_reload(model)
            model.norm.weight.weight_loader(model.norm.weight, torch.full((8,), 2.0))  # "missing" gets nothing
            finalize_layerwise_reload(model, None)
        print(sorted(said.said), float(model.norm.weight.sum()))
"""


def test_the_reload_warning_for_layers_with_nothing_to_load_is_dropped_and_others_still_show() -> None:
    """vLLM's own layer-by-layer reload on a rotary embedding, a layer that loads and one that receives nothing: alone
    it warns for the rotary embedding and for the layer that got nothing; in ``reloading`` only for the latter."""
    pytest.importorskip("vllm")
    out = subprocess.run(
        [sys.executable, "-c", RELOAD], env=environment(), capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    alone, around = out.stdout.strip().splitlines()[-2:]
    assert alone == "['Norm: Failed to load weights', 'RotaryEmbedding: Failed to load weights'] 16.0", out.stdout
    assert around == "['Norm: Failed to load weights'] 16.0", out.stdout  # loaded all the same
