import pytest
import torch

# torch imports this (and sympy) at a process's first backward given gradients, which
# the pipelines' backward is: seconds on a loaded machine, inside the tests' bounded
# waits (a transport's receive of 2 s, say). Paid here, at collection.
import torch.fx.experimental.symbolic_shapes  # isort: skip


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default run tests the CPU path on any machine: where a GPU is present, GPipe's
    # default devices would otherwise be the GPUs (one device for four partitions, say),
    # and the tests that leave `devices` out mean CPU partitions.
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def engine_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model(x)`` builds one graph and leaves its backward to the engine, as on GPUs.

    On CPU partitions the workers run the backward (``pipeline.py``); this runs the way
    GPU partitions take on the CPU, so that the tests cover it on any machine.
    """
    from torchgpipe import pipeline

    monkeypatch.setattr(pipeline, "workers_run_backward", lambda devices: False)


@pytest.fixture(params=["workers", "engine"])
def backward_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways ``model(x)``'s backward can run: on the workers (CPU), in the engine."""
    if request.param == "engine":
        from torchgpipe import pipeline

        monkeypatch.setattr(pipeline, "workers_run_backward", lambda devices: False)
    return str(request.param)
