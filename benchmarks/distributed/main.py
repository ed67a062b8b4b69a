"""Distributed schedules against torch.distributed.pipelining's, interleaved in one run.

One process per rank, gloo on loopback, one thread each. In the same processes, on
the same layers, every rank builds our four schedules (``torchgpipe.distributed``:
GPipe, 1F1B, ZB-H1, interleaved 1F1B; GPipe and 1F1B also with ``static_shapes=True``,
torch's own assumption, which sends no metadata) and torch's ``ScheduleGPipe`` and
``Schedule1F1B`` (``torch.distributed.pipelining``), warms each up with one step, then
runs rounds: in each round every schedule steps once, in turn (ours, torch's, ours,
torch's...), each step between two barriers, timed on rank 0. So the machine's swings
hit both alike, and each row's ratio to torch's counterpart is the median of the
per-round ratios (ZB-H1 and interleaved 1F1B are compared with torch's 1F1B).

Two workloads:

- **sleep**: the sleep layers of ``benchmarks/schedules`` (a forward sleeps ``f``, a
  backward ``2 f``: ``f`` towards the input, the ``B`` of a split backward, and ``f``
  towards the weight, the ``W``), one per stage (two of ``f / 2`` per process for
  interleaving); ``m`` micro-batches of one sample. The row also gives each schedule's
  step over the makespan that ``torchgpipe.schedules.simulate`` gives for its table.
- **compute**: 8 blocks of ``Linear(1024, 1024)`` and ``Tanh``, a batch of 256 in 8
  micro-batches, the blocks split evenly over the stages.

Our stages are not checkpointed (``checkpoint='never'``): torch's schedules keep every
activation too.

Run from the repository root::

    python benchmarks/distributed/main.py            # about ten minutes
    python benchmarks/distributed/main.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed import pipelining

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
from common import (  # benchmarks/common.py
    count,
    environment,
    free_port,
    join_gloo,
    out_file,
    parse,
    positive,
    settings,
    write_json,
)
from reference import FEATURES, SleepLayer, mse  # benchmarks/schedules/reference.py

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"

# name: (stages per process, schedule class, torch's counterpart, static shapes)
OURS: dict[str, tuple[int, type[PipelineSchedule], str, bool]] = {
    "GPipe": (1, ScheduleGPipe, "torch ScheduleGPipe", False),
    "GPipe static": (1, ScheduleGPipe, "torch ScheduleGPipe", True),
    "1F1B": (1, Schedule1F1B, "torch Schedule1F1B", False),
    "1F1B static": (1, Schedule1F1B, "torch Schedule1F1B", True),
    "ZB-H1": (1, ScheduleZeroBubble, "torch Schedule1F1B", False),
    "interleaved-1F1B": (2, ScheduleInterleaved1F1B, "torch Schedule1F1B", False),
}
TORCH = {
    "torch ScheduleGPipe": pipelining.ScheduleGPipe,
    "torch Schedule1F1B": pipelining.Schedule1F1B,
}

BLOCKS, WIDTH, BATCH, COMPUTE_M = 8, 1024, 256, 8  # the compute workload


def makespan(table: Schedule, f: float, v: int) -> float:
    """The simulated makespan of ``table`` with sleep layers of ``f / v``.

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


def model(workload: str, stages: int, f: float) -> nn.Sequential:
    """The whole model: a sleep layer of ``f`` per stage, or the compute blocks."""
    if workload == "sleep":
        return nn.Sequential(*[SleepLayer(f) for _ in range(stages)])
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    )


def batch(workload: str, m: int) -> tuple[Tensor, Tensor]:
    """The input and target, the same on every rank."""
    generator = torch.Generator().manual_seed(m)
    if workload == "sleep":
        shape: tuple[int, ...] = (m, FEATURES)
    else:
        shape = (BATCH, WIDTH)
    return torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)


Build = Callable[[str, int, float], nn.Sequential]  # model() or one that wraps it


