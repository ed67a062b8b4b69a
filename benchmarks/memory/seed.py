"""The seed's memory experiments on one GPU: its rows, and the largest model that fits.

The torchgpipe paper's memory tables (Kim et al., 2020, arXiv 2004.09910) give, per
experiment, a model size and the memory of one training step. Those that one device can run are
``naive-1`` (the plain model) and ``pipeline-1`` (GPipe with one partition, which keeps
only the micro-batches' inputs and recomputes one micro-batch at a time):

- AmoebaNet-D (L, F): naive-1 (18, 208), pipeline-1 (18, 416); a batch of 128 images of
  224x224, 128 micro-batches, RMSprop (model memory: 3 x the parameters).
- U-Net (B, C): naive-1 (6, 72), pipeline-1 (11, 128); a batch of 32 images of 192x192,
  32 micro-batches, SGD (model memory: 2 x the parameters).

Two measurements, both with ``torch.cuda.max_memory_allocated`` over one training step
after the gradients and the optimizer's state were allocated (an optimizer step on zero
gradients), so that the peak holds all that a step in the middle of training holds:

1. ``rows``: the seed's sizes, for its parameters, model memory and peak activation
   memory (the peak less the model memory), beside the published figures.
2. ``largest``: with the depth of the seed's row (L or B) fixed, the widest model (F or
   C) whose step fits on this GPU (or under ``--memory-cap-gib``), by doubling and then
   bisection; a step that raises ``torch.OutOfMemoryError`` does not fit. The search
   stops at ``--search-seconds`` per experiment and then reports the widest that fitted
   so far as a lower bound.

Run from the repository root on a machine with a GPU::

    python benchmarks/memory/seed.py rows largest
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import GPipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import environment, write_json  # benchmarks/common.py
from models.amoebanet import amoebanetd
from models.unet import unet

CUDA = torch.device("cuda", 0)
GIB = 2**30
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "seed.json"


@dataclass(frozen=True)
class Experiment:
    """One row of the seed's table: a model family, its depth and width, how it trains."""

    model: str
    name: str  # naive-1 or pipeline-1
    depth: int  # L or B
    width: int  # F or C
    step: int  # how much the width moves at a time in the search
    published: str  # the seed's figures for this row

    @property
    def label(self) -> str:
        """``model name (depth, width)``, as the seed's tables name a row."""
        return f"{self.model} {self.name} ({self.depth}, {self.width})"


EXPERIMENTS = [
    Experiment("amoebanetd", "naive-1", 18, 208, 32,
               "81.5M parameters, 0.91 GiB model, peak activation: out of memory (P40)"),
    Experiment("amoebanetd", "pipeline-1", 18, 416, 32,
               "319.0M parameters, 3.57 GiB model, 0.91 GiB peak activation"),
    Experiment("unet", "naive-1", 6, 72, 16, "362.2M parameters, 20.3 GiB in all"),
    Experiment("unet", "pipeline-1", 11, 128, 16, "2.21B parameters, 20.5 GiB in all"),
]  # fmt: skip


def build(experiment: Experiment, width: int) -> tuple[nn.Module, Tensor, Callable[..., Tensor],
                                                        torch.optim.Optimizer, int]:  # fmt: skip
    """The model on the GPU (built there), its batch, loss, optimizer and state multiple."""
    with torch.device(CUDA):
        if experiment.model == "amoebanetd":
            model: nn.Module = amoebanetd(experiment.depth, width, num_classes=1000)
            x = torch.rand(128, 3, 224, 224)
            target = torch.randint(1000, (128,))
            chunks = 128

            def loss(out: Tensor) -> Tensor:
                return nn.functional.cross_entropy(out, target)

        else:
            model = unet(experiment.depth, width)
            x = torch.rand(32, 3, 192, 192)
            mask = torch.rand(32, 1, 192, 192)
            chunks = 32

            def loss(out: Tensor) -> Tensor:
                return nn.functional.binary_cross_entropy_with_logits(out, mask)

    if experiment.name == "pipeline-1":
        assert isinstance(model, nn.Sequential)
        model = GPipe(model, [len(model)], devices=[CUDA], chunks=chunks)
    if experiment.model == "amoebanetd":
        return model, x, loss, torch.optim.RMSprop(model.parameters()), 3
    return model, x, loss, torch.optim.SGD(model.parameters(), lr=0.1), 2


def measure(experiment: Experiment, width: int) -> dict[str, Any] | None:
    """A training step at ``width``, on a thread of its own: see :func:`_measure`.

    Outside GPipe, skippable layers keep their stashes in a tracker of the calling
    thread, and a forward that runs out of memory between a stash and its pop leaves
    them there. A thread per measurement takes them away with it.
    """
    result: list[dict[str, Any] | None] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(_measure(experiment, width))
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    _release()
    if failure:
        raise failure[0]
    return result[0]


