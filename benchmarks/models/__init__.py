"""Sequential versions of the models of the torchgpipe paper, with size knobs.

``build(name, size)`` gives the model and a batch maker for a preset: ``"tiny"`` runs on
a laptop CPU in seconds, ``"full"`` is the published size (for GPUs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import count  # benchmarks/common.py
from torch import Tensor, nn

from models.amoebanet import amoebanetd
from models.resnet import resnet101
from models.unet import unet

__all__ = ["MODELS", "Spec", "add_arguments", "build", "devices_for"]


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
        layers, filters, image = (6, 8, 64) if tiny else (18, 256, 224)
        return Spec(amoebanetd(layers, filters, num_classes=10 if tiny else 1000),
                    (3, image, image), _classes)  # fmt: skip
    if name == "unet":  # U-Net (B, C) = (5, 64), the paper's speed benchmark
        units, channels, depth, image = (2, 4, 3, 32) if tiny else (5, 64, 5, 192)
        return Spec(unet(units, channels, depth=depth), (3, image, image), _same)
    raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")


MODELS = ("resnet101", "amoebanetd", "unet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options the experiments share: models, size, batch, chunks, partitions, devices."""
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--batch", type=count, default=32)
    parser.add_argument("--chunks", type=count, default=4)
    parser.add_argument("--partitions", type=count, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--devices", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )


def devices_for(kind: str, k: int) -> list[torch.device]:
    """``k`` devices of ``kind``: the GPUs in turn, or the CPU ``k`` times."""
    if kind == "cuda":
        count = torch.cuda.device_count()
        return [torch.device("cuda", j % count) for j in range(k)]
    return [torch.device("cpu")] * k
