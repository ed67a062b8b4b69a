"""Where a step's time goes: one of our schedules against torch's, in the same processes.

On the compute workload of ``main.py`` (8 blocks of ``Linear(1024, 1024)`` and ``Tanh``,
a batch of 256 in 8 micro-batches, one thread per process, gloo on loopback), each
rank puts a mark before and after each of its blocks: an identity autograd function
that notes the time and its thread's CPU time in the forward and again in the
backward. Our schedule and torch's counterpart take turns for ``--rounds`` rounds, each
step between two barriers. Rank 0 prints medians over the rounds:

- the step, from the first rank's start to the last rank's end;
- per rank, the main thread's CPU time inside the blocks (their forwards and backwards:
  the layers' own work, alike in both libraries) and outside them (the library's work
  on that thread, the transfers' and the loss's included);
- the time when no rank is inside a block: before the first starts (``start``), between
  blocks (``middle``), and after the last ends (``end``);
- per rank, the main thread's minor page faults (a fresh page's first touch, which
  costs CPU time: a new buffer above glibc's mmap threshold, or memory given back to
  the system and taken again, pays one per page);
- per rank and step, the wakeups (voluntary context switches, from ``/proc``) of the
  main thread and of the other threads by name (gloo's loop, our side channel's
  listeners).

The marks cost both libraries alike (a few microseconds per block). Linux only.
Run from the repository root::

    python benchmarks/distributed/where.py --processes 4 --schedule 1F1B
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import join_gloo  # benchmarks/common.py
from main import OURS, _ours, _torch, model, spawn_ranks  # benchmarks/distributed/main.py

# This process's marks: (direction, mark, wall time, thread CPU time); mark 0 before a
# block, 1 after it. In the backward, a block starts at its mark 1 and ends at its mark 0.
_MARKS: list[tuple[str, int, float, float]] = []


class _Note(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor, mark: int) -> Tensor:
        ctx.mark = mark
        _MARKS.append(("F", mark, time.perf_counter(), time.thread_time()))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        _MARKS.append(("B", ctx.mark, time.perf_counter(), time.thread_time()))
        return grad, None, None


class Mark(nn.Module):
    """A mark; its anchor wants a gradient, so that the backward of every mark runs."""

    def __init__(self, mark: int) -> None:
        super().__init__()
        self.mark = mark
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        return _Note.apply(x, self.anchor, self.mark)  # type: ignore[no-any-return]


def marked(workload: str, stages: int, f: float) -> nn.Sequential:
    """``main.model``'s blocks, each between two marks."""
    return nn.Sequential(
        *[nn.Sequential(Mark(0), block, Mark(1)) for block in model(workload, stages, f)]
    )


def spans(marks: list[tuple[str, int, float, float]]) -> list[tuple[float, float, float]]:
    """Each block's forward and backward: (start, end, CPU time), from a rank's marks."""
    out, opened = [], None
    for direction, mark, wall, cpu in marks:
        starts = mark == (0 if direction == "F" else 1)
        if starts:
            opened = (wall, cpu)
        elif opened is not None:
            out.append((opened[0], wall, cpu - opened[1]))
            opened = None
    return out


def faults() -> int:
    """Minor page faults so far of the calling thread (a fresh page's first touch)."""
    stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


def wakeups() -> dict[str, int]:
    """Voluntary context switches so far of each thread of this process, by thread name."""
    main, names = threading.get_native_id(), {t.native_id: t.name for t in threading.enumerate()}
    counts: Counter[str] = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        switches = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
        name = "main" if int(tid) == main else re.sub(r"-\d+$", "", names.get(int(tid), comm))
        counts[name] += switches
    return dict(counts)


def _worker(rank: int, n: int, args: argparse.Namespace, port: int, out: Any) -> None:
    try:
        join_gloo(rank, n, port, 600)
        ours, theirs = args.schedule, OURS[args.schedule][2]
        steps = {
            ours: _ours("compute", n, 8, 0.0, ours, build=marked)[0],
            theirs: _torch("compute", rank, n, 8, 0.0, theirs, build=marked),
        }
        for step in steps.values():
            step()
        records: dict[str, list[Any]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                dist.barrier()
                before = wakeups()
                _MARKS.clear()
                touched = faults()
                start, cpu = time.perf_counter(), time.thread_time()
                step()
                end, cpu = time.perf_counter(), time.thread_time() - cpu
                touched = faults() - touched
                after = wakeups()
                dist.barrier()
                woke = {k: after[k] - before.get(k, 0) for k in after}
                records[name].append((start, end, cpu, spans(_MARKS), woke, touched))
        gathered: list[Any] = [None] * n
        dist.all_gather_object(gathered, records)
        if rank == 0:
            out.put(("report", report(gathered, n)))
        dist.barrier()
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def report(ranks: list[dict[str, list[Any]]], n: int) -> str:
    """The medians over the rounds, as text."""
    median = statistics.median
    lines = []
    for name in ranks[0]:
        rounds = range(len(ranks[0][name]))
        steps, start, middle, end = [], [], [], []
        inside: list[list[float]] = [[] for _ in range(n)]
        outside: list[list[float]] = [[] for _ in range(n)]
        for k in rounds:
            records = [ranks[r][name][k] for r in range(n)]
            first, last = min(x[0] for x in records), max(x[1] for x in records)
            steps.append(last - first)
            for r, (_, _, cpu, blocks, _, _) in enumerate(records):
                inside[r].append(sum(c for _, _, c in blocks))
                outside[r].append(cpu - inside[r][-1])
            edges = sorted(e for x in records for a, b, _ in x[3] for e in ((a, 1), (b, -1)))
            start.append(edges[0][0] - first)
            end.append(last - edges[-1][0])
            busy, idle = 0, 0.0
            for (t, change), (later, _) in pairwise(edges):
                busy += change
                idle += later - t if busy == 0 else 0.0
            middle.append(idle)
        ms = lambda xs: f"{median(xs) * 1e3:.1f}"  # noqa: E731
        lines.append(f"{name}: step {ms(steps)} ms")
        lines.append(f"  main thread CPU ms inside blocks, per rank:  {[ms(x) for x in inside]}")
        lines.append(f"  main thread CPU ms outside blocks, per rank: {[ms(x) for x in outside]}")
        touched = [f"{median(x[5] for x in ranks[r][name]):g}" for r in range(n)]
        lines.append(f"  main thread page faults per rank: {touched}")
        lines.append(
            f"  no rank in a block, ms: start {ms(start)}, middle {ms(middle)}, end {ms(end)}"
        )
        for r in range(n):
            names = sorted({k for x in ranks[r][name] for k in x[4]})
            woke = {k: median(x[4].get(k, 0) for x in ranks[r][name]) for k in names}
            text = ", ".join(f"{k} {v:g}" for k, v in woke.items() if v)
            lines.append(f"  rank {r} wakeups per step: {text}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument(
        "--schedule", default="1F1B", choices=[k for k, v in OURS.items() if v[0] == 1]
    )
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n = args.processes
    value = spawn_ranks(_worker, n, args, timeout=1800)
    print(f"{n} processes, compute workload, {args.rounds} rounds, medians")
    print(value)


if __name__ == "__main__":
    main()
