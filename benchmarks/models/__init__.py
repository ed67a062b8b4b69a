"""Sequential versions of the models of the torchgpipe paper, with size knobs.

``build(name, size)`` gives the model and a batch maker for a preset: ``"tiny"`` runs on
a laptop CPU in seconds, ``"full"`` is the published size (for GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.amoebanet import amoebanetd
from models.resnet import resnet101
from models.unet import unet

__all__ = ["MODELS", "Spec", "build"]


@dataclass(frozen=True)
class Spec:
    """A model to benchmark and the shape of its input."""

    model: nn.Sequential
    sample_shape: tuple[int, ...]  # one sample
    make_target: Callable[[Tensor], Tensor]  # a target for a batch of outputs


def _classes(out: Tensor) -> Tensor:
    return torch.zeros(out.shape[0], dtype=torch.long, device=out.device)


def _same(out: Tensor) -> Tensor:
    return torch.zeros_like(out)


def build(name: str, size: str) -> Spec:
    """The model ``name`` at preset ``size`` (``"tiny"`` or ``"full"``)."""
    tiny = size == "tiny"
    if name == "resnet101":
        image = 32 if tiny else 224
        return Spec(resnet101(width=4 if tiny else 64, num_classes=10 if tiny else 1000),
                    (3, image, image), _classes)  # fmt: skip
    if name == "amoebanetd":
        layers, filters, image = (6, 8, 32) if tiny else (18, 256, 224)
        return Spec(amoebanetd(layers, filters, num_classes=10 if tiny else 1000),
                    (3, image, image), _classes)  # fmt: skip
    if name == "unet":
        depth, channels, image = (3, 4, 32) if tiny else (5, 64, 192)
        return Spec(unet(depth, channels), (3, image, image), _same)
    raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")


MODELS = ("resnet101", "amoebanetd", "unet")
