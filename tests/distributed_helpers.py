"""Run a function in several processes joined by gloo on loopback, for the tests.

``spawn(fn, world)`` starts ``world`` processes (the ``spawn`` start method), joins
them in a gloo process group on 127.0.0.1, runs ``fn(rank, world)`` in each and returns
the values, by rank. Every wait is bounded: a rank that neither returns nor dies within
``timeout`` seconds fails the test, and all processes are killed on the way out.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # a rank's first backward's import (conftest.py)
import torch.multiprocessing as mp
from helpers import PopAdd, StashLinear  # tests/helpers.py
from torch import Tensor, nn

DIED = "died"
"""The value of a rank that ended without returning (``os._exit``, say)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    timeout: float,
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world, *args)
        buffer = io.BytesIO()  # tensors by value: this process leaves at once
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # Flush the result, then leave without tearing down the group: a peer may have
    # died, and the teardown of a gloo group then waits on it.
    results.close()
    results.join_thread()
    os._exit(0)


def spawn(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0, dies: int = 0
) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` processes; their return values by rank.

    ``dies`` is how many ranks are expected to end without a value (they get
    :data:`DIED`). ``timeout`` bounds each collective and the whole run.

    Raises:
        AssertionError: a rank raised (with its traceback), or the run took too long.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_entry, args=(rank, world, port, fn, args, results, timeout), daemon=True
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout + 60.0  # start-up: spawn, import torch, gloo
    try:
        while len(values) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                if all(p.exitcode is not None for p in processes) and results.empty():
                    break  # every rank has ended and flushed what it had
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the ranks ran past {timeout + 60.0} s; returned: {sorted(values)}"
                    ) from None
                continue
            if status == "ok":
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} raised:\n{value}")
    finally:
        for process in processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [rank for rank in range(world) if rank not in values]
    if len(missing) != dies:
        raise AssertionError(f"ranks {missing} ended without a value; expected {dies} to")
    return [values.get(rank, DIED) for rank in range(world)]


def run_threads(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 30.0,
    observe: Callable[..., Any] | None = None,
) -> list[Any]:
    """``fn(transport, *args)`` on ``world`` threads, each a rank of a LocalTransport mesh.

    Returns each rank's value, or the exception it raised. Fails if a thread is still
    running after ``timeout`` seconds. ``observe`` sees every group of transfers
    (``LocalTransport.mesh``).
    """
    import threading

    from torchgpipe.distributed import LocalTransport

    transports = LocalTransport.mesh(world, timeout=timeout / 2, observe=observe)
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = fn(transports[rank], *args)
        except BaseException as error:
            out[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        raise AssertionError(f"ranks {stuck} still running after {timeout} s")
    return out


# Models: the same in every process, from a seed.


def mlp(seed: int = 0) -> nn.Sequential:
    """Eight layers, so that 1, 2, 4 and 8 partitions all divide them."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Linear(8, 4),
        nn.Identity(),
    )


class Widen(nn.Module):
    """One feature more while ``Widen.wide`` is set, in the process that runs it: a value
    between stages whose layout changes at one input shape."""

    wide = False

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, x[:, :1]], dim=1) if Widen.wide else x


class Narrow(nn.Module):
    """Back to ``mlp()``'s 8 features."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :8]


def widening() -> nn.Sequential:
    """``mlp()`` with :class:`Widen` and :class:`Narrow` after its third layer: with a
    balance starting ``[4, ...]``, stage 0's output is the value that may widen."""
    layers = list(mlp())
    return nn.Sequential(*layers[:3], Widen(), Narrow(), *layers[3:])


def skip_net(seed: int = 0) -> nn.Sequential:
    """A skip from layer 0 to layer 6: from stage 0 to stage 3 of four."""
    torch.manual_seed(seed)
    return nn.Sequential(
        StashLinear(4),
        nn.Linear(4, 4),
        nn.Tanh(),
        nn.Linear(4, 4),
        nn.ReLU(),
        nn.Linear(4, 4),
        PopAdd(),
        nn.Linear(4, 4),
    )


class ToRecord(nn.Module):
    """A sequence batch ``(b, L, 4)`` to a dict with a mask, a list and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> dict[str, Any]:
        h = self.linear(x)
        return {"h": h, "mask": h > 0, "sizes": [x.shape[1]], "note": "record"}


class RecordLayer(nn.Module):
    """Updates the record's ``h``, checking that the rest came through."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, record: dict[str, Any]) -> dict[str, Any]:
        if record["note"] != "record" or record["mask"].dtype != torch.bool:
            raise ValueError(f"the record arrived changed: {record!r}")
        h = torch.tanh(self.linear(record["h"])) * record["mask"]
        return {**record, "h": h, "pair": (h.sum(1), record["sizes"][0])}


class FromRecord(nn.Module):
    def forward(self, record: dict[str, Any]) -> Tensor:
        summed, length = record["pair"]
        return summed / length


def record_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(ToRecord(), RecordLayer(), RecordLayer(), FromRecord())


def bn_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 4), nn.BatchNorm1d(4)
    )


def lose_in_tie_sum(stage: Any, transport: Any) -> None:
    """Make ``stage``'s rank close its ``LocalTransport`` when its ties would be summed."""
    from torchgpipe.distributed import LocalTransport

    assert isinstance(transport, LocalTransport)

    def die(*sums: Any) -> None:
        transport.close()
        raise RuntimeError("gone")

    stage.reduce_tied = die
