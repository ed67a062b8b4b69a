"""A split model against the same model written by hand as an ``nn.Sequential``.

Two questions (issue 15):

- **Speed.** The model: 8 blocks of ``Linear(1024, 1024)`` and ``Tanh``, written as a
  module whose forward loops over its blocks (``Looped``), batch 256 in 8
  micro-batches, two partitions of four blocks, one intra-op thread. ``split(looped, x,
  at=["blocks.4"])`` in ``GPipe`` against ``GPipe`` over the same blocks as an
  ``nn.Sequential`` with balance ``[4, 4]``: ``model(x)`` then ``loss.backward()``,
  timed round by round, interleaved in one process; the figure is the median over
  rounds of the per-round ratio split / by hand.
- **The split itself.** The time ``split`` takes on a GPT-style model of 48 blocks
  (``TinyGPT`` in ``examples/train_gpt.py``'s shape): at 7 named points, and into 8
  stages balanced by time (which includes ``balance_by_time``'s own timing, 1 s).

Run from the repository root::

    python benchmarks/split/main.py            # about a minute
    python benchmarks/split/main.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from torchgpipe import GPipe, split

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "examples"))
from common import count, environment, out_file, parse, settings, write_json  # benchmarks/common.py
from train_gpt import GPT  # examples/train_gpt.py

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "results.json"


class Looped(nn.Module):
    """The blocks in a ModuleList, called in a loop: a model that is not a Sequential."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        """Each block in turn."""
        for block in self.blocks:
            x = block(x)
        return x


def _blocks(depth: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]


def _train(model: nn.Module, x: Tensor, y: Tensor) -> float:
    started = time.perf_counter()
    nn.functional.mse_loss(model(x), y).backward()
    return time.perf_counter() - started


def speed(rounds: int, width: int, batch: int, chunks: int) -> dict[str, object]:
    """Median over rounds of split / by hand, each round timing both once, alternately."""
    blocks = _blocks(8, width)
    by_hand = GPipe(nn.Sequential(*blocks), [4, 4], chunks=chunks)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    looped = Looped(_blocks(8, width))  # the same values: _blocks seeds
    split_pipe = GPipe(split(looped, x, at=["blocks.4"]), [1, 1], chunks=chunks)
    for model in (by_hand, split_pipe):  # warm up: workers, allocator
        _train(model, x, y)
    ratios, ours, theirs = [], [], []
    for k in range(rounds):
        order = (split_pipe, by_hand) if k % 2 == 0 else (by_hand, split_pipe)
        times = {id(model): _train(model, x, y) for model in order}
        ours.append(times[id(split_pipe)])
        theirs.append(times[id(by_hand)])
        ratios.append(ours[-1] / theirs[-1])
    return {
        "split_ms": 1e3 * statistics.median(ours),
        "by_hand_ms": 1e3 * statistics.median(theirs),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def split_time(depth: int, stages: int) -> dict[str, float]:
    """Seconds ``split`` takes on a GPT-style model of ``depth`` blocks."""
    torch.manual_seed(0)
    model = GPT(vocab=64, width=64, depth=depth, context=32)
    ids = torch.randint(0, 64, (8, 32))
    step = depth // stages
    at = [f"blocks.{k}" for k in range(step, depth, step)][: stages - 1]
    started = time.perf_counter()
    named = split(model, ids, at=at)
    by_name = time.perf_counter() - started
    started = time.perf_counter()
    balanced = split(model, ids, stages=stages)
    by_time = time.perf_counter() - started
    assert len(named) == len(balanced) == stages
    return {"at_names_s": by_name, "balanced_by_time_s": by_time}


def main(argv: list[str] | None = None) -> None:
    """Measure, print the figures, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=count, default=21)
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few rounds")
    args = parse(parser, argv, rounds=3)
    torch.set_num_threads(1)
    width, batch, depth = (1024, 256, 48) if not args.quick else (64, 16, 8)
    env = environment()
    fast = speed(args.rounds, width, batch, chunks=8)
    took = split_time(depth, stages=8 if not args.quick else 2)
    print(
        f"8 x (Linear({width}), Tanh), batch {batch}, 8 micro-batches, 2 partitions, "
        f"{args.rounds} interleaved rounds of model(x) + loss.backward()\n"
        f"  by hand (nn.Sequential): {fast['by_hand_ms']:.1f} ms   split: "
        f"{fast['split_ms']:.1f} ms   split / by hand: {fast['ratio']:.3f} (median of "
        f"per-round ratios)\n"
        f"split of a GPT-style model of {depth} blocks: at named points "
        f"{took['at_names_s']:.2f} s, balanced by time {took['balanced_by_time_s']:.2f} s"
    )
    write_json(args.out, {"environment": env, "args": settings(args), "speed": fast, "split": took})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
