"""Pipeline speed: how close GPipe's forward comes to the ideal schedule, and its cost per cell.

Two measurements, both on CPU devices with one layer per partition:

1. Sleep layers. Each layer sleeps ``f`` seconds (``time.sleep`` releases the GIL, so
   the worker threads overlap as devices would) and multiplies by a learnable scalar.
   With ``n`` partitions and ``m`` micro-batches the schedule has ``m + n - 1`` clock
   ticks, so no forward can take less than ``(m + n - 1) * f``; the efficiency is that
   bound over the measured time. A training step (forward, backward, SGD step) is timed
   too. Its bound adds ``(m + n - 2) * f``: with ``checkpoint='except_last'`` backward
   recomputes every cell but the last micro-batch's, each partition on its own worker,
   the last micro-batch first, so the recomputations form a reverse pipeline of
   ``m - 1`` cells.
2. Overhead. The same layers without sleeping cost almost nothing, so the time of a
   forward divided by the ``n * m`` cells is what the pipeline adds per cell (threads,
   queues, scatter and gather, checkpointing), next to the plain ``nn.Sequential``.

Run from the repository root::

    python benchmarks/pipeline_speed/main.py            # a few minutes
    python benchmarks/pipeline_speed/main.py --quick    # a smoke test, a few seconds
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import GPipe, ScheduleGPipe
from torchgpipe.rng import CellRandomness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # benchmarks/common.py
    count,
    environment,
    out_file,
    parse,
    positive,
    settings,
    write_json,
)

FORWARD_TARGET = 1.03  # training forward over the bare pipeline
NO_GRAD_TARGET = 1.02  # no_grad forward over the bare pipeline
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


class Scaled(nn.Module):
    """Sleeps ``seconds`` (when positive), then multiplies by a learnable scalar."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        """Sleep, then scale ``x``."""
        if self.seconds > 0:
            time.sleep(self.seconds)
        return x * self.scale


def layers(n: int, seconds: float) -> nn.Sequential:
    """``n`` fresh ``Scaled`` layers in a row."""
    return nn.Sequential(*(Scaled(seconds) for _ in range(n)))


def pipeline(n: int, m: int, seconds: float) -> GPipe:
    """A GPipe of ``n`` one-layer partitions on CPU, cutting batches into ``m``."""
    return GPipe(
        layers(n, seconds),
        balance=[1] * n,
        devices=["cpu"] * n,
        chunks=m,
        checkpoint="except_last",
    )


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Call ``fn`` once to warm up, then return the median wall time of ``repeats`` calls."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_call(f: float, calls: int) -> float:
    """The median time of one sleep layer's call, with grad, on the main thread.

    It is a little more than ``f``: the sleep overshoots, and the thread wakes up cold.
    """
    layer, x = Scaled(f), torch.randn(1, 4)
    return median_seconds(lambda: layer(x), calls)


def bare_pipeline(n: int, m: int, f: float, after: Callable[[], object] | None = None) -> float:
    """The time of one forward of the same layers through threads and queues alone.

    One thread per layer, a queue between neighbours, grad on, and nothing else: no
    micro-batch objects, no checkpointing, no ordering edges, no error handling. It is
    the floor that any thread-per-partition pipeline meets on this machine, since its
    layers (sleep, then one multiply) are all it runs. ``after()``, if given, runs after
    each cell's layer (``noise.py`` adds a known cost there).
    """
    stages = layers(n, f)
    inboxes: list[queue.SimpleQueue[Tensor]] = [queue.SimpleQueue() for _ in range(n + 1)]

    def work(j: int) -> None:
        for _ in range(m):
            y = stages[j](inboxes[j].get())
            if after is not None:
                after()
            inboxes[j + 1].put(y)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(n)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    for x in torch.randn(m, 4).tensor_split(m):
        inboxes[0].put(x)
    for _ in range(m):
        inboxes[n].get()
    elapsed = time.perf_counter() - started
    for thread in threads:
        thread.join()
    return elapsed


def measure_cold(f: float, calls: int) -> tuple[float, float]:
    """The median time of one small multiply right after a sleep of ``f``, and without.

    On a virtual machine a thread that wakes up runs its first instructions many times
    slower than a busy one; every cell of a pipeline starts on a thread that just woke.
    """
    x, cold, hot = torch.randn(1, 4), [], []
    for _ in range(calls):
        time.sleep(f)
        started = time.perf_counter()
        x * 2.0
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        x * 2.0
        hot.append(time.perf_counter() - started)
    return statistics.median(cold), statistics.median(hot)


def measure_sleep(n: int, m: int, f: float, f_call: float, rounds: int) -> dict[str, Any]:
    """Time the training-mode forward, an inference forward and a training step.

    Interleaved round by round with the bare pipeline of the same layers (grad on for
    the training forward, under ``no_grad`` for the inference one), so that the
    machine's swings hit both alike; the ratios are medians of the per-round ratios.
    The inference forward (eval mode, no grad) has no checkpointing and no autograd
    graph to record, so it shows what the schedule and its threads cost on their own.
    """
    model = pipeline(n, m, f).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(m, 4)

    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    def inference() -> None:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()

    def bare_no_grad() -> float:
        with torch.no_grad():
            return bare_pipeline(n, m, f)

    for warm in (lambda: model(x), step, inference):
        warm()
    times: dict[str, list[float]] = {k: [] for k in ("forward", "bare", "no_grad", "bare_ng")}
    times["step"] = []
    for _ in range(rounds):
        times["forward"].append(timed(lambda: model(x)))
        times["bare"].append(bare_pipeline(n, m, f))
        times["no_grad"].append(timed(inference))
        times["bare_ng"].append(bare_no_grad())
        times["step"].append(timed(step))
    forward_ratio = statistics.median(
        a / b for a, b in zip(times["forward"], times["bare"], strict=True)
    )
    no_grad_ratio = statistics.median(
        a / b for a, b in zip(times["no_grad"], times["bare_ng"], strict=True)
    )
    bound = (m + n - 1) * f
    # Backward recomputes micro-batches 0 .. m - 2 (except_last), the last one first,
    # each partition on its worker: a reverse pipeline of m - 1 cells of f after a free one.
    step_bound = bound + ((m + n - 2) * f if m > 1 else 0.0)
    forward, bare = statistics.median(times["forward"]), statistics.median(times["bare"])
    train_step = statistics.median(times["step"])
    return {
        "n": n,
        "m": m,
        "bound_s": bound,
        "forward_s": forward,
        "efficiency": bound / forward,
        "efficiency_f_call": (m + n - 1) * f_call / forward,
        "forward_over_bare": forward_ratio,
        "no_grad_forward_s": statistics.median(times["no_grad"]),
        "no_grad_over_bare": no_grad_ratio,
        "bare_forward_s": bare,
        "bare_efficiency": bound / bare,
        "step_bound_s": step_bound,
        "step_s": train_step,
        "step_efficiency": step_bound / train_step,
    }


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_overhead(n: int, m: int, rounds: int) -> list[dict[str, Any]]:
    """Per-cell cost of the pipeline on layers that do almost nothing.

    Three rows, each timed interleaved round by round (medians over rounds): the
    forward in eval mode under ``no_grad`` and in training mode with grad, each against
    the plain ``nn.Sequential`` on the whole batch; and a training step's backward
    included: ``model(x)`` then ``loss.backward()`` against
    ``ScheduleGPipe(model, loss).step(x, target)``, both with ``checkpoint='except_last'``.
    """
    x, target = torch.randn(m, 4), torch.randn(m, 4)
    rows = []
    for mode in ("eval", "train"):
        plain, piped = layers(n, 0.0), pipeline(n, m, 0.0)
        training = mode == "train"
        plain.train(training)
        piped.train(training)
        with torch.set_grad_enabled(training):
            a, b, ratio = interleaved(lambda p=plain: p(x), lambda p=piped: p(x), rounds)
        rows.append({"n": n, "m": m, "mode": mode, "reference_s": a, "gpipe_s": b, "ratio": ratio})
    piped = pipeline(n, m, 0.0)
    schedule = ScheduleGPipe(piped, nn.functional.mse_loss)

    def drop_in() -> None:
        nn.functional.mse_loss(piped(x), target).backward()

    a, b, ratio = interleaved(drop_in, lambda: schedule.step(x, target), rounds)
    rows.append({"n": n, "m": m, "mode": "step", "reference_s": a, "gpipe_s": b, "ratio": ratio})
    for row in rows:
        row["per_cell_s"] = row["gpipe_s"] / (n * m)
        row["reference_per_cell_s"] = row["reference_s"] / (n * m)
    return rows


def interleaved(
    first: Callable[[], object], second: Callable[[], object], rounds: int
) -> tuple[float, float, float]:
    """Median seconds of ``first`` and of ``second``, called in turn, after a warm-up.

    And the median over rounds of ``second``'s time over ``first``'s.
    """
    first()
    second()
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(first))
        b.append(timed(second))
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    return statistics.median(a), statistics.median(b), ratio


def measure_randomness(rounds: int, cells: int = 2000) -> dict[str, float]:
    """Microseconds a cell's own random generators add to it (``torchgpipe.rng``).

    Each cell of a pipeline runs under its ``CellRandomness``. Timed here, interleaved
    round by round against the same work without it: a cell of one ``Scaled`` layer
    (no random function: the mode's entry and exit, and a Python call per torch
    function), and one with a ``Dropout`` after it (the cell's generator is made and
    seeded, and dropout draws from it instead of from the fused or default path).
    """
    layer, dropout = Scaled(0.0), nn.Dropout(0.5)
    x = torch.randn(8, 4)

    def cell(random: bool, with_dropout: bool) -> None:
        for k in range(cells):
            with CellRandomness(k).forward() if random else nullcontext():
                y = layer(x)
                if with_dropout:
                    dropout(y)

    figures = {}
    with torch.no_grad():
        for with_dropout in (False, True):
            ratios = []
            for _ in range(rounds):
                start = time.perf_counter()
                cell(False, with_dropout)
                bare = time.perf_counter() - start
                start = time.perf_counter()
                cell(True, with_dropout)
                ratios.append((time.perf_counter() - start - bare) / cells)
            name = "dropout cell" if with_dropout else "plain cell"
            figures[name] = statistics.median(ratios)
    return figures


def sleep_table(rows: list[dict[str, Any]], f: float, f_call: float, rounds: int) -> str:
    """Format the sleep-layer measurements as a fixed-width table."""
    lines = [
        f"Sleep layers: f = {f * 1e3:g} ms per cell, checkpoint='except_last', "
        f"{rounds} rounds, each interleaving every measurement",
        "bound = (m + n - 1) * f;  step bound = bound + (m + n - 2) * f (the recomputation,"
        " pipelined in reverse; m > 1)",
        f"eff(f_call) uses one layer call as timed on the main thread: f_call = "
        f"{f_call * 1e3:.3f} ms",
        "/bare: the training forward over the same layers through bare threads and queues"
        " (no library code), median of the per-round ratios",
        "ng/bare: the forward in eval mode under no_grad over the bare pipeline under"
        " no_grad, likewise",
        "",
        f"{'n':>3} {'m':>4} {'bound ms':>9} {'forward ms':>11} {'efficiency':>11}"
        f" {'eff(f_call)':>12} {'/bare':>7} {'target':>7} {'ng/bare':>8} {'target':>7}"
        f" {'bare eff':>9} {'step bound ms':>14} {'step ms':>9} {'step eff':>9}",
    ]
    for r in rows:
        met = "met" if r["forward_over_bare"] <= FORWARD_TARGET else "MISSED"
        met_ng = "met" if r["no_grad_over_bare"] <= NO_GRAD_TARGET else "MISSED"
        lines.append(
            f"{r['n']:>3} {r['m']:>4} {r['bound_s'] * 1e3:>9.1f} {r['forward_s'] * 1e3:>11.1f}"
            f" {r['efficiency']:>11.3f} {r['efficiency_f_call']:>12.3f}"
            f" {r['forward_over_bare']:>7.3f} {met:>7} {r['no_grad_over_bare']:>8.3f}"
            f" {met_ng:>7} {r['bare_efficiency']:>9.3f}"
            f" {r['step_bound_s'] * 1e3:>14.1f} {r['step_s'] * 1e3:>9.1f}"
            f" {r['step_efficiency']:>9.3f}"
        )
    return "\n".join(lines)


def overhead_table(rows: list[dict[str, Any]], rounds: int) -> str:
    """Format the overhead measurements as a fixed-width table."""
    lines = [
        f"Overhead: layers return x * scale without sleeping, medians of {rounds} interleaved"
        " rounds",
        "eval: forward in eval mode under no_grad, against the plain nn.Sequential",
        "train: forward in training mode with grad (except_last), against nn.Sequential",
        "step: ScheduleGPipe.step(x, target), against model(x) then loss.backward()",
        "/ref: GPipe's time over the reference's, median of the per-round ratios",
        "",
        f"{'n':>3} {'m':>4} {'mode':>6} {'reference us':>13} {'GPipe us':>10}"
        f" {'us/cell':>9} {'ref us/cell':>12} {'/ref':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['n']:>3} {r['m']:>4} {r['mode']:>6} {r['reference_s'] * 1e6:>13.1f}"
            f" {r['gpipe_s'] * 1e6:>10.1f} {r['per_cell_s'] * 1e6:>9.1f}"
            f" {r['reference_per_cell_s'] * 1e6:>12.1f} {r['ratio']:>7.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Read the command line; ``--quick`` replaces the sizes with tiny ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=count, default=5, help="rounds per sleep cell")
    parser.add_argument("--sleep-ms", type=positive, default=10.0, help="sleep per layer call")
    parser.add_argument("--partitions", type=count, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--micro-batches", type=count, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--overhead-micro-batches", type=count, nargs="+", default=[1, 8, 32])
    parser.add_argument("--overhead-repeats", type=count, default=50, help="rounds")
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    tiny = {"partitions": [1, 2], "micro_batches": [1, 4], "overhead_micro_batches": [1, 4]}
    args = parse(parser, argv, **tiny, sleep_ms=1.0, repeats=1, overhead_repeats=3)
    return args


def main(argv: list[str] | None = None) -> None:
    """Run both measurements, print their tables and write the JSON results."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    env = environment()  # before measuring: the source hash names the code imported
    f = args.sleep_ms / 1e3
    f_call = measure_call(f, max(20, args.repeats))
    cold, hot = measure_cold(f, max(20, args.repeats))
    print(
        f"one multiply right after a {f * 1e3:g} ms sleep: {cold * 1e6:.1f} us;"
        f" right after another multiply: {hot * 1e6:.1f} us\n",
        flush=True,
    )
    grid = [(n, m) for n in args.partitions for m in args.micro_batches]
    sleep = [measure_sleep(n, m, f, f_call, args.repeats) for n, m in grid]
    print(sleep_table(sleep, f, f_call, args.repeats), end="\n\n", flush=True)
    grid = [(n, m) for n in args.partitions for m in args.overhead_micro_batches]
    overhead = [row for n, m in grid for row in measure_overhead(n, m, args.overhead_repeats)]
    print(overhead_table(overhead, args.overhead_repeats), flush=True)
    randomness = measure_randomness(max(5, args.overhead_repeats // 5))
    print(
        "\nCell generators (rng.py), median over rounds of the time added per cell: "
        + ", ".join(f"{name} {s * 1e6:+.1f} us" for name, s in randomness.items()),
        flush=True,
    )

    parameters = settings(args)
    results = {
        "environment": env,
        "parameters": {
            **parameters,
            "forward_target": FORWARD_TARGET,
            "no_grad_target": NO_GRAD_TARGET,
            "checkpoint": "except_last",
        },
        "f_call_s": f_call,
        "cold_multiply_s": cold,
        "hot_multiply_s": hot,
        "sleep": sleep,
        "overhead": overhead,
        "randomness_s_per_cell": randomness,
    }
    write_json(args.out, results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
