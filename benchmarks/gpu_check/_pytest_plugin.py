"""pytest plugin of the GPU check's CUDA tests step: keep only the tests that need CUDA, and list them as collected.

Selected: every test of the NCCL test files, and every test with a
``skipif`` whose reason names CUDA, a GPU or NCCL and whose condition is false on this machine (so it runs here, and
skips without CUDA). The ids go to the file named by ``GPU_CHECK_SELECTED`` before any test runs, so the report lists
them even when pytest is killed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

CUDA_FILES = ("test_nccl.py", "test_sequence_parallel_nccl.py")
_NAMES_CUDA = re.compile(r"\b(cuda|gpus?|nccl)\b", re.IGNORECASE)


def needs_cuda(markers: Iterable[Any], filename: str) -> bool:
    """Whether a test (its markers, the name of its file) is one the CUDA step runs."""
    if os.path.basename(filename) in CUDA_FILES:
        return True
    for mark in markers:
        if mark.name != "skipif" or not _NAMES_CUDA.search(str(mark.kwargs.get("reason", ""))):
            continue
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition", False)
        if isinstance(condition, bool) and not condition:  # it runs on this machine
            return True
    return False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    keep = [item for item in items if needs_cuda(item.iter_markers(), str(item.path))]
    drop = [item for item in items if item not in keep]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    target = os.environ.get("GPU_CHECK_SELECTED")
    if target:
        with open(target, "w", encoding="utf-8") as f:
            f.write("\n".join(item.nodeid for item in keep) + "\n")