def _ours(
    workload: str, n: int, m: int, f: float, name: str, build: Build = model
) -> tuple[Callable[[], None], Any]:
    v, factory, _, static = OURS[name]
    stages = n * v
    layers = build(workload, stages, f / v)
    balance = [len(layers) // stages] * stages
    stage = PipelineStage(layers, balance, chunks=m, checkpoint="never", static_shapes=static)
    schedule = factory(stage, mse)
    x, target = batch(workload, m)

    def step() -> None:
        stage.zero_grad(set_to_none=True)
        schedule.step(x if stage.is_first else None, target if stage.is_last else None)

    return step, schedule.table(m)


def _torch(
    workload: str, rank: int, n: int, m: int, f: float, name: str, build: Build = model
) -> Callable[[], None]:
    layers = build(workload, n, f)
    per = len(layers) // n
    submodule = copy.deepcopy(nn.Sequential(*layers[rank * per : (rank + 1) * per]))
    stage = pipelining.PipelineStage(
        submodule, stage_index=rank, num_stages=n, device=torch.device("cpu")
    )
    schedule = TORCH[name](stage, n_microbatches=m, loss_fn=mse)
    x, target = batch(workload, m)

    def step() -> None:
        submodule.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == n - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()

    return step


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _rows(rank: int, n: int, workload: str, m: int, f: float, rounds: int) -> list[dict[str, Any]]:
    """Every schedule, ours and torch's, over ``rounds`` interleaved rounds."""
    steps: dict[str, Callable[[], None]] = {}
    spans: dict[str, float] = {}
    for name, (v, _, reference, _) in OURS.items():
        if v > 1 and m % n:
            continue  # interleaving sends micro-batches in groups of n
        if workload == "compute" and BLOCKS % (n * v):
            continue
        steps[name], table = _ours(workload, n, m, f, name)
        spans[name] = makespan(table, f, v) if workload == "sleep" else 0.0
        if reference not in steps:
            steps[reference] = _torch(workload, rank, n, m, f, reference)
    for step in steps.values():
        step()  # warm-up: torch's first step also infers the shapes
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_timed(step))
    rows = []
    for name, measured in times.items():
        row: dict[str, Any] = {
            "workload": workload,
            "n": n,
            "m": m,
            "schedule": name,
            "step_s": statistics.median(measured),
        }
        if name in OURS:
            reference = OURS[name][2]
            ratios = [a / b for a, b in zip(measured, times[reference], strict=True)]
            row["reference"] = reference
            row["over_reference"] = statistics.median(ratios)
        if workload == "sleep" and f > 0:  # --sleep-ms 0: the libraries' own cost alone
            span = spans[name] if name in OURS else makespan(_torch_table(name, n, m), f, 1)
            row["makespan_s"] = span
            row["over_makespan"] = row["step_s"] / span
        rows.append(row)
    return rows


def _torch_table(name: str, n: int, m: int) -> Schedule:
    """The table that torch's schedule ``name`` follows."""
    return gpipe(n, m) if name == "torch ScheduleGPipe" else one_f_one_b(n, m)


def _worker(rank: int, n: int, args: argparse.Namespace, port: int, out: Any) -> None:
    try:
        join_gloo(rank, n, port, 600)
        f = args.sleep_ms / 1e3
        rows = []
        for m in args.micro_batches:
            rows += _rows(rank, n, "sleep", m, f, args.rounds)
        if args.compute:
            rows += _rows(rank, n, "compute", COMPUTE_M, f, args.rounds)
        dist.barrier()
        if rank == 0:
            out.put(("rows", rows))
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def measure(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row on ``n`` processes; rank 0's."""
    return list(spawn_ranks(_worker, n, args, timeout=3600))


def spawn_ranks(worker: Callable[..., None], n: int, args: Any, *, timeout: float) -> Any:
    """Run ``worker(rank, n, args, port, out)`` in ``n`` processes; the value one puts.

    A worker puts ``("error", text)`` or a result ``(kind, value)`` on ``out``; an
    error is raised here as a RuntimeError with its text.
    """
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=worker, args=(r, n, args, port, out), daemon=True) for r in range(n)
    ]
    for process in processes:
        process.start()
    try:
        kind, value = out.get(timeout=timeout)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if kind == "error":
        raise RuntimeError(value)
    return value


def table_text(rows: list[dict[str, Any]]) -> str:
    lines = [
        "/torch: our step over torch's counterpart's, median of per-round ratios "
        "(ZB-H1, interleaved: over torch's 1F1B)",
        "/makespan: the step over the simulated makespan of its table (sleep layers)",
        f"{'workload':<8} {'n':>2} {'m':>3}  {'schedule':<20} {'step ms':>9} "
        f"{'/torch':>7} {'/makespan':>10}",
    ]
    for r in rows:
        over = f"{r['over_reference']:.3f}" if "over_reference" in r else ""
        span = f"{r['over_makespan']:.3f}" if "over_makespan" in r else ""
        lines.append(
            f"{r['workload']:<8} {r['n']:>2} {r['m']:>3}  {r['schedule']:<20} "
            f"{r['step_s'] * 1e3:>9.1f} {over:>7} {span:>10}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=count, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=count, nargs="+", default=[4, 8, 16])
    parser.add_argument("--sleep-ms", type=positive, default=10.0, help="forward sleep per layer")
    parser.add_argument("--rounds", type=count, default=7, help="interleaved rounds per row")
    parser.add_argument("--no-compute", dest="compute", action="store_false")
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parse(
        parser, argv, processes=[2], micro_batches=[4], sleep_ms=2.0, rounds=1, compute=False
    )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    for n in args.processes:
        measured = measure(n, args)
        print(table_text(measured), flush=True)
        rows += measured
    print()
    print(table_text(rows), flush=True)
    write_json(args.out, {"environment": environment(), "parameters": settings(args), "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
