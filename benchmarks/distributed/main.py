"""Distributed schedules: each one's step across processes against its simulated makespan.

One process per rank, gloo on loopback, one thread each. The layers are the sleep layers
of ``benchmarks/schedules``: a forward sleeps ``f``, a backward ``2 f`` (``f`` towards
the layer's input, the ``B`` of a split backward, and ``f`` towards its weight, the
``W``). Stage 0's input wants no gradient, so its backward sleeps ``f`` only (and its
``B`` nothing); the simulated makespan charges exactly that. For GPipe, 1F1B, ZB-H1
(one stage per process) and interleaved 1F1B (two stages per process, layers of
``f / 2``), ``n`` processes and ``m`` micro-batches, each rank builds its
``torchgpipe.distributed.PipelineStage``, runs a warm-up step, then ``repeats`` timed
steps between barriers; the row keeps rank 0's median. Cells are not checkpointed.

In the same run, as the reference: ``torch.distributed.pipelining``'s ``ScheduleGPipe``
and ``Schedule1F1B`` on the same layers and processes (``benchmarks/schedules/
reference.py``), against the makespan of the same tables.

Run from the repository root::

    python benchmarks/distributed/main.py            # about four minutes
    python benchmarks/distributed/main.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchgpipe.distributed import (
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)
from torchgpipe.schedules import Action, Schedule, gpipe, one_f_one_b, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "schedules"))
from common import environment, settings, write_json  # benchmarks/common.py
from reference import (  # benchmarks/schedules/reference.py
    FEATURES,
    SleepLayer,
    free_port,
    measure_reference,
    mse,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"

# name: (stages per process, schedule class)
RUNNERS: dict[str, tuple[int, type[PipelineSchedule]]] = {
    "GPipe": (1, ScheduleGPipe),
    "1F1B": (1, Schedule1F1B),
    "interleaved-1F1B": (2, ScheduleInterleaved1F1B),
    "ZB-H1": (1, ScheduleZeroBubble),
}


def makespan(table: Schedule, f: float, v: int) -> float:
    """The simulated makespan of ``table`` with layers of ``f / v``.

    A forward and a weight gradient cost a layer's sleep; an input gradient too, and a
    whole backward twice that, except on stage 0, whose input wants no gradient.
    """
    layer, split = f / v, table.splits_backward

    def cost(action: Action) -> float:
        if action.kind in ("F", "W"):
            return layer
        if action.stage == 0:
            return 0.0 if split else layer
        return layer if split else 2 * layer

    return simulate(table, cost).makespan


def _time_schedule(
    rank: int, n: int, m: int, name: str, f: float, repeats: int
) -> tuple[float, Schedule]:
    v, factory = RUNNERS[name]
    layers = nn.Sequential(*[SleepLayer(f / v) for _ in range(n * v)])
    stage = PipelineStage(layers, [1] * (n * v), chunks=m, checkpoint="never")
    schedule = factory(stage, mse)
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, FEATURES, generator=generator)
    target = torch.randn(m, FEATURES, generator=generator)

    def step() -> None:
        stage.zero_grad(set_to_none=True)
        schedule.step(x if stage.is_first else None, target if stage.is_last else None)

    step()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), schedule.table(m)


def _worker(rank: int, n: int, ms: list[int], f: float, repeats: int, port: int, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=600),
        )
        rows = []
        for m in ms:
            for name, (v, _) in RUNNERS.items():
                if v > 1 and m % n:
                    continue  # interleaving sends micro-batches in groups of n
                step_s, table = _time_schedule(rank, n, m, name, f, repeats)
                span = makespan(table, f, v)
                rows.append(
                    {
                        "n": n,
                        "m": m,
                        "schedule": name,
                        "step_s": step_s,
                        "makespan_s": span,
                        "ratio": step_s / span,
                    }
                )
        dist.barrier()
        if rank == 0:
            out.put(("rows", rows))
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def measure(n: int, ms: list[int], f: float, repeats: int) -> list[dict[str, Any]]:
    """Every schedule of torchgpipe.distributed on ``n`` processes; rank 0's rows."""
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(r, n, ms, f, repeats, port, out), daemon=True)
        for r in range(n)
    ]
    for process in processes:
        process.start()
    try:
        kind, value = out.get(timeout=1800)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if kind == "error":
        raise RuntimeError(value)
    return list(value)


def reference(n: int, ms: list[int], f: float, repeats: int) -> list[dict[str, Any]]:
    """torch.distributed.pipelining's schedules on the same layers and processes."""
    tables = {"ScheduleGPipe": gpipe, "Schedule1F1B": one_f_one_b}
    rows = []
    for row in measure_reference(n, [m for m in ms if m >= n], f, repeats):
        span = makespan(tables[row["schedule"]](n, row["m"]), f, 1)
        rows.append(
            {
                **row,
                "schedule": f"torch {row['schedule']}",
                "makespan_s": span,
                "ratio": row["step_s"] / span,
            }
        )
    return rows


def table_text(rows: list[dict[str, Any]]) -> str:
    lines = [
        "ratio = measured step / simulated makespan (1.0: no overhead at all)",
        f"{'n':>3} {'m':>4}  {'schedule':<22} {'makespan ms':>12} {'step ms':>9} {'ratio':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['n']:>3} {r['m']:>4}  {r['schedule']:<22} {r['makespan_s'] * 1e3:>12.1f} "
            f"{r['step_s'] * 1e3:>9.1f} {r['ratio']:>7.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--sleep-ms", type=float, default=10.0, help="forward sleep per layer")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row")
    parser.add_argument("--no-reference", action="store_true", help="skip torch's schedules")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.processes, args.micro_batches = [2], [4]
        args.sleep_ms, args.repeats = 2.0, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    f = args.sleep_ms / 1e3
    rows: list[dict[str, Any]] = []
    for n in args.processes:
        rows += measure(n, args.micro_batches, f, args.repeats)
        print(table_text(rows[-1:]).splitlines()[-1], flush=True)
        if not args.no_reference:
            rows += reference(n, args.micro_batches, f, args.repeats)
    rows.sort(key=lambda r: (r["n"], r["m"]))
    print()
    print(table_text(rows), flush=True)
    parameters = settings(args)
    write_json(args.out, {"environment": environment(), "parameters": parameters, "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
