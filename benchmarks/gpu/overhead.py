"""GPU overhead: what the pipeline adds per cell with CUDA layers, and streams as devices.

Two measurements on one GPU, every partition on it (each partition still computes on a
stream of its own):

1. Cost per cell. Tiny layers (``Linear(64, 64)`` and ``Tanh``: microseconds of GPU
   work, so the host's time is what is measured), ``n`` one-layer-pair partitions,
   ``m`` micro-batches. Each round times a training step of every path in turn: the
   plain ``nn.Sequential`` on the whole batch, ``model(x)`` then ``loss.backward()``
   (the GPipe path), and each schedule's ``step``. The cost per cell is the median
   over rounds of ``(path - plain) / (n * m)``.
2. Streams as devices. Layers whose kernel spins for ``f`` (``torch.cuda._sleep``, one
   thread, so kernels of different streams run side by side) make a pipeline whose
   forward cannot take less than ``(m + n - 1) * f``, as on ``n`` GPUs; the efficiency
   is that bound over the measured forward (``no_grad``), next to one stream running
   the ``n * m`` kernels one after another.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu/overhead.py
    python benchmarks/gpu/overhead.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.training import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import count, environment, out_file, parse, positive, write_json  # benchmarks/common.py

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"
CUDA = torch.device("cuda", 0)
SCHEDULES: dict[str, Callable[..., Any]] = {
    "ScheduleGPipe": ScheduleGPipe,
    "Schedule1F1B": Schedule1F1B,
    "ScheduleZeroBubble": ScheduleZeroBubble,
    "ScheduleInterleaved1F1B": partial(ScheduleInterleaved1F1B, virtual_stages=2),
}


def synchronized(fn: Callable[[], object]) -> float:
    """Seconds of ``fn()``, the GPU's work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def tiny(n: int, width: int = 64) -> nn.Sequential:
    """``n`` pairs of ``Linear(width, width)`` and ``Tanh``."""
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def measure_cells(n: int, m: int, rounds: int, checkpoint: str) -> dict[str, Any]:
    """Per-cell cost of the GPipe path and each schedule over the plain model."""
    torch.manual_seed(0)
    plain = tiny(n).to(CUDA)
    x = torch.randn(8 * m, 64, device=CUDA)
    target = torch.randn(8 * m, 64, device=CUDA)
    model = GPipe(tiny(n), [2] * n, devices=[CUDA] * n, chunks=m, checkpoint=checkpoint)
    paths: dict[str, Callable[[], object]] = {
        "plain": lambda: _mse(plain(x), target).backward(),
        "model(x) + backward": lambda: _mse(model(x), target).backward(),
    }
    for name, factory in SCHEDULES.items():
        if name == "ScheduleInterleaved1F1B" and (n % 2 or m % (n // 2)):
            continue
        schedule = factory(model, _mse)
        paths[name] = partial(schedule.step, x, target)
    for fn in paths.values():  # warm up: the first calls start workers and allocate
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(synchronized(fn))
    cells = n * m
    per_cell = {
        name: statistics.median(
            (t - p) / cells for t, p in zip(times[name], times["plain"], strict=True)
        )
        for name in paths
        if name != "plain"
    }
    return {
        "n": n,
        "m": m,
        "checkpoint": checkpoint,
        "plain_ms": statistics.median(times["plain"]) * 1e3,
        "step_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "per_cell_us": {name: cost * 1e6 for name, cost in per_cell.items()},
    }


class Spin(nn.Module):
    """Spins its stream for ``cycles`` clock cycles, then adds one."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: Tensor) -> Tensor:
        """Spin, then ``x + 1``."""
        torch.cuda._sleep(self.cycles)
        return x + 1


def cycles_per_second() -> float:
    """The spin kernel's clock, measured: cycles per second of wall time."""
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # warm up
    seconds = min(synchronized(partial(torch.cuda._sleep, cycles)) for _ in range(3))
    return cycles / seconds


def measure_streams(n: int, m: int, f: float, rate: float, rounds: int) -> dict[str, Any]:
    """The spin pipeline's forward against ``(m + n - 1) * f`` and against one stream."""
    layers = nn.Sequential(*(Spin(int(f * rate)) for _ in range(n)))
    model = GPipe(layers, [1] * n, devices=[CUDA] * n, chunks=m)
    x = torch.zeros(m, 4, device=CUDA)

    def pipelined() -> None:
        with torch.no_grad():
            model(x)

    def serial() -> None:
        with torch.no_grad():
            for chunk in x.chunk(m):
                layers(chunk)

    pipelined(), serial()
    ratios, measured = [], []
    for _ in range(rounds):
        t = synchronized(pipelined)
        s = synchronized(serial)
        measured.append(t)
        ratios.append(t / s)
    ideal = (m + n - 1) * f
    seconds = statistics.median(measured)
    return {
        "n": n,
        "m": m,
        "f_ms": f * 1e3,
        "forward_ms": seconds * 1e3,
        "ideal_ms": ideal * 1e3,
        "efficiency": ideal / seconds,
        "vs_one_stream": statistics.median(ratios),
    }


def main(argv: list[str] | None = None) -> None:
    """Measure both tables, print them, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=count, nargs="+", default=[2, 4, 8])
    parser.add_argument("--micro-batches", type=count, nargs="+", default=[4, 32])
    parser.add_argument("--rounds", type=count, default=10, help="timed rounds per row")
    parser.add_argument("--spin-ms", type=positive, default=2.0, help="GPU spin per layer call")
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parse(parser, argv, partitions=[2], micro_batches=[4], rounds=3)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    cells, streams = [], []
    print(f"{'n':>3} {'m':>3} {'ckpt':<12} {'plain ms':>9}  per-cell cost over plain (us)")
    for n in args.partitions:
        for m in args.micro_batches:
            for checkpoint in ("except_last", "never"):
                row = measure_cells(n, m, args.rounds, checkpoint)
                cells.append(row)
                costs = "  ".join(f"{k} {v:7.1f}" for k, v in row["per_cell_us"].items())
                print(f"{n:>3} {m:>3} {checkpoint:<12} {row['plain_ms']:>9.2f}  {costs}",
                      flush=True)  # fmt: skip
    rate = cycles_per_second()
    f = args.spin_ms / 1e3
    print(f"\nspin kernels of {args.spin_ms} ms ({rate / 1e9:.2f} G cycles/s), no_grad forward")
    print(f"{'n':>3} {'m':>3} {'forward ms':>11} {'ideal ms':>9} {'efficiency':>11} "
          f"{'/ one stream':>13}")  # fmt: skip
    for n in args.partitions:
        for m in args.micro_batches:
            row = measure_streams(n, m, f, rate, max(3, args.rounds // 5))
            streams.append(row)
            print(f"{n:>3} {m:>3} {row['forward_ms']:>11.2f} {row['ideal_ms']:>9.2f} "
                  f"{row['efficiency']:>10.1%} {row['vs_one_stream']:>13.3f}",
                  flush=True)  # fmt: skip
    write_json(args.out, {"environment": environment(), "parameters": vars(args) | {
        "out": str(args.out)}, "cells": cells, "streams": streams})  # fmt: skip
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
