"""Real compute on CPU partitions: ``model(x)`` then ``loss.backward()``, against a step.

The model is 8 x (``Linear(1024, 1024)``, ``Tanh``) in two partitions of four, a batch
of 256 in 8 micro-batches, one intra-op thread (each partition's worker then keeps one
core busy, as a device would). Timed round by round in one process, interleaved so that
the machine's swings hit all alike:

- ``model(x)`` and ``loss.backward()`` (the drop-in path: its backward runs on the
  partitions' workers on CPU);
- the same with the backward left to PyTorch's engine, as on GPUs (``engine``: on CPU
  the engine runs every partition's backward on the caller's thread, one after the
  other; the way ``model(x)`` went before its backward moved to the workers);
- ``ScheduleGPipe(model, loss).step(x, target)`` and ``Schedule1F1B`` on the same model;
- the bound: the first partition's own work on the 8 micro-batches, alone on the main
  thread without the library (forward, recomputation where the checkpoint mode asks for
  it, backward), times ``(m + n - 1) / m``: no pipeline of two such partitions can do
  better.

Each figure is the median over rounds of its ratio to the bound in the same round.

Run from the repository root::

    python benchmarks/cpu_compute/main.py            # about a minute
    python benchmarks/cpu_compute/main.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import GPipe, Schedule1F1B, ScheduleGPipe, pipeline
from torchgpipe.arguments import checkpoint_stop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import count, environment, out_file, parse, settings, write_json  # benchmarks/common.py

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


def build(blocks: int, width: int) -> nn.Sequential:
    """``blocks`` x (Linear, Tanh) as one flat sequence of layers."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def mse(output: Tensor, target: Tensor) -> Tensor:
    """The loss of every path (a mean over samples)."""
    return nn.functional.mse_loss(output, target)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def own_work(partition: nn.Module, x: Tensor, m: int, stop: int) -> Callable[[], None]:
    """The first partition's work on ``m`` micro-batches, alone, without the library."""
    pieces = x.tensor_split(m)

    def work() -> None:
        for i, piece in enumerate(pieces):
            if i < stop:  # checkpointed: a forward without a graph, recomputed below
                with torch.no_grad():
                    partition(piece)
            out = partition(piece)
            out.backward(torch.ones_like(out))

    return work


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The median ratios of every path to the bound, in checkpoint mode ``mode``."""
    torch.manual_seed(0)
    n, m = 2, args.chunks
    layers = build(args.blocks, args.width)
    half = len(layers) // n
    model = GPipe(layers, [half] * n, devices=["cpu"] * n, chunks=m, checkpoint=mode)
    x = torch.randn(args.batch, args.width)
    target = torch.randn(args.batch, args.width)
    gpipe_step, one_f_one_b = ScheduleGPipe(model, mse), Schedule1F1B(model, mse)

    def drop_in() -> None:
        mse(model(x), target).backward()

    def engine() -> None:
        on_workers = pipeline.workers_run_backward
        pipeline.workers_run_backward = lambda devices: False  # type: ignore[assignment]
        try:
            drop_in()
        finally:
            pipeline.workers_run_backward = on_workers  # type: ignore[assignment]

    paths: dict[str, Callable[[], object]] = {
        "model(x)": drop_in,
        "engine": engine,
        "ScheduleGPipe": lambda: gpipe_step.step(x, target),
        "Schedule1F1B": lambda: one_f_one_b.step(x, target),
    }
    own = own_work(model.partitions[0], x, m, checkpoint_stop(model.checkpoint, m))
    for fn in [own, *paths.values()]:  # warm up
        fn()
    ratios: dict[str, list[float]] = {name: [] for name in paths}
    ratios["model(x)/GPipe"] = []
    for _ in range(args.rounds):
        bound = timed(own) * (m + n - 1) / m
        times = {name: timed(fn) for name, fn in paths.items()}
        model.zero_grad(set_to_none=True)
        for name, seconds in times.items():
            ratios[name].append(seconds / bound)
        ratios["model(x)/GPipe"].append(times["model(x)"] / times["ScheduleGPipe"])
    return {
        "checkpoint": mode,
        **{name: statistics.median(values) for name, values in ratios.items()},
    }


def main(argv: list[str] | None = None) -> None:
    """Measure every checkpoint mode, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=count, default=8)
    parser.add_argument("--width", type=count, default=1024)
    parser.add_argument("--batch", type=count, default=256)
    parser.add_argument("--chunks", type=count, default=8)
    parser.add_argument("--rounds", type=count, default=15)
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = parse(parser, argv, width=64, batch=32, rounds=3)
    torch.set_num_threads(1)
    rows = [measure(mode, args) for mode in ("never", "except_last", "always")]
    names = [k for k in rows[0] if k != "checkpoint"]
    print(
        f"{args.blocks} x (Linear({args.width}), Tanh) in 2 partitions, batch {args.batch}, "
        f"m = {args.chunks}, 1 thread; median of {args.rounds} interleaved rounds"
    )
    print(
        "each figure: its time over the bound of the same round; model(x) = model(x) and "
        "loss.backward(),\nengine = the same with the backward in the engine, "
        "ScheduleGPipe / Schedule1F1B = .step(x, target),\nmodel(x)/GPipe = model(x) "
        "over ScheduleGPipe in the same round"
    )
    print(f"{'checkpoint':>12} " + " ".join(f"{name:>14}" for name in names))
    for row in rows:
        print(f"{row['checkpoint']:>12} " + " ".join(f"{row[name]:>14.3f}" for name in names))

    write_json(args.out, {"environment": environment(), "args": settings(args), "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
