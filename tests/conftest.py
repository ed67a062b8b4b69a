import pytest
import torch


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
