"""Random numbers in checkpointed cells: recomputation must draw what forward drew.

A partition that has its device to itself saves the device's generator state before a
checkpointed forward and restores it for the recomputation, as GPipe does.

That is not enough when partitions share a device (all CPU partitions do; CUDA ones may):
their workers draw from the one default generator at the same time, so the state saved
at the start of a cell does not determine what the cell draws. There, each cell gets a
stream of its own: a dispatch mode, active only on that cell's thread, runs every random
operator against the cell's private generator state (swapped into the default generator
under a lock for the duration of that one operator). Forward and recomputation start the
stream from the same seed, so they draw the same numbers, whatever other threads do; and
the seeds come from the default generator in a fixed order, so a run is reproducible
under ``torch.manual_seed``. Every operator dispatched on such a cell pays a Python call
(microseconds), so this is used only where it is needed: on shared devices, in runs that
checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CellRandomness", "draw_seed", "generator_key"]

_SWAP_LOCK = threading.Lock()


def draw_seed() -> int:
    """A seed for a forward pass's cells, drawn from the default CPU generator."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def generator_key(device: torch.device) -> tuple[str, int]:
    """Which default generator ``device`` draws from: one for the CPU, one per GPU.

    ``cpu``, ``cpu:0`` and ``cpu:1`` are different devices to ``==`` but share the one
    CPU generator, so partitions on them share it too.
    """
    if device.type == "cpu":
        return ("cpu", 0)
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return (device.type, index if index is not None else 0)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


class _PrivateStream(TorchDispatchMode):
    """Runs random operators on a generator state of this cell's own."""

    def __init__(self, seed: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated
        self._seed = seed
        self._states: dict[torch.device, torch.Tensor] = {}
        self.drew = False  # whether any random operator ran under this stream

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        self.drew = True
        device = _device_of(args, kwargs)
        generator = _default_generator(device)
        with _SWAP_LOCK:
            outer = generator.get_state()
            generator.set_state(self._state(device, generator))
            try:
                return func(*args, **kwargs)
            finally:
                self._states[device] = generator.get_state()
                generator.set_state(outer)

    def _state(self, device: torch.device, generator: torch.Generator) -> torch.Tensor:
        if device not in self._states:
            own = torch.Generator(generator.device)
            own.manual_seed(self._seed)
            self._states[device] = own.get_state()
        return self._states[device]


class CellRandomness:
    """What a cell needs so that its recomputation draws the numbers its forward drew.

    Args:
        device: the partition's device.
        seed: a seed for a private stream, or None to save and restore the device's
            generator instead (for a partition that has its device to itself).
    """

    def __init__(self, device: torch.device, seed: int | None) -> None:
        self._device = device
        self._seed = seed
        self._saved: list[torch.Tensor] = []
        self._stream: _PrivateStream | None = None

    def forward(self) -> AbstractContextManager[None]:
        """Enter around the cell's forward pass."""
        if self._seed is not None:
            self._stream = _PrivateStream(self._seed)
            return self._stream
        self._saved = [torch.get_rng_state()]
        if self._device.type == "cuda":
            self._saved.append(torch.cuda.get_rng_state(self._device))
        return nullcontext()

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Enter around the recomputation: it draws the same numbers as the forward."""
        if self._seed is not None:
            if self._stream is not None and not self._stream.drew:
                # The forward drew nothing, so the same computation again draws nothing:
                # no need to pay a Python call per operator a second time.
                yield
                return
            with _PrivateStream(self._seed):
                yield
            return
        cuda = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(self._saved[0])
            if cuda:
                torch.cuda.set_rng_state(self._saved[1], self._device)
            yield
