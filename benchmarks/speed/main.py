"""Speed: training throughput of naive-1 and pipeline-1, -2, -4, -8, as in the seed's tables.

For each model (``benchmarks/models``): ``naive-1`` is the plain ``nn.Sequential`` on one
device; ``pipeline-k`` is GPipe over ``k`` partitions, balanced by ``balance_by_time``,
with ``--chunks`` micro-batches. A step is forward, backward and an SGD step on a
synthetic batch; after warm-up steps, the median of the measured steps gives the
throughput (samples/s), and the speed-up is relative to naive-1. The experiments take
turns, a step each per round, so that the machine's drift hits them alike; the speed-up
is the median over rounds of the ratio to naive-1's throughput in the same round. Each
row may have its own batch (``--naive-batch`` for naive-1), as the seed's tables tuned
the batch per row.

Where ``pipeline-1``'s micro-batch is naive-1's batch, its row also gives the bound that
checkpointing allows: with the default ``'except_last'``, each of the first m - 1
micro-batches runs its forward once more without recording (f0, naive-1's forward timed
under ``no_grad`` in the same round), so the best step is m naive-1 steps plus
(m - 1) f0, and the bound on the speed-up m T / (m T + (m - 1) f0). It counts the SGD
step m times where one runs, so it is a little low.

``--devices cuda`` puts partition ``j`` on GPU ``j % count``; ``--devices cpu`` (the
default without CUDA) puts every partition on the CPU, each run by a worker thread with
one intra-op thread, whose backward runs on the same worker; with two cores, few
partitions can compute at once.

Run from the repository root::

    python benchmarks/speed/main.py                  # tiny models on this machine
    python benchmarks/speed/main.py --size full      # the published sizes (GPUs)
    python benchmarks/speed/main.py --quick          # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpipe import GPipe
from torchgpipe.balance import balance_by_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # benchmarks/common.py
    Progress,
    count,
    environment,
    out_file,
    parse,
    picture,
    positive,
    settings,
    whole,
    write_json,
)
from models import add_arguments, build, devices_for

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


class Run:
    """One experiment: a model, its batch, its optimizer, and the seconds of its steps."""

    def __init__(self, name: str, model: nn.Module, x: torch.Tensor, k: int,
                 balance: list[int] | None) -> None:  # fmt: skip
        self.name, self.model, self.x, self.k, self.balance = name, model, x, k, balance
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.seconds: list[float] = []
        self.no_grad_seconds: list[float] = []  # forwards under no_grad (naive-1's)

    def step(self, loss_of: Any) -> float:
        """Seconds of one training step: forward, backward and the SGD step."""
        cuda = self.x.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss_of(self.model(self.x)).backward()
        self.optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def forward_without_grad(self) -> float:
        """Seconds of one forward under ``no_grad``, as a checkpointed micro-batch's first."""
        cuda = self.x.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            self.model(self.x)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def measure(name: str, args: argparse.Namespace, rows: list[dict[str, Any]], tick: Any) -> None:
    """Measure naive-1 and every pipeline of one model, a step of each per round; add rows.

    The machine's speed drifts, so the experiments take turns, round by round, and each
    speed-up is the median over rounds of the pipeline's throughput over naive-1's in
    the same round.
    """
    spec = build(name, args.size)
    naive_batch = args.naive_batch or args.batch
    x_cpu = torch.randn(max(args.batch, naive_batch), *spec.sample_shape)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float))

    first = devices_for(args.devices, 1)[0]
    tick(f"{name} naive-1")
    runs = [Run("naive-1", build(name, args.size).model.to(first), x_cpu[:naive_batch].to(first),
                1, None)]  # fmt: skip
    x = x_cpu[: args.batch]
    sample = x[: max(1, args.batch // args.chunks)]
    for k in args.partitions:
        if k > len(spec.model):
            continue
        tick(f"{name} pipeline-{k}")
        model = build(name, args.size).model
        balance = [len(model)] if k == 1 else balance_by_time(
            k, model, sample, timeout=args.balance_timeout, device=first)  # fmt: skip
        devices = devices_for(args.devices, k)
        pipe = GPipe(model, balance, devices=devices, chunks=args.chunks)
        runs.append(Run(f"pipeline-{k}", pipe, x.to(devices[0]), k, balance))
    if name == "amoebanetd":  # the seed's grid: n partitions x m micro-batches
        for n in args.grid_partitions:
            model = build(name, args.size).model
            balance = balance_by_time(n, model, x[:1], timeout=args.balance_timeout,
                                      device=first)  # fmt: skip
            devices = devices_for(args.devices, n)
            for m in args.grid_micro_batches:
                tick(f"{name} n={n} m={m}")
                pipe = GPipe(build(name, args.size).model, balance, devices=devices, chunks=m)
                runs.append(Run(f"n={n}, m={m}", pipe, x.to(devices[0]), n, balance))
    for _ in range(args.warmup):
        for run in runs:
            run.step(loss_of)
    naive = runs[0]
    for _ in range(args.steps):
        for run in runs:
            run.seconds.append(run.step(loss_of))
        naive.no_grad_seconds.append(naive.forward_without_grad())
    for run in runs:
        ratios = [
            (len(run.x) / t) / (len(naive.x) / t_naive)
            for t, t_naive in zip(run.seconds, naive.seconds, strict=True)
        ]
        seconds = statistics.median(run.seconds)
        bounds = _bounds(run, naive, args.chunks)
        rows.append({
            "model": name,
            "experiment": run.name,
            "k": run.k,
            "balance": run.balance,
            "batch": len(run.x),
            "step_s": seconds,
            "throughput": len(run.x) / seconds,
            "speedup": statistics.median(ratios),
            "bound": statistics.median(bounds) if bounds else None,
            "of_bound": statistics.median(r / b for r, b in zip(ratios, bounds, strict=True))
            if bounds else None,
        })  # fmt: skip


def _bounds(run: Run, naive: Run, m: int) -> list[float]:
    """Per round, the speed-up checkpointing allows ``run`` (see the module's docstring).

    None where ``run`` is not pipeline-1 at m times naive-1's batch.
    """
    if run.k != 1 or run is naive or len(run.x) != m * len(naive.x):
        return []
    return [
        m * t / (m * t + (m - 1) * f0)
        for t, f0 in zip(naive.seconds, naive.no_grad_seconds, strict=True)
    ]


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The seed's layout: per model, experiment, throughput and speed-up."""
    lines = [
        f"size {args.size!r}, chunks {args.chunks}, devices {args.devices}; {args.steps} "
        f"rounds of a step each after {args.warmup} warm-up; median step time, and median "
        f"over rounds of the throughput ratio to naive-1"
    ]
    for name in args.models:
        lines += ["", f"{name}:", f"{'Experiment':<12} {'batch':>6} {'Throughput':>12} "
                  f"{'Speed-up':>9}  {'bound':>6} {'of it':>6}  balance"]  # fmt: skip
        for r in (r for r in rows if r["model"] == name):
            bound = f"{r['bound']:>6.3f} {r['of_bound']:>6.3f}" if r["bound"] else " " * 13
            lines.append(
                f"{r['experiment']:<12} {r['batch']:>6} {r['throughput']:>8.1f}/s  "
                f"{r['speedup']:>8.3f}x  {bound}  {r['balance'] or ''}"
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speed-up against the number of partitions, a line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for name in sorted({r["model"] for r in rows}):
        points = [
            (r["k"], r["speedup"])
            for r in rows
            if r["model"] == name and r["experiment"].startswith("pipeline-")
        ]
        axes.plot(*zip(*points, strict=True), marker="o", label=name)
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("partitions (pipeline-k)")
    axes.set_ylabel("speed-up over naive-1")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Read the command line; ``--quick`` shrinks everything for a smoke test."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--grid-partitions", type=count, nargs="+", default=[2, 4, 8])
    parser.add_argument("--grid-micro-batches", type=count, nargs="+", default=[1, 4, 32])
    parser.add_argument("--naive-batch", type=count, help="naive-1's batch (default: --batch)")
    parser.add_argument("--warmup", type=whole, default=2)
    parser.add_argument("--steps", type=count, default=5, help="rounds of one step each")
    parser.add_argument("--balance-timeout", type=positive, default=0.5)
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=picture, help="draw the speed-ups to this PNG")
    parser.add_argument("--quick", action="store_true", help="tiny and short: a smoke test")
    tiny = {"batch": 4, "partitions": [1, 2], "warmup": 1, "steps": 1, "chunks": 2}
    tiny |= {"balance_timeout": 0.01, "grid_partitions": [2], "grid_micro_batches": [1, 4]}
    args = parse(parser, argv, **tiny)
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every model, print the tables, write the JSON (and the figure)."""
    args = parse_args(argv)
    if args.devices == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    env = environment()
    rows: list[dict[str, Any]] = []
    grid = len(args.grid_partitions) * len(args.grid_micro_batches)
    total = len(args.models) * (1 + len(args.partitions)) + grid * ("amoebanetd" in args.models)
    bar = Progress(total)

    for name in args.models:
        measure(name, args, rows, bar.tick)
    bar.finish()
    print(table(rows, args), flush=True)
    parameters = settings(args)
    write_json(args.out, {"environment": env, "parameters": parameters, "rows": rows})
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"drew {args.plot}")


if __name__ == "__main__":
    main()
