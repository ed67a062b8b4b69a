"""Skip connections across partitions: a small U-Net-shaped MLP on three CPU partitions.

Run it with ``python examples/skip_unet.py`` (``--steps``, ``--chunks``). Each ``Down``
level stashes its input and the matching ``Up`` level pops it; a ``Namespace`` per level
keeps the levels' skips apart although they share one name. GPipe sends each skip
straight from the partition that stashes it to the one that pops it.
"""

import argparse

import torch
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.skip import Namespace, pop, skippable, stash


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stashes its input for the matching Up level."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Stash ``x``, then map it."""
        yield stash("skip", x)
        return torch.relu(self.linear(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Joins the skip of the matching Down level back in."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Pop the skip and map it together with ``x``."""
        skip = yield pop("skip")
        return torch.relu(self.linear(torch.cat([x, skip], dim=1)))


def positive(text: str) -> int:
    """An argument of at least 1, or an argparse error that says so."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=30, help="training steps (30)")
    parser.add_argument("--chunks", type=positive, default=4, help="micro-batches per batch (4)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # each CPU partition runs on a worker thread of its own

    width = 32
    levels = [Namespace(f"level {k}") for k in (1, 2)]
    model = nn.Sequential(
        Down(width).isolate(levels[0]),
        Down(width).isolate(levels[1]),
        nn.Linear(width, width),
        Up(width).isolate(levels[1]),
        Up(width).isolate(levels[0]),
        nn.Linear(width, 1),
    )
    model = GPipe(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=args.chunks)
    print(model.skip_layout)  # which partition stashes and which pops each skip

    x = torch.randn(256, width)
    y = x[:, :4].sum(dim=1, keepdim=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps:
            print(f"step {step:2d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
