"""Schedules: each one's measured training step against its simulated makespan.

Sleep layers on CPU partitions, one layer per partition: a forward sleeps ``f``, a
backward ``2 f`` (``f`` on the way to the layer's input, which is the ``B`` of a split
backward, and ``f`` on the way to its weight, the ``W``). For each schedule (GPipe,
1F1B, interleaved 1F1B with two virtual stages per rank, ZB-H1), ``n`` ranks and ``m``
micro-batches, the step is timed (median of repeats) and set against
``torchgpipe.schedules.simulate`` of the same table with those costs; the target is a
step within 5% of the makespan. Interleaving gives each rank two partitions whose layers
sleep ``f / 2`` (and ``f`` in backward), so the work per rank is the same; it needs
``m`` to be a multiple of ``n``, so the row ``n = 8, m = 4`` has none. The peak
number of micro-batches each stage held, as the step counted it, sits beside the
simulator's. Cells are not checkpointed (``checkpoint='never'``), so a backward does
not repeat the forward and the costs are the simulator's.

In the same table, as the reference: PyTorch's ``torch.distributed.pipelining``
``ScheduleGPipe`` and ``Schedule1F1B`` on the same layers, one process per stage,
gloo on loopback (``reference.py``; rows with ``m >= n`` only, which its 1F1B needs).
Their first stage's input wants no gradient, so that stage's backward sleeps ``f``
only and their least time is ``f`` under the makespan given for them.

Run from the repository root::

    python benchmarks/schedules/main.py            # a few minutes
    python benchmarks/schedules/main.py --quick    # a smoke test
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

from torchgpipe import (
    GPipe,
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)
from torchgpipe.schedules import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # benchmarks/common.py
    count,
    environment,
    out_file,
    parse,
    positive,
    settings,
    write_json,
)
from reference import SleepLayer, measure_reference  # benchmarks/schedules/reference.py

TARGET = 1.05
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"

Runner = Callable[[GPipe], PipelineSchedule]


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


RUNNERS: dict[str, tuple[int, Runner]] = {  # name: (virtual stages per rank, runner)
    "GPipe": (1, lambda model: ScheduleGPipe(model, _mse)),
    "1F1B": (1, lambda model: Schedule1F1B(model, _mse)),
    "interleaved-1F1B": (2, lambda model: ScheduleInterleaved1F1B(model, _mse, virtual_stages=2)),
    "ZB-H1": (1, lambda model: ScheduleZeroBubble(model, _mse)),
}


def measure_costs(f: float, calls: int) -> dict[str, float]:
    """What one layer's F, B and W take as timed on the main thread (medians).

    A little more than ``f``, ``f`` and ``f`` (``2 f`` for an unsplit ``B``): each sleep
    overshoots, and a thread that wakes from one runs its next operators slowly on a VM.
    """
    layer = SleepLayer(f)
    x = torch.randn(1, 4, requires_grad=True)
    forward, whole, inputs, weights = [], [], [], []
    for _ in range(calls):
        start = time.perf_counter()
        y = layer(x)
        forward.append(time.perf_counter() - start)
        start = time.perf_counter()
        y.sum().backward()
        whole.append(time.perf_counter() - start)
        y = layer(x)
        start = time.perf_counter()
        torch.autograd.backward(y.sum(), inputs=[x])
        inputs.append(time.perf_counter() - start)
        y = layer(x)
        start = time.perf_counter()
        torch.autograd.backward(y.sum(), inputs=[layer.scale])
        weights.append(time.perf_counter() - start)
    median = statistics.median
    return {
        "F": median(forward),
        "B": median(whole),
        "B_split": median(inputs),
        "W": median(weights),
    }


def measure(
    name: str, n: int, m: int, f: float, repeats: int, costs: dict[int, dict[str, float]]
) -> dict[str, Any]:
    """Time ``repeats`` steps of schedule ``name`` on ``n`` ranks and ``m`` micro-batches."""
    v, make = RUNNERS[name]
    layers = nn.Sequential(*(SleepLayer(f / v) for _ in range(n * v)))
    model = GPipe(layers, [1] * (n * v), devices=["cpu"] * (n * v), chunks=m, checkpoint="never")
    runner = make(model)
    # An input that wants a gradient: the first stage's backward then costs 2 f too, as
    # the simulator assumes.
    x, target = torch.randn(m, 4).requires_grad_(), torch.randn(m, 4)
    result = runner.step(x, target)  # warm-up
    times = []
    for _ in range(repeats):
        model.zero_grad()
        x.grad = None
        start = time.perf_counter()
        result = runner.step(x, target)
        times.append(time.perf_counter() - start)
    table = runner.table(m)
    split = table.splits_backward
    nominal = {"F": f / v, "B": (1 if split else 2) * f / v, "W": f / v}
    simulation = simulate(table, nominal)
    timed = costs_called = costs[v]
    if split:
        costs_called = {"F": timed["F"], "B": timed["B_split"], "W": timed["W"]}
    called = simulate(table, costs_called)
    step = statistics.median(times)
    return {
        "schedule": name,
        "n": n,
        "m": m,
        "step_s": step,
        "makespan_s": simulation.makespan,
        "ratio": step / simulation.makespan,
        "makespan_calls_s": called.makespan,
        "ratio_calls": step / called.makespan,
        "bubble": simulation.bubble,
        "peak_held": list(result.peak_held),
        "simulated_held": list(simulation.holding),
    }


def table_text(rows: list[dict[str, Any]], f: float, repeats: int) -> str:
    """Format the rows as a fixed-width table."""
    lines = [
        f"Sleep layers: forward f = {f * 1e3:g} ms, backward 2f, median of {repeats} steps,"
        " checkpoint='never'",
        "ratio = measured step / simulated makespan (target <= 1.05);"
        " held = peak micro-batches per stage, measured (simulated)",
        "ratio(calls): over the makespan simulated with F, B, W as one layer takes them on"
        " the main thread",
        "torch.distributed.pipelining rows: one process per stage, gloo; their makespan is"
        " the same table's",
        "",
        f"{'schedule':<28} {'n':>2} {'m':>3} {'makespan ms':>12} {'step ms':>9} {'ratio':>6}"
        f" {'target':>7} {'ratio(calls)':>12} {'bubble':>7}  held",
    ]
    for r in rows:
        met = "met" if r["ratio"] <= TARGET else "MISSED"
        held = r.get("peak_held")
        held_text = ""
        if held is not None:
            same = held == r["simulated_held"]
            held_text = " ".join(map(str, held)) + ("" if same else f" ({r['simulated_held']})")
        lines.append(
            f"{r['schedule']:<28} {r['n']:>2} {r['m']:>3} {r['makespan_s'] * 1e3:>12.1f}"
            f" {r['step_s'] * 1e3:>9.1f} {r['ratio']:>6.3f} {met:>7}"
            f" {_maybe(r.get('ratio_calls')):>12} {r['bubble']:>7.1%}"
            f"  {held_text}"
        )
    return "\n".join(lines)


def _maybe(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Read the command line; ``--quick`` replaces the sizes with tiny ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=count, nargs="+", default=[2, 4, 8])
    parser.add_argument("--micro-batches", type=count, nargs="+", default=[4, 8, 32])
    parser.add_argument("--sleep-ms", type=positive, default=10.0, help="forward sleep per layer")
    parser.add_argument("--repeats", type=count, default=3, help="timed steps per row")
    parser.add_argument("--no-reference", action="store_true", help="skip torch's schedules")
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parse(parser, argv, partitions=[2], micro_batches=[4], sleep_ms=2.0, repeats=1)
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every schedule (and the reference), print the table, write the JSON."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    env = environment()
    f = args.sleep_ms / 1e3
    costs = {
        v: measure_costs(f / v, max(10, args.repeats)) for v in {v for v, _ in RUNNERS.values()}
    }
    print(
        "one layer on the main thread: "
        + "; ".join(
            f"f/{v}: " + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in c.items())
            for v, c in costs.items()
        ),
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for n in args.partitions:
        for m in args.micro_batches:
            for name, (v, _) in RUNNERS.items():
                if v > 1 and m % n:
                    continue  # interleaving sends micro-batches in groups of n
                rows.append(measure(name, n, m, f, args.repeats, costs))
                print(table_text(rows[-1:], f, args.repeats).splitlines()[-1], flush=True)
        ms = [m for m in args.micro_batches if m >= n]  # torch's 1F1B needs m >= n
        if not args.no_reference and ms:
            for row in measure_reference(n, ms, f, args.repeats):
                makespan = (row["m"] + n - 1) * 3 * f
                bubble = (n - 1) / (row["m"] + n - 1)
                rows.append(
                    {
                        **row,
                        "schedule": f"torch {row['schedule']}",
                        "makespan_s": makespan,
                        "ratio": row["step_s"] / makespan,
                        "bubble": bubble,
                    }
                )
    rows.sort(key=lambda r: (r["n"], r["m"]))
    print()
    print(table_text(rows, f, args.repeats), flush=True)
    parameters = settings(args)
    layer_costs = {str(v): c for v, c in costs.items()}
    results = {"environment": env, "parameters": parameters, "layer_costs": layer_costs}
    write_json(args.out, {**results, "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
