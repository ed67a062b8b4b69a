import copy

import pytest
import torch

from torchgpipe.copy import move
from torchgpipe.stream import (
    CPU_STREAM,
    PartitionStreams,
    current_stream,
    new_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)

CPU = torch.device("cpu")


def test_cpu_streams_are_the_placeholder() -> None:
    assert new_stream(CPU) is CPU_STREAM
    assert current_stream(CPU) is CPU_STREAM
    with use_stream(CPU_STREAM), use_device(CPU):
        pass
    wait_stream(CPU_STREAM, CPU_STREAM)
    record_stream(torch.zeros(1), CPU_STREAM)


def test_partition_streams_are_kept_and_not_copied() -> None:
    streams = PartitionStreams([CPU, CPU])
    assert streams.compute(1) is CPU_STREAM
    assert streams.copy(0) is CPU_STREAM
    assert copy.deepcopy(streams).devices == [CPU, CPU]


@pytest.mark.cuda
def test_partition_streams_on_cuda_are_made_once() -> None:
    device = torch.device("cuda", 0)
    streams = PartitionStreams([device, device])
    first = streams.compute(0)
    assert streams.compute(0) is first
    assert len({streams.compute(0), streams.copy(0), streams.compute(1), streams.copy(1)}) == 4
    clone = copy.deepcopy(streams)
    assert clone.compute(0) is not first  # a copy makes streams of its own


def test_move_on_cpu_keeps_structure_and_grad() -> None:
    x = torch.ones(2, requires_grad=True)
    moved = move({"x": x, "k": 1}, CPU, source=CPU_STREAM, copy=CPU_STREAM, target=CPU_STREAM)
    assert moved["k"] == 1
    assert moved["x"] is x  # already there: no copy


@pytest.mark.cuda
def test_cuda_streams_are_new_and_usable() -> None:
    device = torch.device("cuda", 0)
    stream = new_stream(device)
    assert isinstance(stream, torch.cuda.Stream)
    assert stream != torch.cuda.current_stream(device)
    with use_stream(stream):
        assert torch.cuda.current_stream(device) == stream


@pytest.mark.cuda
def test_move_between_cpu_and_cuda_on_side_streams_keeps_grad() -> None:
    device = torch.device("cuda", 0)
    compute, copy = new_stream(device), new_stream(device)
    x = torch.randn(4, 3, requires_grad=True)
    y = move((x,), device, source=CPU_STREAM, copy=copy, target=compute)[0]
    assert y.device == device
    with use_stream(compute):
        z = (y * 2).sum()
    back = move(z.unsqueeze(0), CPU, source=compute, copy=CPU_STREAM, target=CPU_STREAM)
    back.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full((4, 3), 2.0))


@pytest.mark.cuda
def test_gpipe_on_cuda_matches_cpu() -> None:
    from torch import nn

    from torchgpipe import GPipe

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    n = torch.cuda.device_count()
    devices = [torch.device("cuda", j % n) for j in range(3)]
    import copy as copy_module

    model = GPipe(copy_module.deepcopy(plain), [2, 2, 1], devices=devices, chunks=4)
    x = torch.randn(10, 8)
    out = model(x.to(devices[0]))
    assert out.device == devices[-1]
    expected = plain(x)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
