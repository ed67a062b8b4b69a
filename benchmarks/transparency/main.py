"""Transparency: the same training, plain and under GPipe, gives the same loss curve.

A small convolutional network trains on a synthetic classification task it makes
itself, from one seed: once as the plain ``nn.Sequential``, then under GPipe over 2 CPU
partitions for each checkpoint mode and several chunk counts, from the same initial
weights on the same batches, with SGD and momentum. The network has no dropout or batch
norm, so the mathematics is the same; only the order of additions differs (gradients
are summed over micro-batches). The script prints the largest difference between each
GPipe loss curve and the plain one, and can draw the curves.

Run from the repository root::

    python benchmarks/transparency/main.py --plot benchmarks/transparency/results/loss.png
    python benchmarks/transparency/main.py --quick
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import GPipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # benchmarks/common.py
    Progress,
    count,
    environment,
    out_file,
    parse,
    picture,
    settings,
    write_json,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"
MODES = ("always", "except_last", "never")


def network() -> nn.Sequential:
    """Two convolutions and a classifier: 7 layers, no randomness, no batch norm."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(16 * 16, 10),
    )


def data(batches: int, batch: int) -> list[tuple[Tensor, Tensor]]:
    """Images whose class sets the mean of one colour channel, plus noise."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(batches):
        y = torch.randint(10, (batch,), generator=generator)
        x = torch.randn(batch, 3, 16, 16, generator=generator)
        x[:, 0] += (y.float() - 4.5)[:, None, None] * 0.3
        out.append((x, y))
    return out


def train(model: nn.Module, batches: list[tuple[Tensor, Tensor]], steps: int) -> list[float]:
    """The loss of every step of SGD with momentum."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def plot(curves: dict[str, list[float]], path: Path) -> None:
    """The loss curves, and each GPipe curve's difference from the plain one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    plain = curves["plain"]
    for name, losses in curves.items():
        top.plot(losses, label=name, linewidth=2.5 if name == "plain" else 0.8)
        if name != "plain":
            bottom.plot([abs(a - b) for a, b in zip(losses, plain, strict=True)], label=name)
    top.set_ylabel("training loss")
    top.legend(fontsize=7)
    bottom.set_yscale("log")
    bottom.set_ylabel("|GPipe - plain|")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    """Train plain and under every GPipe setting; print the differences."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=count, default=300)
    parser.add_argument("--chunks", type=count, nargs="+", default=[2, 4, 7])
    parser.add_argument("--batch", type=count, default=64)
    parser.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="float64 keeps rounding small enough that 300 steps do not amplify it",
    )
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=picture, help="draw the curves to this PNG")
    parser.add_argument("--quick", action="store_true", help="a few steps: a smoke test")
    args = parse(parser, argv, steps=5, chunks=[2], batch=8)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    initial = network().to(dtype)
    batches = [(x.to(dtype), y) for x, y in data(8, args.batch)]
    runs: list[tuple[str, Any]] = [("plain", None)]
    runs += [(f"chunks={m} {mode}", (m, mode)) for m in args.chunks for mode in MODES]
    curves: dict[str, list[float]] = {}
    bar = Progress(len(runs))
    for name, setting in runs:
        bar.tick(name)
        model: nn.Module = copy.deepcopy(initial)
        if setting is not None:
            chunks, mode = setting
            model = GPipe(model, [4, 3], devices=["cpu", "cpu"], chunks=chunks, checkpoint=mode)
        curves[name] = train(model, batches, args.steps)
    bar.finish()

    plain = curves["plain"]
    lines = [
        f"{args.steps} steps of SGD (momentum 0.9), batch {args.batch}, {args.dtype}, 2 CPU "
        f"partitions [4, 3]; plain loss {plain[0]:.4f} -> {plain[-1]:.4f}",
        "",
        f"{'GPipe':<24} {'final loss':>11} {'max |diff|':>11} {'max rel diff':>13}",
    ]
    rows = []
    for name, losses in curves.items():
        if name == "plain":
            continue
        diffs = [abs(a - b) for a, b in zip(losses, plain, strict=True)]
        relative = max(d / abs(p) for d, p in zip(diffs, plain, strict=True))
        rows.append({"run": name, "final": losses[-1], "max_abs": max(diffs), "max_rel": relative})
        lines.append(f"{name:<24} {losses[-1]:>11.6f} {max(diffs):>11.2e} {relative:>13.2e}")
    print("\n".join(lines), flush=True)
    parameters = settings(args)
    write_json(
        args.out,
        {"environment": environment(), "parameters": parameters, "rows": rows, "curves": curves},
    )
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(curves, args.plot)
        print(f"drew {args.plot}")


if __name__ == "__main__":
    main()
