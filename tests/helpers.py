"""Layers and tools shared by the tests."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe import is_recomputing
from torchgpipe.skip import pop, skippable, stash


class Recorder(nn.Module):
    """Logs (event, tag, micro-batch) on each call; the micro-batch is read from the input,
    whose first column holds the sample index (use one sample per micro-batch)."""

    def __init__(self, tag: int, log: list[tuple[int, str, int, int]], clock: itertools.count[int]):
        super().__init__()
        self.tag, self.log, self.clock = tag, log, clock
        self.hook: Callable[[int], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        i = int(x[0, 0])
        kind = "recompute" if is_recomputing() else "forward"
        self.log.append((next(self.clock), f"{kind}-start", self.tag, i))
        if self.hook is not None and not is_recomputing():
            self.hook(i)
        self.log.append((next(self.clock), f"{kind}-end", self.tag, i))
        return x


def assert_same_grads(model: nn.Module, plain: nn.Module) -> None:
    """Every parameter of ``model`` holds the gradient of ``plain``'s, in order."""
    pairs = zip(model.named_parameters(), plain.named_parameters(), strict=True)
    for (name, ours), (_, theirs) in pairs:
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


def indexed_input(m: int, width: int = 3) -> Tensor:
    """m samples whose first column is their index."""
    x = torch.zeros(m, width)
    x[:, 0] = torch.arange(m, dtype=torch.float32)
    return x


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchgpipe-worker")]


def assert_workers_idle_and_alive(model: nn.Module, n: int) -> None:
    """The model's n workers are still there (none died) and nothing else was started."""
    pool = model.workers.pool  # type: ignore[union-attr]
    assert pool is not None
    assert len(pool.threads) == n
    assert all(t.is_alive() for t in pool.threads)


class Fail(nn.Module):
    """Raises `error` on micro-batch `on` (read from the first column)."""

    def __init__(self, error: BaseException, on: int) -> None:
        super().__init__()
        self.error, self.on = error, on

    def forward(self, x: Tensor) -> Tensor:
        if int(x[0, 0]) == self.on:
            raise self.error
        return x


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    """Stashes its input as 'skip' and returns a linear map of it."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return self.linear(x)


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    """Adds the popped 'skip' to its input."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


@skippable(pop=["skip"])
class PopAddFailingOnce(nn.Module):
    """Adds the popped 'skip' to its input; with ``fail``, raises after the pop."""

    def forward(self, x: Tensor, fail: bool = False):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        if fail:
            raise RuntimeError("after the pop")
        return x + skip


class Count(torch.autograd.Function):
    """The identity; counts the calls of its backward."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        Count.calls += 1
        return grad


class Counted(nn.Module):
    """:class:`Count` as a layer."""

    def forward(self, x: Tensor) -> Tensor:
        return Count.apply(x)  # type: ignore[no-any-return,no-untyped-call]


class ScaleInPlace(nn.Module):
    """``x.mul_(w)`` with a trained ``w``: an input that wants no gradient comes to want
    one through the change in place, and is no leaf any more."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(self.w)


class BackwardFails(torch.autograd.Function):
    """Identity whose backward raises ``ArithmeticError("in backward")``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise ArithmeticError("in backward")


class OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``call()`` before the gradient goes on.

    ``OnBackward.apply(x, call)``: tests use it to wait at a gate, signal an event or call
    a model from inside the engine's backward at a known node.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, call: Callable[[], object]) -> Tensor:
        ctx.call = call
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.call()
        return grad, None


class Versioned(nn.Module):
    """A gain of 4 at version 2; version 1 saved half of it, so loading one doubles it.

    As torch's own modules convert old checkpoints: by the version a state dict's
    ``_metadata`` records for the module.
    """

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.g)

    def _load_from_state_dict(self, state: Any, prefix: str, metadata: Any, *args: Any) -> None:
        if (metadata.get("version") or 1) < 2:
            state[prefix + "g"] = state[prefix + "g"] * 2
        super()._load_from_state_dict(state, prefix, metadata, *args)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.g


class EmptyWeight(nn.Module):
    """Adds a weight of no elements: torch takes no inf norm of its empty gradient.

    (Not a sparse gradient: torch 2.14 takes its norm, 2.13 does not.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.empty.sum()


class Routed(nn.Module):
    """A batch norm run on the samples routed to it: a micro-batch may route none."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        routed = x[:, 0] > 0
        if not bool(routed.any()):
            return x
        return x.masked_scatter(routed[:, None], self.bn(x[routed]))


def routed_batch(unrouted: list[int]) -> Tensor:
    """16 samples in 4 micro-batches of 4; those of ``unrouted`` routed nowhere."""
    x = torch.randn(16, 4, dtype=torch.float64)
    x[:, 0] = x[:, 0].abs() + 0.1
    for i in unrouted:
        x[4 * i : 4 * i + 4, 0] = -1.0
    return x
