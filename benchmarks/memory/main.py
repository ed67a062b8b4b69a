"""Memory: parameters, model memory and peak activation memory, naive-1 against pipelines.

For each model (``benchmarks/models``): ``naive-1`` is the plain model on one device;
``pipeline-k`` is GPipe over ``k`` partitions balanced by ``balance_by_size``, with
``--chunks`` micro-batches and ``checkpoint='except_last'``. For each, the table gives
the parameters, the model memory (parameters, gradients and SGD's momentum: 3 x the
parameter bytes) and the peak activation memory of one training step, per device.

How the peak is measured:

- CUDA: ``torch.cuda.max_memory_allocated`` of each device during one step, less what
  was allocated before it (the model, its gradients and the optimizer state).
- CPU: PyTorch's profiler with ``profile_memory=True`` reports every allocation and free
  of the CPU allocator, in order; the peak of their running sum during one step is the
  peak activation memory (the gradients and the momentum were allocated by a warm-up
  step and are reused, not reallocated). All CPU partitions share one device, so the
  figure is for all of them together. The method is checked at the start of every run
  against allocations of known size (printed as ``validation``). Frees of memory
  allocated before the step are not reported by the profiler, so the figure can only
  err upwards.

Run from the repository root::

    python benchmarks/memory/main.py
    python benchmarks/memory/main.py --quick
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchgpipe import GPipe
from torchgpipe.balance import balance_by_size

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # benchmarks/common.py
    Progress,
    environment,
    out_file,
    parse,
    picture,
    settings,
    write_json,
)
from models import add_arguments, build, devices_for

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """The peak, over the call, of CPU bytes allocated by PyTorch since it started."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type() == torch.device("cpu").type or str(event.device_type()).endswith(
            "CPU"
        ):
            total += event.nbytes()
            peak = max(peak, total)
    return peak


def validate() -> tuple[int, int]:
    """Allocations of known size: 4 MB kept while 1 MB comes and goes, then 2 MB more.

    The peak is 4 + 2 = 6 MB only if frees are counted and order is kept.
    """

    def known() -> None:
        a = torch.empty(4_000_000, dtype=torch.uint8)
        b = torch.empty(1_000_000, dtype=torch.uint8)
        del b
        c = torch.empty(2_000_000, dtype=torch.uint8)
        del a, c

    return 6_000_000, peak_cpu_bytes(known)


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Parameter, gradient and momentum bytes per device (3 x the parameters)."""
    per_device: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.device)
        per_device[key] = per_device.get(key, 0) + 3 * p.numel() * p.element_size()
    return per_device


def measure(model: nn.Module, x: torch.Tensor, devices: list[torch.device]) -> dict[str, int]:
    """Peak activation bytes per device of one training step (after a warm-up step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)  # reuse the gradients' memory
        model(x).float().square().mean().backward()
        optimizer.step()

    step()  # allocates the gradients and the momentum
    if devices[0].type == "cuda":
        unique = sorted(set(devices), key=str)
        before = {d: torch.cuda.memory_allocated(d) for d in unique}
        for d in unique:
            torch.cuda.reset_peak_memory_stats(d)
        step()
        return {str(d): torch.cuda.max_memory_allocated(d) - before[d] for d in unique}
    return {"cpu": peak_cpu_bytes(step)}


def run_model(
    name: str, args: argparse.Namespace, rows: list[dict[str, Any]], tick: Callable[[str], None]
) -> None:
    """naive-1 and every pipeline-k of one model."""
    spec = build(name, args.size)
    x = torch.randn(args.batch, *spec.sample_shape)
    kind = args.devices
    first = devices_for(kind, 1)[0]
    tick(f"{name} naive-1")
    naive = build(name, args.size).model.to(first)
    params = sum(p.numel() for p in naive.parameters())
    peak = measure(naive, x.to(first), [first])
    rows.append(_row(name, "naive-1", params, naive, peak, None))
    for k in args.partitions:
        model = build(name, args.size).model
        if k > len(model):
            continue
        tick(f"{name} pipeline-{k}")
        balance = balance_by_size(k, model, x, chunks=args.chunks, param_scale=3.0, device=first)
        devices = devices_for(kind, k)
        pipe = GPipe(model, balance, devices=devices, chunks=args.chunks)
        peak = measure(pipe, x.to(devices[0]), devices)
        rows.append(_row(name, f"pipeline-{k}", params, pipe, peak, balance))


def _row(
    name: str, experiment: str, params: int, model: nn.Module, peak: dict[str, int],
    balance: list[int] | None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "model": name,
        "experiment": experiment,
        "parameters": params,
        "model_bytes": model_bytes(model),
        "activation_bytes": peak,
        "balance": balance,
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Per model: experiment, parameters, and per device model and activation memory."""
    mb = 1 / 2**20
    lines = [
        f"size {args.size!r}, batch {args.batch}, chunks {args.chunks}, devices {args.devices},"
        f" checkpoint 'except_last'; MiB per device (all CPU partitions share one device)"
    ]
    for name in args.models:
        naive = next(r for r in rows if r["model"] == name and r["experiment"] == "naive-1")
        base = max(naive["activation_bytes"].values())
        lines += ["", f"{name} ({naive['parameters']:,} parameters):",
                  f"{'Experiment':<12} {'model MiB':>10} {'peak activation MiB':>20} "
                  f"{'vs naive-1':>10}  balance"]  # fmt: skip
        for r in (r for r in rows if r["model"] == name):
            model_mib = max(r["model_bytes"].values()) * mb
            peak = max(r["activation_bytes"].values())
            lines.append(
                f"{r['experiment']:<12} {model_mib:>10.2f} {peak * mb:>20.2f} "
                f"{peak / base:>9.2f}x  {r['balance'] or ''}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Validate the CPU method, measure every model, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=picture, help="draw the peaks to this PNG")
    parser.add_argument("--quick", action="store_true", help="small: a smoke test")
    args = parse(parser, argv, batch=8, partitions=[1, 2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    expected, measured = validate()
    print(f"validation: known allocations peak at {expected:,} bytes; measured {measured:,}")
    rows: list[dict[str, Any]] = []
    total = len(args.models) * (1 + len(args.partitions))
    bar = Progress(total)

    for name in args.models:
        run_model(name, args, rows, bar.tick)
    bar.finish()
    print(table(rows, args), flush=True)
    parameters = settings(args)
    write_json(args.out, {"environment": environment(), "parameters": parameters,
                          "validation": {"expected": expected, "measured": measured},
                          "rows": rows})  # fmt: skip
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"drew {args.plot}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Peak activation memory per experiment, relative to naive-1, a group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    experiments = list(dict.fromkeys(r["experiment"] for r in rows))
    figure, axes = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(models)
    for index, name in enumerate(models):
        mine = {r["experiment"]: max(r["activation_bytes"].values()) for r in rows
                if r["model"] == name}  # fmt: skip
        base = mine["naive-1"]
        xs = [e + index * width for e, exp in enumerate(experiments) if exp in mine]
        axes.bar(xs, [mine[exp] / base for exp in experiments if exp in mine], width,
                 label=name)  # fmt: skip
    axes.set_xticks([e + 0.4 - width / 2 for e in range(len(experiments))], experiments)
    axes.set_ylabel("peak activation memory / naive-1")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
