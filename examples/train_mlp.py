"""Train an MLP with GPipe: two partitions, four micro-batches, CPU by default.

Run it with ``python examples/train_mlp.py`` (``--steps``, ``--chunks``). For GPUs, pass
``devices=["cuda:0", "cuda:1"]`` (or leave ``devices`` out to use every GPU) and move
the inputs to the first device and the targets to the last.
"""

import argparse

import torch
from torch import nn

from torchgpipe import GPipe


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

    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 1),
    )
    # Layers 0-3 on the first partition, 4-6 on the second; each batch in micro-batches.
    model = GPipe(model, balance=[4, 3], devices=["cpu", "cpu"], chunks=args.chunks)

    x = torch.randn(512, 64)
    y = x[:, :8].sum(dim=1, keepdim=True)  # a target the MLP can learn in a few steps

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # the output is on the last device
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps:
            print(f"step {step:2d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
