"""Balance: the step time of the split balance_by_time finds, an even one, and the best.

A sequential model of uneven "blocks" (layers that sleep known times, as the stages of
a ResNet cost more and more, then less) runs as a GPipe of 4 CPU partitions. Three
balances are compared:

- ``even``: the same number of layers in each partition;
- ``balance_by_time``: what ``torchgpipe.balance.balance_by_time`` finds by timing the
  layers;
- ``brute force``: the best split for the known sleep times, by trying every split.

For each: the slowest partition's known cost; the pipelined forward against its bound
``sum of all costs + (m - 1) * slowest`` (the first micro-batch passes every partition,
and each later one leaves the slowest partition one slowest-cost after the previous);
and a full training step (the layers sleep in backward too, each partition's backward
on its own worker, so the backward gains from a better split as the forward does).

Run from the repository root::

    python benchmarks/balance/main.py            # about a minute
    python benchmarks/balance/main.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.balance import balance_by_time

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

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"
# Milliseconds per layer, forward and backward each: a stem, then stages that cost more
# and more (as a ResNet's do), and a cheap head.
BLOCKS_MS = [3, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 6, 6, 1]


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Block(nn.Module):
    """Sleeps ``seconds`` in forward and again in backward; scales by a parameter."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        """Sleep, then scale ``x`` (and sleep again in backward)."""
        time.sleep(self.seconds)
        return _SleepBackward.apply(x * self.scale, self.seconds)  # type: ignore[no-any-return]


def slowest(costs: list[float], balance: list[int]) -> float:
    """The cost of the costliest partition of ``balance``."""
    bounds = [0, *itertools.accumulate(balance)]
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def brute_force(costs: list[float], n: int) -> list[int]:
    """The split of ``costs`` into ``n`` groups with the least costliest group."""
    splits = (
        [b - a for a, b in itertools.pairwise([0, *cuts, len(costs)])]
        for cuts in itertools.combinations(range(1, len(costs)), n - 1)
    )
    return min(splits, key=lambda balance: slowest(costs, balance))


def even(num_layers: int, n: int) -> list[int]:
    """As many layers in each partition as possible, the first ones one more."""
    base, extra = divmod(num_layers, n)
    return [base + (1 if j < extra else 0) for j in range(n)]


def measure(
    balance: list[int], blocks_ms: list[float], m: int, repeats: int
) -> tuple[float, float]:
    """Median forward and training-step seconds of the pipeline split by ``balance``."""
    model = GPipe(
        nn.Sequential(*[Block(t / 1e3) for t in blocks_ms]),
        balance,
        devices=["cpu"] * len(balance),
        chunks=m,
        checkpoint="never",
    )
    x = torch.ones(m, 4)

    def forward() -> None:
        model(x)

    def step() -> None:
        model(x).sum().backward()

    return _median(forward, repeats), _median(step, repeats)


def _median(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    """Find the three balances, time each, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=count, default=4)
    parser.add_argument("--micro-batches", type=count, default=8)
    parser.add_argument("--repeats", type=count, default=5)
    parser.add_argument("--timeout", type=positive, default=1.0, help="balance_by_time's")
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="short sleeps, for a smoke test")
    args = parse(parser, argv, repeats=1, timeout=0.05)
    scale = 0.1 if args.quick else 1.0
    torch.set_num_threads(1)
    blocks = [t * scale for t in BLOCKS_MS]
    n, m = args.partitions, args.micro_batches
    model = nn.Sequential(*[Block(t / 1e3) for t in blocks])
    started = time.perf_counter()
    found = balance_by_time(n, model, torch.ones(m, 4), timeout=args.timeout, device="cpu")
    profiling_s = time.perf_counter() - started
    balances = {
        "even": even(len(blocks), n),
        "balance_by_time": found,
        "brute force": brute_force(blocks, n),
    }
    rows = []
    for name, balance in balances.items():
        forward, step = measure(balance, blocks, m, args.repeats)
        cost = slowest(blocks, balance)
        bound = sum(blocks) + (m - 1) * cost
        rows.append(
            {
                "balance_name": name,
                "balance": balance,
                "slowest_ms": cost,
                "bound_ms": bound,
                "forward_ms": forward * 1e3,
                "step_ms": step * 1e3,
            }
        )
    lines = [
        f"Blocks (ms, forward and backward each): {blocks}",
        f"n = {n} partitions on CPU, m = {m} micro-batches, checkpoint='never', median of "
        f"{args.repeats}; balance_by_time took {profiling_s:.2f} s (timeout {args.timeout} s)",
        "bound = sum of all blocks + (m - 1) * slowest partition (forward)",
        "",
        f"{'balance':>16} {'split':>22} {'slowest ms':>11} {'bound ms':>9} {'forward ms':>11}"
        f" {'step ms':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['balance_name']:>16} {r['balance']!s:>22} {r['slowest_ms']:>11.1f}"
            f" {r['bound_ms']:>9.1f} {r['forward_ms']:>11.1f} {r['step_ms']:>9.1f}"
        )
    print("\n".join(lines), flush=True)
    results = {
        "environment": environment(),
        "parameters": settings(args),
        "blocks_ms": blocks,
        "profiling_s": profiling_s,
        "rows": rows,
    }
    write_json(args.out, results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
