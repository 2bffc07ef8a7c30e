"""``rlightning-comm bench`` / ``python -m rlightning_comm.bench``: arguments, and where the ranks come from.

Under a launcher (``RANK`` and ``WORLD_SIZE`` set, as torchrun sets them) this process is one rank of the launcher's
world (``env://``). Otherwise it spawns ``--nproc`` local ranks that meet through a file store in a temporary directory
(no port is opened), and waits for them: a rank that fails brings the others down after a short grace period instead of
leaving them hanging.

Exit status: 0 when every result was right, 1 when any was wrong, 2 on an error (bad arguments, a rank that crashed or
hung).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

from pydantic import ValidationError

from rlightning_comm.bench.config import DTYPES, OPS, BenchConfig, parse_ops, parse_sizes
from rlightning_comm.launch import _process_context

EXIT_OK, EXIT_WRONG, EXIT_ERROR = 0, 1, 2
_GRACE_S = 10.0  # after one rank fails, how long the others get to notice before they are killed


def build_parser(prog: str = "rlightning-comm bench") -> argparse.ArgumentParser:
    """The bench's argument parser."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Time every collective of rlightning_comm against raw torch.distributed, like nccl-tests: time, algbw, "
            "busbw and wrong results per size."
        ),
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to spawn (default: one per GPU with nccl, else 2); ignored under torchrun",
    )
    p.add_argument("--backend", default="gloo", help="registered communicator: gloo (default) or nccl")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="where tensors live (default: cuda with nccl, else cpu)"
    )
    p.add_argument(
        "--sizes",
        default="1K:4M",
        help="MIN:MAX (stepped by --factor), a list 1K,1M or one size; K/M/G are binary (default 1K:4M)",
    )
    p.add_argument("--factor", type=int, default=4, help="multiplier between sizes of a MIN:MAX range (default 4)")
    p.add_argument("--ops", default="all", help=f"'all' or a comma-separated subset of {','.join(OPS)}")
    p.add_argument(
        "--mode", default="GLOBAL", help="mode to run on; other than GLOBAL it is bound to groups of --group-size ranks"
    )
    p.add_argument("--group-size", type=int, default=None, help="ranks per group of --mode (default: the whole world)")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(sorted(DTYPES))}")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and path (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed, still checked, calls first (default 5)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each row N times: overhead is their median, with the min..max spread (default 1)",
    )
    p.add_argument("--dict-keys", type=int, default=64, help="keys of the all_reduce_dict payload (default 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="timeout of each collective in seconds (default 300)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every figure as JSON")
    p.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        metavar="PATH.png",
        help="draw busbw against size per op (needs matplotlib: the 'plot' extra)",
    )
    p.add_argument(
        "--inject-wrong", default=None, choices=OPS, help=argparse.SUPPRESS
    )  # test hook: corrupt one op's results
    return p


def _launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _config(args: argparse.Namespace, argv: Sequence[str]) -> tuple[BenchConfig, int]:
    """Validate everything before a rank starts; returns the config and the number of ranks to spawn."""
    import torch

    from rlightning_comm.bench import report
    from rlightning_comm.communicators.registry import get_communicator_class

    backend_cls = get_communicator_class(args.backend)  # KeyError lists the registered names
    on_nccl = backend_cls.backend == "nccl"
    device = args.device or ("cuda" if on_nccl else "cpu")
    if (on_nccl or device == "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"backend {args.backend!r} with device {device!r} needs CUDA, and torch.cuda.is_available() is False; use "
            "--backend gloo --device cpu"
        )
    if on_nccl and device != "cuda":
        raise ValueError("backend nccl needs --device cuda")
    if args.plot_path and not report.matplotlib_available():
        raise ValueError(report.PLOT_MISSING)
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() if on_nccl else 2)
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1; got {nproc}")
    cfg = BenchConfig(
        sizes=parse_sizes(args.sizes, args.factor),
        ops=parse_ops(args.ops),
        backend=args.backend,
        device=device,
        mode=args.mode,
        group_size=args.group_size,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        repeat=args.repeat,
        dict_keys=args.dict_keys,
        timeout=args.timeout,
        json_path=os.path.abspath(args.json_path) if args.json_path else None,
        plot_path=os.path.abspath(args.plot_path) if args.plot_path else None,
        inject_wrong=args.inject_wrong,
        argv=tuple(argv),
    )
    world = int(os.environ["WORLD_SIZE"]) if _launched() else nproc
    size = cfg.group_size or world
    if world % size or (cfg.mode == "GLOBAL" and size != world):
        raise ValueError(
            f"--group-size {size} must divide the world size {world}, and needs a --mode other than GLOBAL when "
            "smaller than the world"
        )
    return cfg, nproc


def main(argv: Sequence[str] | None = None, prog: str = "rlightning-comm bench") -> int:
    """Run the bench; returns the exit status (0 right, 1 wrong results, 2 error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        cfg, nproc = _config(args, argv)
    except (ValueError, KeyError, ValidationError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    if _launched():
        from rlightning_comm.bench.runner import run_rank

        if args.nproc is not None and int(os.environ["RANK"]) == 0:
            print(
                f"# --nproc {args.nproc} ignored: running on the launcher's {os.environ['WORLD_SIZE']} ranks",
                flush=True,
            )
        return _guarded(run_rank, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", cfg)
    return spawn(cfg, nproc)


def _guarded(fn, rank: int, world_size: int, url: str, cfg: BenchConfig) -> int:
    try:
        return fn(rank, world_size, url, cfg)
    except Exception:  # noqa: BLE001 - report, with the rank, and exit with the error status
        print(f"[rank {rank}] bench failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return EXIT_ERROR


def _child(rank: int, world_size: int, url: str, cfg: BenchConfig, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment (a rank forked from the fork server has the server's)
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(rank)
    from rlightning_comm.bench.runner import run_rank

    sys.exit(_guarded(run_rank, rank, world_size, url, cfg))


def spawn(cfg: BenchConfig, nproc: int) -> int:
    """Run ``nproc`` local ranks on a file store and wait for all of them (bounded after a failure)."""
    store = tempfile.mkdtemp(prefix="rlc-bench-")
    ctx, env = _process_context(), dict(os.environ)  # forked from a fork server that imported torch once (Linux)
    procs = [
        ctx.Process(target=_child, args=(r, nproc, f"file://{store}/store", cfg, env), name=f"bench-rank{r}")
        for r in range(nproc)
    ]
    try:
        for p in procs:
            p.start()
        deadline = None
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(timeout=0.1)
            failed = [p for p in procs if p.exitcode not in (None, EXIT_OK, EXIT_WRONG)]
            if failed and deadline is None:
                deadline = time.monotonic() + _GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                alive = [p for p in procs if p.is_alive()]
                print(
                    f"rlightning-comm bench: error: {failed[0].name} failed; stopping {len(alive)} rank(s) still "
                    "waiting on it",
                    file=sys.stderr,
                )
                for p in alive:
                    p.kill()
                    p.join(timeout=5)
                return EXIT_ERROR
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return exit_status([p.exitcode for p in procs])


def exit_status(codes: Sequence[int | None]) -> int:
    """The command's status from the ranks' exit codes: an error anywhere wins, then wrong results."""
    if any(c not in (EXIT_OK, EXIT_WRONG) for c in codes):
        return EXIT_ERROR
    return max(codes, default=EXIT_ERROR)
