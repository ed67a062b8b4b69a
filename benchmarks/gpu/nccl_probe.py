"""NCCL between two processes on one GPU: does a point-to-point message go through?

Both ranks use ``cuda:0``. NCCL is expected to refuse two ranks on one device; this
script records what it says, so that the benchmark's log shows what blocks running the
pipeline's NCCL transport between processes on a machine with a single GPU.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu/nccl_probe.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r: int, port: int) -> None:
    """Join a two-rank NCCL group on ``cuda:0`` and send a tensor from rank 0 to rank 1."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=r, world_size=2, timeout=datetime.timedelta(seconds=60))
    x = torch.full((4,), float(r), device="cuda")
    try:
        if r == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        torch.cuda.synchronize()
        print(f"rank {r}: a send and a receive on one GPU went through: {x.tolist()}", flush=True)
    except Exception as error:  # what NCCL says is the finding
        print(f"rank {r}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    """Start both ranks and wait for them."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nccl_probe.py needs a CUDA device (and torch built with NCCL)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
