import torch
from torch import Tensor

from torchgpipe.dependency import fork, join


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor, log: list[str], name: str) -> Tensor:
        ctx.log, ctx.name = log, name  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.log.append(ctx.name)  # type: ignore[attr-defined]
        return grad, None, None


def _logged(x: Tensor, log: list[str], name: str) -> Tensor:
    return _Log.apply(x, log, name)  # type: ignore[no-any-return]


def test_fork_join_orders_backward() -> None:
    # The edge from a's fork into b's join makes a's backward wait for b's. (Across
    # threads, where sequence numbers say nothing, test_checkpoint shows the pipeline's
    # order; here both are recorded on one thread.)
    log: list[str] = []
    x = torch.ones(2, requires_grad=True)
    a, phony = fork(_logged(x, log, "a"))
    b = _logged(join(torch.ones(2, requires_grad=True), phony), log, "b")
    (a.sum() + b.sum()).backward()
    assert log == ["b", "a"]
    assert x.grad is not None
    assert torch.equal(x.grad, torch.ones(2))


def test_fork_without_grad_has_no_phony() -> None:
    value, phony = fork((torch.ones(2), 3))
    assert phony is None
    assert value[1] == 3
    assert join(value, None) is value


def test_fork_join_pick_the_first_float_leaf() -> None:
    ids = torch.arange(3)
    x = torch.ones(3, requires_grad=True)
    value, phony = fork({"ids": ids, "x": x})
    assert phony is not None
    assert value["ids"] is ids
    assert value["x"] is not x
    h = torch.zeros(3, requires_grad=True)
    joined = join({"ids": ids, "h": h}, phony)
    assert joined["h"] is not h
    assert joined["h"].requires_grad
    assert joined["ids"] is ids


def test_the_edge_rides_the_first_leaf_that_wants_a_gradient() -> None:
    # (mask, x): the mask wants no gradient, x does: the edge is x's, and the mask is
    # left wanting none.
    mask, x = torch.ones(3), torch.ones(3, requires_grad=True)
    value, phony = fork((mask, x))
    assert phony is not None
    assert value[0] is mask
    _, phony = fork(torch.ones(1, requires_grad=True))
    joined = join((mask, x), phony)
    assert joined[0] is mask
    assert not joined[0].requires_grad
    assert joined[1] is not x
    assert joined[1].grad_fn is not None


def test_join_leaves_an_input_that_wants_no_gradient_as_it_is() -> None:
    # Joining would make it want one, where the plain model's input does not.
    _, phony = fork(torch.ones(1, requires_grad=True))
    value = {"h": torch.zeros(3)}
    assert join(value, phony) is value


def test_join_without_float_leaf_is_a_no_op() -> None:
    _, phony = fork(torch.ones(1, requires_grad=True))
    value = (torch.arange(2),)
    assert join(value, phony) is value


def test_fork_output_may_be_modified_in_place() -> None:
    a, _ = fork(torch.ones(2, requires_grad=True) * 2)
    torch.relu_(a)
    a.sum().backward()
