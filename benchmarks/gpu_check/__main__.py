"""``python benchmarks/gpu_check`` (or ``python -m benchmarks.gpu_check`` in the checkout): the GPU check's command.

Run as a folder, this file has no package and its own folder is ``sys.path[0]``: the checkout takes that place, so the
package's modules (and the rank and pytest processes it starts, which get the checkout on ``PYTHONPATH``) import as
``benchmarks.gpu_check._*`` whichever way the command was started.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    sys.path.insert(0, str(_HERE.parents[1]))

from benchmarks.gpu_check._cli import main  # noqa: E402 - the checkout is importable only from here on

if __name__ == "__main__":
    raise SystemExit(main())
