"""``python -m benchmarks.netlab run --hosts 4 --rate 1gbit -- <command>``: run ``<command>`` once per host, each in its
host's namespace as rank ``i`` of ``--hosts`` (torchrun's variables, the world meeting at host 0); ``calibrate``: the
achieved rate; ``cleanup``: remove the lab namespaces of dead processes (``--all``: every lab namespace)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.netlab import Lab, LabError, calibrate, cleanup, parse_rate  # noqa: E402


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("netlab run: no command given (put it after --)")
    with Lab(args.hosts, parse_rate(args.rate) if args.rate else None) as lab:
        print(lab.describe(), flush=True)
        if args.hosts > 1:
            print(calibrate(lab), flush=True)
        procs = []
        try:
            for host in range(args.hosts):
                env = {**lab.env(host, rank=host, world_size=args.hosts, port=args.port), "PYTHONPATH": str(ROOT)}
                if os.environ.get("PYTHONPATH"):
                    env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
                procs.append(subprocess.Popen(lab.command(host, command, env)))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            hung = [i for i, p in enumerate(procs) if p.poll() is None]
            if hung:
                print(
                    f"netlab run: hosts {hung} still running after {args.timeout:g} s; stopping them", file=sys.stderr
                )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        codes = [p.returncode for p in procs]
    if any(codes):
        print(f"netlab run: exit codes per host {codes}", file=sys.stderr)
    return next((c for c in codes if c), 0) if not hung else 124


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run a command once per lab host, as rank i of --hosts")
    run.add_argument("--hosts", type=int, default=2)
    run.add_argument(
        "--rate", help="each link's rate, each direction, in tc's notation (1gbit, 2500mbit); unshaped if not given"
    )
    run.add_argument("--port", type=int, default=29500, help="MASTER_PORT on host 0")
    run.add_argument("--timeout", type=float, default=3600, help="seconds before the hosts' commands are stopped")
    run.add_argument("command", nargs=argparse.REMAINDER)
    cal = sub.add_parser("calibrate", help="build a lab of two hosts and measure the achieved rate")
    cal.add_argument("--rate", required=True)
    cal.add_argument("--repeat", type=int, default=3)
    clean = sub.add_parser("cleanup", help="remove the lab namespaces (rlcnl-*) left by dead processes")
    clean.add_argument("--all", action="store_true", help="every lab namespace, live builders' too")
    args = parser.parse_args(argv)
    try:
        if args.action == "run":
            return _run(args)
        if args.action == "calibrate":
            with Lab(2, parse_rate(args.rate)) as lab:
                print(lab.describe())
                for _ in range(args.repeat):
                    print(calibrate(lab), flush=True)
            return 0
        removed = cleanup(stale_only=not args.all)
        print(f"removed {len(removed)} lab namespaces" + (": " + " ".join(removed) if removed else ""))
        return 0
    except LabError as err:
        print(f"netlab: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
