r"""Train an MLP with one process per pipeline stage, on torch.distributed.

On one machine, four processes (gloo on CPU)::

    torchrun --nproc-per-node=4 examples/train_distributed.py

On two machines of two processes each, run on both (``--node-rank`` 0 and 1)::

    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 \
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 examples/train_distributed.py

With GPUs, add ``--backend nccl``: each process then uses the GPU of its local rank.
Without torchrun (``python examples/train_distributed.py``) it starts its own
processes on this machine, ``--processes`` of them.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from torchgpipe.distributed import PipelineStage, Schedule1F1B


def build_model() -> nn.Sequential:
    torch.manual_seed(0)  # every process builds the same model
    # Five layers, each with weights (a ReLU alone would make a stage with nothing to
    # train, which the optimizer refuses): at most five processes, one stage each.
    return nn.Sequential(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Linear(64, 64),
        nn.Linear(64, 1),
    )


def positive(text: str) -> int:
    """An argument of at least 1, or an argparse error that says so."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def train(backend: str, steps: int) -> None:
    dist.init_process_group(backend)  # torchrun's environment says who and where
    torch.set_num_threads(1)
    world = dist.get_world_size()
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    model = build_model()
    layers = len(model)  # in `world` partitions, one per process
    balance = [layers // world + (j < layers % world) for j in range(world)]
    stage = PipelineStage(model, balance, chunks=4, device=device)
    schedule = Schedule1F1B(stage, nn.functional.mse_loss)
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True)  # a target the MLP learns in a few steps
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        # Rank 0 feeds the input, the last rank the target; the others pass nothing.
        result = schedule.step(
            x.to(stage.device) if stage.is_first else None,
            y.to(stage.device) if stage.is_last else None,
        )
        optimizer.step()
        if stage.rank == 0 and (step % 5 == 0 or step == steps):
            print(f"step {step:2d}  loss {result.loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, backend: str, steps: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    train(backend, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=positive, default=30, help="training steps (30)")
    parser.add_argument(
        "--processes", type=positive, default=4, help="stages, without torchrun only (4)"
    )
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        stages = int(os.environ.get("WORLD_SIZE", "1"))
    else:
        world = stages = args.processes
    layers = len(build_model())
    if stages > layers:
        parser.error(
            f"{stages} processes, but the model has {layers} layers and each process runs "
            f"at least one; start at most {layers}"
        )
    if args.backend == "nccl" and torch.cuda.device_count() < world:
        # One GPU cannot host two NCCL ranks: each process needs a GPU of its own.
        parser.error(
            f"--backend nccl needs a GPU per process on this machine: {world} processes, "
            f"{torch.cuda.device_count()} GPUs; start fewer processes per machine, "
            "or use --backend gloo"
        )
    if "RANK" in os.environ:
        train(args.backend, args.steps)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned, args=(args.processes, port, args.backend, args.steps), nprocs=args.processes)


if __name__ == "__main__":
    main()
