"""Devices as users write them: checked, and turned into ``torch.device``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any, ClassVar, NoReturn, TypeAlias

import torch
from torch import Tensor, nn

__all__ = ["Device", "PlacedModule", "as_device", "check_devices"]

Device: TypeAlias = torch.device | int | str
"""A device as users write it: ``torch.device('cuda', 1)``, ``1`` or ``'cuda:1'``."""


def check_devices(devices: Sequence[Device] | None, n: int) -> list[torch.device]:
    """The first ``n`` of ``devices``, each checked; by default, what the machine has.

    Raises:
        TypeError: ``devices`` is a single device, or holds something not a device.
        ValueError: a device is not available, or is the meta device.
        IndexError: there are fewer than ``n`` devices.
    """
    if devices is None:
        if torch.cuda.is_available():
            found = [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
        else:
            found = [torch.device("cpu")] * n
    else:
        if isinstance(devices, str | int | torch.device):
            raise TypeError(
                f"devices must be a sequence with a device per partition, got {devices!r}; "
                f"for example devices={[devices] * n!r}"
            )
        found = [as_device(d) for d in devices]
    if len(found) < n:
        raise IndexError(
            f"there are {n} partitions but only {len(found)} device(s) ({found}); pass at "
            f"least {n} devices (a device may repeat, as in devices=['cpu'] * {n}), or "
            f"fewer partitions in balance"
        )
    return found[:n]


def as_device(device: Device) -> torch.device:
    """``device`` as a ``torch.device`` to run on; a bare ``'cuda'`` is the current GPU.

    Raises:
        TypeError: ``device`` is not a torch.device, an int or a string.
        ValueError: ``device`` names no device, one that is not available here, or the
            meta device.
    """
    if isinstance(device, bool) or not isinstance(device, torch.device | int | str):
        raise TypeError(
            f"a device must be a torch.device, an int (a CUDA index) or a string such as "
            f"'cpu' or 'cuda:1', got {device!r}"
        )
    try:
        result = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"{device!r} is not a device: {error}") from None
    if result.type == "meta":
        raise ValueError(
            f"device {device!r} is the meta device, whose tensors hold no data, so no layer "
            f"can run there; meta is for building a model without memory (with "
            f"torch.device('meta'): model = ...): name a real device such as 'cpu' or "
            f"'cuda:0' (GPipe and PipelineStage materialize a model's meta layers on "
            f"theirs: see their init and state_dict arguments)"
        )
    if result.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {result} was requested but CUDA is not available here; use "
                f"'cpu' (GPipe: or leave devices=None to pick what the machine has)"
            )
        if result.index is None:
            result = torch.device("cuda", torch.cuda.current_device())
        if result.index is not None and result.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {result} was requested but there are only "
                f"{torch.cuda.device_count()} CUDA devices"
            )
    return result


class PlacedModule(nn.Module):
    """A module whose parts stay on the devices they were given: moving it is refused.

    ``to(dtype)`` and ``half()``-style dtype changes are allowed; ``to(device)``,
    ``cuda()``, ``cpu()``, ``xpu()``, ``ipu()``, ``mtia()`` and ``to_empty(device=...)``
    raise ``TypeError`` with :attr:`move_refused`, which says how to place it elsewhere.
    """

    move_refused: ClassVar[str] = "this module cannot be moved between devices"

    def to(self, *args: Any, **kwargs: Any) -> PlacedModule:
        """Change the dtype of parameters and buffers; moving between devices is refused.

        Raises:
            TypeError: a device (or a tensor, whose device would be used) was given.
        """
        if _names_device(args, kwargs):
            raise TypeError(self.move_refused)
        return super().to(*args, **kwargs)

    def cuda(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: the module places its parts on their own devices.

        So are ``cpu()``, ``xpu()``, ``ipu()``, ``mtia()`` and ``to_empty(device=...)``.

        Raises:
            TypeError: always.
        """
        raise TypeError(self.move_refused)

    cpu = xpu = ipu = mtia = to_empty = cuda

    def _apply(self, fn: Any, recurse: bool = True) -> PlacedModule:
        # What a parent module's .to(), .cuda() or .to_empty() does to this one: refused
        # as calling them here is, by trying the change on a tensor of each device held.
        # A dtype change gives another dtype, .to() with nothing to change the tensor
        # itself; the same dtype on a new tensor is a copy or a wipe (to_empty).
        held = {t.device for t in chain(self.parameters(), self.buffers())}
        for device in held:
            probe = torch.zeros(1, device=device)
            changed = fn(probe)
            if not isinstance(changed, Tensor) or changed.device != device:
                raise TypeError(self.move_refused)
            if changed is not probe and changed.dtype == probe.dtype:
                raise TypeError(self.move_refused)
        applied: PlacedModule = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return applied


def _names_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("device") is not None or kwargs.get("tensor") is not None:
        return True
    # Only the first positional argument can be one: to(dtype, non_blocking) passes a bool.
    first = args[0] if args else None
    return isinstance(first, torch.device | str | int | Tensor) and not isinstance(first, bool)
