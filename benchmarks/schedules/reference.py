"""The reference: PyTorch's own pipeline schedules, timed on the same sleep layers.

``torch.distributed.pipelining`` runs ``ScheduleGPipe`` and ``Schedule1F1B`` with one
OS process per pipeline stage, talking over gloo on loopback (``127.0.0.1``, a free
port). Each stage is a single ``SleepLayer``: its forward sleeps ``f`` seconds and its
backward ``2 f`` (``f`` towards the input, ``f`` towards its one weight), so with ``n``
stages and ``m`` micro-batches both schedules take ``(m + n - 1) * 3 f`` at best (see
``ideal_seconds``). The input is ``torch.randn(m, 4)`` cut into ``m`` micro-batches of
one sample; the last stage computes a mean squared error.

The first stage's input needs no gradient, so that stage's backward sleeps only ``f``
(the weight's half). Its last backward ends the step, so the true least time is ``f``
below the bound (and ``2 f m`` for ``n = 1``); ratios to the bound can dip below one.

For each ``m`` and schedule, every rank builds its own stage and the schedule, runs one
warm-up step, then ``repeats`` timed steps: a barrier, then rank 0 times ``step()`` up
to the end of a barrier that follows it. The row keeps the median.

Run from the repository root::

    python benchmarks/schedules/reference.py                  # n = 2, 4; m = 4, 8
    python benchmarks/schedules/reference.py --quick          # a smoke test
    python benchmarks/schedules/reference.py --partitions 8 --micro-batches 32 --repeats 1

``benchmarks/schedules/main.py`` imports ``measure_reference`` and ``SleepLayer``.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import free_port, join_gloo  # benchmarks/common.py

SCHEDULES: tuple[str, ...] = ("ScheduleGPipe", "Schedule1F1B")
"""The schedules measured, in the order of the rows for each ``m``."""

FEATURES = 4
"""Features per sample: the input is ``torch.randn(m, FEATURES)``."""

STARTUP_S = 120.0
"""Time allowed for spawning the processes, importing torch and joining gloo."""


class _SleepBackward(torch.autograd.Function):
    """The identity; its backward sleeps ``seconds`` before passing the gradient on."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, seconds: float) -> Tensor:
        """Return ``x`` unchanged (a view, so autograd records this node)."""
        ctx.seconds = seconds  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        """Sleep, then return ``grad`` for ``x`` and nothing for ``seconds``."""
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]
        return grad, None


class SleepLayer(nn.Module):
    """A layer that costs ``seconds`` forward and ``2 * seconds`` backward.

    The forward sleeps ``seconds``, then multiplies the input by a learnable scalar.
    Both factors pass through ``_SleepBackward``, so the backward sleeps ``seconds`` on
    the way to the input and ``seconds`` on the way to the weight (only the second when
    the input needs no gradient). ``time.sleep`` releases the GIL.

    Args:
        seconds: the forward's sleep, ``f``.
    """

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        """Sleep ``seconds``, then scale ``x``."""
        if self.seconds > 0:
            time.sleep(self.seconds)
        x = _SleepBackward.apply(x, self.seconds)  # type: ignore[no-untyped-call]  # unannotated
        scale = _SleepBackward.apply(self.scale, self.seconds)  # type: ignore[no-untyped-call]
        return cast(Tensor, x * scale)


def mse(out: Tensor, target: Tensor) -> Tensor:
    """The loss on the last stage: the mean squared error of one micro-batch."""
    return ((out - target) ** 2).mean()


def ideal_seconds(n: int, m: int, f: float) -> float:
    """The least time of a GPipe or 1F1B step: ``m + n - 1`` ticks of ``f`` plus ``2 f``."""
    return (m + n - 1) * 3 * f


# A message from a rank to the parent: ("rows", rank, rows), ("done", rank, None) or
# ("error", rank, traceback text).
Message = tuple[str, int, Any]


def _time_steps(rank: int, n: int, m: int, name: str, f: float, repeats: int) -> list[float]:
    """Build this rank's stage and schedule ``name``; warm up once, then time ``repeats``.

    Every rank returns its own times; only rank 0's are reported.
    """
    layer = SleepLayer(f)
    # No example inputs or outputs: the first step infers the shapes (dynamic mode). A
    # static example must say requires_grad=True, or no gradient is sent back for it.
    stage = PipelineStage(layer, stage_index=rank, num_stages=n, device=torch.device("cpu"))
    schedule_cls = ScheduleGPipe if name == "ScheduleGPipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=m, loss_fn=mse)

    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, FEATURES, generator=generator)
    target = torch.randn(m, FEATURES, generator=generator)
    args: tuple[Tensor, ...] = (x,) if rank == 0 else ()

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        if rank == n - 1:
            schedule.step(*args, target=target, losses=[])
        else:
            schedule.step(*args)

    step()  # warm-up: the first step also sets up the stage's buffers and peers
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _worker(
    rank: int,
    n: int,
    ms: list[int],
    f: float,
    repeats: int,
    port: int,
    timeout: float,
    messages: Any,
) -> None:
    """One pipeline stage's process: join gloo, run every ``m`` and schedule, report."""
    try:
        join_gloo(rank, n, port, timeout)
        try:
            rows: list[dict[str, Any]] = []
            for m in ms:
                for name in SCHEDULES:
                    times = _time_steps(rank, n, m, name, f, repeats)
                    rows.append(
                        {"n": n, "m": m, "schedule": name, "step_s": statistics.median(times)}
                    )
            dist.barrier()
        finally:
            dist.destroy_process_group()
        messages.put(("rows", rank, rows) if rank == 0 else ("done", rank, None))
    except BaseException:
        messages.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _default_timeout(n: int, ms: list[int], f: float, repeats: int) -> float:
    """Startup plus ten times the ideal time of every step run (warm-ups included)."""
    work = sum(ideal_seconds(n, m, f) + 0.05 * (m + n) for m in ms)
    return STARTUP_S + 10 * len(SCHEDULES) * (repeats + 1) * work