def _measure(experiment: Experiment, width: int) -> dict[str, Any] | None:
    """A training step at ``width``: the memory figures, or None if it does not fit."""
    _release()
    torch.cuda.reset_peak_memory_stats(CUDA)
    held = torch.cuda.memory_allocated(CUDA)  # left by earlier measurements: none, or a leak
    started = time.perf_counter()
    try:
        model, x, loss, optimizer, scale = build(experiment, width)
        parameters = sum(p.numel() for p in model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # makes the optimizer's state
        optimizer.zero_grad(set_to_none=False)
        loss(model(x)).backward()
        optimizer.step()
        torch.cuda.synchronize(CUDA)
    except RuntimeError as error:  # torch.OutOfMemoryError, or cuDNN short of workspace
        if not isinstance(error, torch.OutOfMemoryError) and "ALLOC" not in str(error):
            raise
        return None
    finally:
        model = x = optimizer = loss = p = None  # type: ignore[assignment]
        _release()
    peak = torch.cuda.max_memory_allocated(CUDA) - held
    model_bytes = scale * 4 * parameters
    return {
        "width": width,
        "parameters": parameters,
        "model_gib": model_bytes / GIB,
        "peak_gib": peak / GIB,
        "activation_gib": (peak - model_bytes) / GIB,
        "seconds": time.perf_counter() - started,
        "held_before_gib": held / GIB,
    }


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def largest(experiment: Experiment, budget: float) -> dict[str, Any]:
    """The widest model that fits: double from the seed's width, then bisect."""
    started = time.perf_counter()
    unit = experiment.step
    fits: dict[str, Any] | None = None
    low, high = 0, None  # in units: low fits (0: none yet), high does not
    probe = experiment.width // unit
    complete = True
    while high is None or high - low > 1:
        if time.perf_counter() - started > budget:
            complete = False
            break
        result = measure(experiment, probe * unit)
        print(f"  {experiment.model} {experiment.name} width {probe * unit}: "
              f"{'fits' if result else 'out of memory'}", flush=True)  # fmt: skip
        if result is not None:
            low, fits = probe, result
        else:
            high = probe
        if high is None:
            probe *= 2
        elif low == 0 and high == 1:
            break
        else:
            probe = (low + high) // 2 if low else max(high // 2, 1)
    return {"experiment": experiment.name, "model": experiment.model,
            "depth": experiment.depth, "largest": fits, "complete": complete,
            "first_too_large": None if high is None else high * unit}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the measurements asked for; print them; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="+", choices=("rows", "largest"))
    parser.add_argument("--models", nargs="+", default=["amoebanetd", "unet"])
    parser.add_argument("--memory-cap-gib", type=float, help="act as if the GPU had this much")
    parser.add_argument("--search-seconds", type=float, default=150.0, help="per experiment")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    total = torch.cuda.get_device_properties(CUDA).total_memory
    if args.memory_cap_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * GIB / total))
    experiments = [e for e in EXPERIMENTS if e.model in args.models]
    results: dict[str, Any] = {"environment": environment(), "total_gib": total / GIB,
                               "memory_cap_gib": args.memory_cap_gib}  # fmt: skip
    if "rows" in args.what:
        print(f"The seed's rows on {torch.cuda.get_device_name(CUDA)} ({total / GIB:.1f} GiB)")
        rows = []
        for experiment in experiments:
            row = measure(experiment, experiment.width)
            rows.append({"label": experiment.label, "published": experiment.published,
                         "measured": row})  # fmt: skip
            print(f"{experiment.label}: " + (_describe(row) if row else "out of memory"))
            print(f"    published: {experiment.published}", flush=True)
        results["rows"] = rows
    if "largest" in args.what:
        cap = f"{args.memory_cap_gib} GiB cap" if args.memory_cap_gib else f"{total / GIB:.1f} GiB"
        print(f"\nThe largest model that fits ({cap}), depth fixed at the seed's")
        found = []
        for experiment in experiments:
            result = largest(experiment, args.search_seconds)
            found.append(result)
            fit = result["largest"]
            bound = "" if result["complete"] else " (search stopped: a lower bound)"
            print(f"{experiment.model} {experiment.name}: "
                  + (f"width {fit['width']}, {_describe(fit)}{bound}" if fit else "nothing fits"),
                  flush=True)  # fmt: skip
        results["largest"] = found
    write_json(args.out, results)
    print(f"\nwrote {args.out}")


def _describe(row: dict[str, Any]) -> str:
    return (f"{row['parameters'] / 1e6:,.1f}M parameters, model {row['model_gib']:.2f} GiB, "
            f"peak {row['peak_gib']:.2f} GiB, activation {row['activation_gib']:.2f} GiB "
            f"({row['seconds']:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
