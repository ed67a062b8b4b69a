"""Peak memory per process: a model built on the meta device against one built whole.

Eight processes (gloo on loopback) each hold one eighth of a model of eight equal
blocks, so the model is eight times each process's share. Two ways to build it, in
fresh processes each time:

- ``whole``: every process builds the model on the CPU, then ``PipelineStage`` keeps
  its own layers (the others are dropped when the model goes);
- ``meta``: every process builds the model under ``torch.device("meta")`` (no memory),
  then ``PipelineStage`` allocates and resets only its own layers.

Each process reports how much its peak resident memory grew while building (``ru_maxrss``
after, less before: what the build cost on top of Python and torch), and the bytes of
its own parameters. The table shows, per way, the largest growth over the processes and
its ratio to the share.

Run from the repository root::

    python benchmarks/materialize/main.py            # about a minute
    python benchmarks/materialize/main.py --quick    # smaller blocks, 2 processes
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchgpipe.distributed import PipelineStage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # benchmarks/common.py
    count,
    environment,
    free_port,
    join_gloo,
    out_file,
    parse,
    settings,
    write_json,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


def build(processes: int, width: int) -> nn.Sequential:
    """``processes`` blocks of two ``Linear(width, width)`` with a ReLU between."""
    layers: list[nn.Module] = []
    for _ in range(processes):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _worker(rank: int, n: int, width: int, way: str, port: int, out: Any) -> None:
    try:
        join_gloo(rank, n, port, 300)
        before = _peak_bytes()
        if way == "meta":
            with torch.device("meta"):
                model = build(n, width)
        else:
            model = build(n, width)
        stage = PipelineStage(model, [3] * n)
        del model
        grown = _peak_bytes() - before
        share = sum(p.numel() * p.element_size() for p in stage.parameters())
        dist.barrier()
        out.put(("row", {"way": way, "rank": rank, "peak_growth": grown, "share": share}))
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def measure(n: int, width: int, way: str) -> list[dict[str, Any]]:
    """Every process's row, for ``n`` fresh processes building the model ``way``."""
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(r, n, width, way, port, out), daemon=True)
        for r in range(n)
    ]
    for process in processes:
        process.start()
    rows = []
    try:
        for _ in range(n):
            kind, value = out.get(timeout=600)
            if kind == "error":
                raise RuntimeError(value)
            rows.append(value)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return sorted(rows, key=lambda row: row["rank"])


def main(argv: list[str] | None = None) -> None:
    """Measure both ways, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=count, default=8)
    parser.add_argument("--width", type=count, default=2048)
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="2 processes, small blocks")
    args = parse(parser, argv, processes=2, width=256)
    env = environment()
    rows = {way: measure(args.processes, args.width, way) for way in ("whole", "meta")}
    share = rows["meta"][0]["share"]
    total = share * args.processes
    print(
        f"{args.processes} processes, each holding 1/{args.processes} of a model of "
        f"{total / 2**20:.1f} MiB of parameters ({share / 2**20:.1f} MiB each)\n"
        f"peak growth: how much a process's peak resident memory grew while building\n"
    )
    print(f"{'way':>6} {'largest peak growth MiB':>24} {'over the share':>15}")
    summary = {}
    for way, its in rows.items():
        largest = max(row["peak_growth"] for row in its)
        summary[way] = {"largest_peak_growth": largest, "over_share": largest / share}
        print(f"{way:>6} {largest / 2**20:>24.1f} {largest / share:>15.2f}")

    write_json(
        args.out,
        {"environment": env, "args": settings(args), "rows": rows, "summary": summary},
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