def measure_reference(
    n: int, ms: list[int], f: float, repeats: int, *, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Time torch's ``ScheduleGPipe`` and ``Schedule1F1B`` on ``n`` one-layer stages.

    Spawns ``n`` processes (start method ``spawn``, one thread each) that join a gloo
    group on loopback. For each ``m`` in ``ms`` and each schedule every rank builds its
    stage (one ``SleepLayer(f)``) and the schedule, runs one warm-up step, then
    ``repeats`` timed steps, each between two barriers, timed on rank 0.

    Args:
        n: the number of stages, and of processes.
        ms: the numbers of micro-batches (of one sample each); each at least ``n``, as
            ``Schedule1F1B`` requires.
        f: a layer's forward time in seconds (its backward takes ``2 f``).
        repeats: timed steps per row.
        timeout: seconds allowed for the whole measurement; by default the startup
            plus ten times the ideal time of every step.

    Returns:
        One row per ``m`` and schedule, in that order:
        ``{"n": n, "m": m, "schedule": name, "step_s": median seconds}``.

    Raises:
        ValueError: on ``n < 1``, ``repeats < 1`` or an ``m`` below ``n``.
        RuntimeError: when a process fails (with its traceback) or time runs out; the
            processes are killed either way.
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1, got n={n}, repeats={repeats}")
    if any(m < n for m in ms):
        raise ValueError(f"Schedule1F1B needs at least n={n} micro-batches, got {ms}")
    if not ms:
        return []
    if timeout is None:
        timeout = _default_timeout(n, ms, f, repeats)

    context = mp.get_context("spawn")
    messages = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_worker,
            args=(rank, n, list(ms), f, repeats, port, timeout, messages),
            name=f"reference-rank-{rank}",
            daemon=True,
        )
        for rank in range(n)
    ]
    deadline = time.monotonic() + timeout
    rows: list[dict[str, Any]] | None = None
    finished: set[int] = set()
    try:
        for process in processes:
            process.start()
        while len(finished) < n:
            message = _next_message(messages, processes, deadline, timeout)
            kind, rank, payload = message
            if kind == "error":
                raise RuntimeError(f"reference rank {rank} of {n} failed:\n{payload}")
            if kind == "rows":
                rows = cast(list[dict[str, Any]], payload)
            finished.add(rank)
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
        messages.close()
    if rows is None:  # pragma: no cover - rank 0 always sends rows before it finishes
        raise RuntimeError("reference rank 0 finished without rows")
    return rows


def _next_message(messages: Any, processes: list[Any], deadline: float, timeout: float) -> Message:
    """The next message from the ranks; raises on the deadline or a silent death."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"reference timed out after {timeout:.0f} s")
        try:
            return cast(Message, messages.get(timeout=min(remaining, 0.5)))
        except queue.Empty:
            pass
        dead = [p for p in processes if p.exitcode not in (None, 0)]
        if dead:
            # A rank that fails puts its traceback before exiting; give it a moment.
            try:
                return cast(Message, messages.get(timeout=2.0))
            except queue.Empty:
                codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
                message = f"reference process died without a message: {codes}"
                raise RuntimeError(message) from None


def table(rows: list[dict[str, Any]], f: float) -> str:
    """The rows as text, next to the ideal ``(m + n - 1) * 3 f`` and their ratio."""
    lines = [f"{'n':>3} {'m':>4} {'schedule':<14} {'step_s':>9} {'ideal_s':>9} {'ratio':>6}"]
    for row in rows:
        ideal = ideal_seconds(row["n"], row["m"], f)
        lines.append(
            f"{row['n']:>3} {row['m']:>4} {row['schedule']:<14} {row['step_s']:>9.4f} "
            f"{ideal:>9.4f} {row['step_s'] / ideal:>6.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure the reference for each ``--partitions`` and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sleep-ms", type=float, default=10.0, help="forward time f")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per n")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: n = 2, m = 2 4, one repeat"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.partitions, args.micro_batches, args.repeats = [2], [2, 4], 1
    f = args.sleep_ms / 1000
    rows: list[dict[str, Any]] = []
    for n in args.partitions:
        started = time.perf_counter()
        measured = measure_reference(n, args.micro_batches, f, args.repeats, timeout=args.timeout)
        rows.extend(measured)
        print(f"n={n}: {time.perf_counter() - started:.1f} s in all", flush=True)
        for row in measured:
            print(row, flush=True)
    print(table(rows, f))


if __name__ == "__main__":
    main()
