"""Every ```python block of README.md and of the guides in docs/ runs, as written, or says it is an excerpt.

The blocks are read from the files when the tests are collected, so the files and the tests cannot drift. The first line
of a block says how it runs:

- ``# excerpt`` (anything may follow, e.g. ``# excerpt: inside a trainer; see examples/quickstart.py``): a fragment of a
  larger program. It is not run, only compiled, so it must at least be valid Python.
- ``# file: NAME.py``: a whole program. It is written to an empty folder as ``NAME.py`` and run there with ``python
  NAME.py`` (the repository on ``PYTHONPATH``, as if installed; no launcher variables); it must exit 0.
- ``# runs on N ranks`` (anything may follow): the body of a function run by ``rlightning_comm.run(fn, N)``. It runs on
  N gloo ranks through the launcher's own per-rank entry (``launch._rank_main``: torchrun's placement variables, gloo on
  loopback, the world initialised, a file store), on the suite's reusable spawned ranks (N in 1, 2, 4, 8), and must not
  raise on any rank. Nothing else is added around it: it imports and defines what it uses.
- Anything else: the block runs as written, once, in a fresh namespace of one process with no distributed world.

A block that fails is reported with its file's own line numbers (the source is padded so that line ``k`` of the
traceback is line ``k`` of the file). Assert in the block what its comments promise, so that a wrong result fails too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RANKS = re.compile(r"# runs on (\d+) ranks?\b")
FILE = re.compile(r"# file: ([\w.-]+\.py)\b")
WORLDS = (1, 2, 4, 8)
TIMEOUT = 120  # seconds for a block on every rank; the world's collectives have run()'s own default timeout


class Block(NamedTuple):
    line: int  # the file's line of the block's first line of code
    source: str
    path: Path = README

    @property
    def first(self) -> str:
        return self.source.split("\n", 1)[0].strip()

    def padded(self) -> str:
        """The source with as many newlines before it as its file has lines above it."""
        return "\n" * (self.line - 1) + self.source


def python_blocks(text: str, path: Path = README) -> list[Block]:
    """Every ```python fenced block of a Markdown text (``path``: the file it was read from)."""
    blocks, lines, start = [], text.splitlines(), None
    for i, line in enumerate(lines, start=1):
        if start is None and line.strip() == "```python":
            start = i + 1
        elif start is not None and line.strip() == "```":
            blocks.append(Block(start, "\n".join(lines[start - 1 : i - 1]) + "\n", path))
            start = None
    if start is not None:
        raise ValueError(f"{path.name}: the ```python block opened at line {start - 1} is never closed")
    return blocks


DOCUMENTS = [README, *sorted(DOCS.rglob("*.md"))]
BLOCKS = [block for doc in DOCUMENTS for block in python_blocks(doc.read_text(), doc)]


def _block_task(rank: int, size: int, url: str, source: str, filename: str) -> None:
    import inspect
    import os

    from rlightning_comm import launch

    code = compile(source, filename, "exec")
    timeout = inspect.signature(launch.run).parameters["timeout"].default  # as rlightning_comm.run(fn, size) does it
    launch._rank_main(exec, (code, {"__name__": "__readme__"}), rank, size, "gloo", url, timeout, env=dict(os.environ))


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.path.relative_to(ROOT)}:line{b.line}" for b in BLOCKS])
def test_readme_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    where = str(block.path.relative_to(ROOT))
    code = compile(block.padded(), str(block.path), "exec")  # every block, excerpts too, is valid Python
    if block.first.startswith("# excerpt"):
        return
    ranks, script = RANKS.match(block.first), FILE.match(block.first)
    if ranks:
        size = int(ranks.group(1))
        assert size in WORLDS, (
            f"{where} line {block.line}: '# runs on {size} ranks': the suite has worlds of {WORLDS} ranks"
        )
        request.getfixturevalue(f"world{size}").run(_block_task, block.padded(), str(block.path), timeout=TIMEOUT)
    elif script:
        path = tmp_path / script.group(1)
        path.write_text(block.padded())
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        env["PYTHONPATH"] = str(ROOT)
        proc = subprocess.run(
            [sys.executable, path.name],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert proc.returncode == 0, (
            f"{where} line {block.line}: python {path.name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    else:
        exec(code, {"__name__": "__readme__"})  # noqa: S102 - running the README's code is what this test is for


def test_the_block_reader_finds_fences_and_keeps_line_numbers():
    text = "# t\n\n```python\nx = 1\ny = 2\n```\n\n```bash\nls\n```\n```python\n# excerpt\n```\n"
    assert python_blocks(text) == [Block(4, "x = 1\ny = 2\n"), Block(12, "# excerpt\n")]
    assert python_blocks(text, DOCS / "x.md")[0].path == DOCS / "x.md"
    assert python_blocks(text)[0].padded().split("\n")[3] == "x = 1"  # line 4 of the text
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n")


def test_the_bench_excerpt_shows_the_columns_the_bench_prints():
    from rlightning_comm.bench.report import _COLUMNS

    guide = DOCS / "benchmarks.md"
    assert _COLUMNS in guide.read_text().splitlines(), (
        f"{guide.name}'s bench excerpt lacks the bench's column line:\n{_COLUMNS}"
    )
