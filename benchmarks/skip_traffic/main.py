"""Skip traffic: bytes a long skip moves between partitions, @skippable against a tuple.

A model of ``n`` partitions carries one skip from its first layer to its last. Two ways
to write it:

- ``skippable``: the first layer stashes the skip, the last pops it
  (``torchgpipe.skip``); GPipe copies it once, from partition 0 to partition n - 1.
- ``tuple``: every layer takes and returns ``(x, skip)``, so the skip goes through
  every partition boundary on its way.

The script counts the bytes of every tensor GPipe hands to a partition from another
partition during one training step: in the forward pass, and in backward the
gradients that flow back (on GPUs, each is a copy between devices). On CPU the tensors
stay in place, so the count is taken where the copies would be issued: a wrapper around
the executor's ``move``, which on CPU partitions carries the gradients of the backward
too (each partition's backward runs on its worker). The input the caller hands to
partition 0, and the output's gradient it hands to the last, are not counted (both
models receive the same). Step times are printed for information only.

Run from the repository root::

    python benchmarks/skip_traffic/main.py            # a few seconds
    python benchmarks/skip_traffic/main.py --quick    # smaller, for a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import torchgpipe
import torchgpipe.executor
from torchgpipe import GPipe
from torchgpipe.microbatch import flatten
from torchgpipe.skip import pop, skippable, stash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import count, environment, out_file, parse, settings, write_json  # benchmarks/common.py

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


@skippable(stash=["skip"])
class StashFirst(nn.Module):
    """The first layer: stashes a linear map of its input as the skip."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Stash a linear map of ``x`` (which wants a gradient), return its ReLU."""
        h = self.linear(x)
        yield stash("skip", h)
        return torch.relu(h)


@skippable(pop=["skip"])
class PopLast(nn.Module):
    """The last layer: adds the skip back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Pop the skip and add it to a linear map of ``x``."""
        skip = yield pop("skip")
        return self.linear(x) + skip


class Middle(nn.Module):
    """A layer between the two ends (the same in both models)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        """A linear map and a ReLU."""
        return torch.relu(self.linear(x))


class TupleFirst(nn.Module):
    """The first layer of the tuple model: returns ``(x', skip)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return the output and the skip together."""
        h = self.linear(x)
        return torch.relu(h), h


class TupleMiddle(Middle):
    """A middle layer that carries the skip along."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """Map the first element, pass the skip on."""
        x, skip = pair
        return super().forward(x), skip


class TupleLast(nn.Module):
    """The last layer of the tuple model: adds the skip back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        """Add the skip to a linear map of the first element."""
        x, skip = pair
        return self.linear(x) + skip


def build(kind: str, n: int, width: int) -> nn.Sequential:
    """``n`` layers, one per partition: the skip from the first to the last."""
    if kind == "skippable":
        return nn.Sequential(
            StashFirst(width), *[Middle(width) for _ in range(n - 2)], PopLast(width)
        )
    return nn.Sequential(
        TupleFirst(width), *[TupleMiddle(width) for _ in range(n - 2)], TupleLast(width)
    )


class Traffic:
    """Counts the bytes handed to each partition from another one, and back in backward."""

    def __init__(self, n: int) -> None:
        self.bytes = 0
        self.tensors = 0
        self.backward_bytes = 0
        self.backward = False  # set between the forward and the backward
        self._n = n
        self._lock = threading.Lock()
        self._real = torchgpipe.executor.move

    def __enter__(self) -> Traffic:
        def counting(value: Any, *args: Any, **kwargs: Any) -> Any:
            moved = self._real(value, *args, **kwargs)
            # The first partition's forward moves bring in the caller's input, and the
            # last one's backward moves the caller's gradient: the same for both models.
            # The caller's thread runs the first partition, worker j partition j.
            caller = f"torchgpipe-worker-{self._n - 1}" if self.backward else "MainThread"
            if threading.current_thread().name != caller:
                leaves = [x for x in flatten(moved)[0] if isinstance(x, Tensor)]
                size = sum(x.numel() * x.element_size() for x in leaves)
                with self._lock:
                    if self.backward:
                        self.backward_bytes += size
                    else:
                        self.bytes += size
                        self.tensors += len(leaves)
            return moved

        torchgpipe.executor.move = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torchgpipe.executor.move = self._real


def measure(kind: str, n: int, m: int, batch: int, width: int, repeats: int) -> dict[str, Any]:
    """One training step's cross-partition bytes, and the median step time."""
    torch.manual_seed(0)
    model = GPipe(build(kind, n, width), [1] * n, devices=["cpu"] * n, chunks=m)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step(traffic: Traffic | None = None) -> None:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        if traffic is not None:
            traffic.backward = True
        loss.backward()
        optimizer.step()

    with Traffic(n) as traffic:
        step(traffic)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    activation = batch * width * x.element_size()  # one activation tensor, all micro-batches
    skip_bytes = traffic.bytes - (n - 1) * activation
    skip_backward = traffic.backward_bytes - (n - 1) * activation
    return {
        "kind": kind,
        "n": n,
        "m": m,
        "bytes": traffic.bytes,
        "tensors": traffic.tensors,
        "backward_bytes": traffic.backward_bytes,
        "step_bytes": traffic.bytes + traffic.backward_bytes,
        "activation_bytes": (n - 1) * activation,
        "skip_bytes": skip_bytes,
        "skip_crossings": skip_bytes / activation,
        "skip_backward_crossings": skip_backward / activation,
        "step_s": statistics.median(times),
    }


def table(rows: list[dict[str, Any]], batch: int, width: int) -> str:
    """The measurements as a fixed-width table."""
    lines = [
        f"One skip from partition 0 to partition n - 1; batch {batch} x {width} float32 "
        f"({batch * width * 4:,} bytes per activation or skip, all micro-batches)",
        "forward: bytes handed to a partition by another; backward: their gradients back",
        "crossings: partition boundaries the skip (forward) and its gradient (backward) cross",
        "",
        f"{'n':>3} {'m':>3} {'model':>10} {'forward B':>11} {'backward B':>11}"
        f" {'step B':>11} {'skip B':>11} {'crossings':>10} {'back':>5} {'step ms':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['n']:>3} {r['m']:>3} {r['kind']:>10} {r['bytes']:>11,}"
            f" {r['backward_bytes']:>11,} {r['step_bytes']:>11,} {r['skip_bytes']:>11,}"
            f" {r['skip_crossings']:>10.2f} {r['skip_backward_crossings']:>5.2f}"
            f" {r['step_s'] * 1e3:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure both models for every n, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=count, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunks", type=count, default=4)
    parser.add_argument("--batch", type=count, default=256)
    parser.add_argument("--width", type=count, default=512)
    parser.add_argument("--repeats", type=count, default=5)
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = parse(parser, argv, partitions=[2, 4], batch=8, width=16, repeats=1)
    if min(args.partitions) < 2:
        parser.error("--partitions: a skip between partitions needs at least 2")
    torch.set_num_threads(1)
    rows = [
        measure(kind, n, args.chunks, args.batch, args.width, args.repeats)
        for n in args.partitions
        for kind in ("skippable", "tuple")
    ]
    print(table(rows, args.batch, args.width), flush=True)
    results = {
        "environment": environment(),
        "parameters": settings(args),
        "rows": rows,
    }
    write_json(args.out, results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
