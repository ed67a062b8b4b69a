"""Weights tied across partitions: a copy per partition, equal gradients, equal updates."""

from __future__ import annotations

import contextlib
import copy
import io
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
from distributed_helpers import lose_in_tie_sum, run_threads
from nccl_rules import NCCLRules
from test_nccl_transport import SCHEDULES
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, Schedule1F1B, ScheduleZeroBubble
from torchgpipe.distributed import PipelineStage, RemoteError, Transport
from torchgpipe.tied import loaded_value, tied_state_dict

VOCAB, WIDTH = 11, 6


class Mean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def _language_model() -> nn.Sequential:
    """Embedding, a body, and an output head tied to the embedding."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, Mean(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), head)


def _data(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (8, 5), generator=generator)
    return ids, torch.randint(0, VOCAB, (8,), generator=generator)


def test_each_partition_gets_a_copy_equal_to_the_owner() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    owner, copy_ = pipe[0].weight, pipe[4].weight
    assert owner is not copy_
    torch.testing.assert_close(owner, copy_, rtol=0, atol=0)
    # Both names, as the plain model's state dict has them.
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert sum(p is owner or p is copy_ for p in pipe.parameters()) == 2


class _Marked(nn.Parameter):
    """A parameter subclass (as quantized or mixed-precision libraries make)."""


def test_copies_keep_the_weights_class_and_attributes() -> None:
    # Optimizer groups are often built from attributes (p._no_weight_decay): a copy
    # without them would get weight decay while its owner does not, and drift apart.
    def marked() -> nn.Sequential:  # not deepcopy: a parameter's copy drops its attributes
        model = _language_model()
        model[0].weight = _Marked(model[0].weight.detach().clone())
        model[0].weight._no_weight_decay = True  # type: ignore[attr-defined]  # a user's mark
        model[4].weight = model[0].weight
        return model

    plain, pipe = marked(), GPipe(marked(), [2, 3], chunks=4)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        marked = [p for p in model.parameters() if getattr(p, "_no_weight_decay", False)]
        rest = [p for p in model.parameters() if not getattr(p, "_no_weight_decay", False)]
        groups = [{"params": rest, "weight_decay": 0.1}, {"params": marked, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2)

    assert type(pipe[4].weight) is _Marked
    assert getattr(pipe[4].weight, "_no_weight_decay", False)
    optimizers = optimizer(plain), optimizer(pipe)
    for seed in range(3):
        ids, target = _data(seed)
        for model, opt in zip((plain, pipe), optimizers, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(ids), target).backward()
            opt.step()
    torch.testing.assert_close(pipe[4].weight, pipe[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(pipe[0].weight, plain[0].weight)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_every_copy_holds_the_sum_of_the_gradients_of_all_uses(checkpoint: str) -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    ids, target = _data(1)
    for _ in range(2):  # a second backward accumulates, as the plain model's does
        F.cross_entropy(pipe(ids), target).backward()
        F.cross_entropy(plain(ids), target).backward()
        expected = plain[0].weight.grad
        assert expected is not None
        torch.testing.assert_close(pipe[0].weight.grad, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(pipe[4].weight.grad, pipe[0].weight.grad)


def _close_to_plain(pipe: GPipe, plain: nn.Sequential) -> None:
    expected = plain[0].weight.grad
    assert expected is not None
    torch.testing.assert_close(pipe[0].weight.grad, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(pipe[4].weight.grad, pipe[0].weight.grad)


def test_a_forward_of_another_thread_during_a_backward_keeps_the_tied_sum() -> None:
    # Regression: a forward began by forgetting the shares the copies had noted, those
    # of a backward under way in another thread included (an evaluation thread beside
    # the training one): that backward's sum missed them, silently.
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ids, target = _data(1)

    def evaluate() -> None:
        with torch.no_grad():
            pipe(ids)

    def forward_elsewhere(grad: Tensor) -> None:  # mid-backward: shares noted, not summed
        thread = threading.Thread(target=evaluate)
        thread.start()
        thread.join()

    pipe[0].weight.register_hook(forward_elsewhere)
    F.cross_entropy(pipe(ids), target).backward()
    F.cross_entropy(plain(ids), target).backward()
    _close_to_plain(pipe, plain)


def test_a_share_no_backward_through_the_pipeline_summed_is_forgotten_at_the_next_forward() -> None:
    # A backward that reaches a copy alone (a regularizer of the head's weight) notes a
    # share that no sum takes: after zero_grad(), the next backward's sum added it.
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ids, target = _data(1)
    pipe[4].weight.square().sum().backward()
    pipe.zero_grad()
    F.cross_entropy(pipe(ids), target).backward()
    F.cross_entropy(plain(ids), target).backward()
    _close_to_plain(pipe, plain)


def test_two_threads_training_one_model_with_tied_weights_sum_both(backward_by: str) -> None:
    # Two threads each ran a forward and a backward: one's sum rewrote the .grad that
    # the other's stages were filling (or had set aside), counting one thread's
    # gradient twice and losing the other's share, in about half the runs.
    for _ in range(4):
        plain = _language_model()
        pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
        both = threading.Barrier(2)
        failures: list[BaseException] = []

        def train(
            seed: int,
            pipe: GPipe = pipe,
            both: threading.Barrier = both,
            failures: list[BaseException] = failures,
        ) -> None:
            try:
                ids, target = _data(seed)
                output = pipe(ids)
                both.wait(timeout=20)  # both forwards done: the backwards overlap
                F.cross_entropy(output, target).backward()
            except BaseException as error:
                failures.append(error)

        threads = [threading.Thread(target=train, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not failures, failures
        for seed in (1, 2):
            ids, target = _data(seed)
            F.cross_entropy(plain(ids), target).backward()
        _close_to_plain(pipe, plain)
        torch.testing.assert_close(pipe[2].weight.grad, plain[2].weight.grad)


def test_the_tied_sum_at_a_backwards_end_waits_on_no_hold(engine_backward: None) -> None:
    # On a GPU the engine's device thread runs the sum at a backward's end: had it waited
    # for the pipelines' hold, a thread holding it while it waits for that backward (a
    # step whose input comes from this model) would never be let go. Here another
    # thread holds it all along, and the backward (the engine's way) ends all the same.
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ids, target = _data(1)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with pipe.workers.exclusive():
            held.set()
            done.wait(timeout=30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(timeout=10)
        backward = threading.Thread(
            target=lambda: F.cross_entropy(pipe(ids), target).backward(), daemon=True
        )
        backward.start()
        backward.join(timeout=20)
        assert not backward.is_alive(), "the backward waited for the hold"
    finally:
        done.set()
        holder.join(timeout=10)
    F.cross_entropy(plain(ids), target).backward()
    _close_to_plain(pipe, plain)


class _FailsOnThree(torch.autograd.Function):
    """Identity; its backward of a batch of 3 says it began, waits for ``go``, and fails."""

    began = threading.Event()
    go = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.fail = x.shape[0] == 3
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if ctx.fail:
            _FailsOnThree.began.set()
            assert _FailsOnThree.go.wait(timeout=20)
            raise RuntimeError("the second backward fails")
        return grad


class _FailsOnThreeLayer(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _FailsOnThree.apply(x)  # type: ignore[no-any-return,no-untyped-call]


def test_a_backward_that_ended_well_is_summed_when_the_last_one_under_way_fails(
    engine_backward: None,
) -> None:
    # Of two backwards under way, the first to end left the sum to the last, which
    # failed and dropped every share: the first one's sum was lost (copies unequal).
    _FailsOnThree.began.clear()
    _FailsOnThree.go.clear()
    plain = _language_model()
    pipe = GPipe(nn.Sequential(*copy.deepcopy(plain), _FailsOnThreeLayer()), [2, 4], chunks=2)
    (ids, target), (other, wrong) = _data(1), _data(2)
    failed: list[BaseException] = []

    def second() -> None:  # under way first, fails last
        try:
            F.cross_entropy(pipe(other[:6]), wrong[:6]).backward()
        except RuntimeError as error:
            failed.append(error)

    output = pipe(ids)
    thread = threading.Thread(target=second)
    thread.start()
    assert _FailsOnThree.began.wait(timeout=20)
    F.cross_entropy(output, target).backward()  # ends well while the other is under way
    _FailsOnThree.go.set()
    thread.join(timeout=30)
    assert len(failed) == 1
    F.cross_entropy(plain(ids), target).backward()
    _close_to_plain(pipe, plain)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_a_gpipe_with_tied_weights_nested_in_a_partition_sums_them(
    checkpoint: str, backward_by: str
) -> None:
    # The outer GPipe's node set the inner copies' gradients aside and handed them on
    # after the inner GPipe had summed its ties (at the end of the partition's
    # backward): the head copy's share came too late, and was dropped (CPU partitions).
    def tied() -> nn.Sequential:
        first, last = nn.Linear(4, 4), nn.Linear(4, 4)
        last.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last)

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), tied(), nn.Linear(4, 4))
    layers = copy.deepcopy(plain)
    inner = GPipe(layers[1], [2, 3], chunks=2)
    wrapped = nn.Sequential(layers[0], inner, layers[2])
    outer = GPipe(wrapped, [2, 1], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(4, 4)
    outer(x).square().sum().backward()
    plain(x).square().sum().backward()
    expected = plain[1][0].weight.grad
    assert expected is not None
    for copy_ in (inner[0].weight, inner[4].weight):
        torch.testing.assert_close(copy_.grad, expected)


@pytest.mark.parametrize("by", ["model(x)", "step"])
def test_a_failed_backward_leaves_no_share_to_the_next_sum(by: str) -> None:
    # The copies' shares of a backward that failed (after the head's copy noted its
    # share) are dropped: a backward after zero_grad() sums its own only.
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ids, target = _data(1)

    def fail(*_: Any) -> None:
        raise RuntimeError("a failing hook")

    def backward() -> None:
        if by == "step":
            Schedule1F1B(pipe, F.cross_entropy).step(ids, target)
        else:
            F.cross_entropy(pipe(ids), target).backward()

    # Once the head's copy noted its share: in a step, partition 0's layer, whose
    # backward comes after the head's; in model(x)'s backward, the engine's hooks.
    if by == "step":
        handle = pipe[1].register_full_backward_hook(fail)
    else:
        handle = pipe[0].weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="a failing hook"):
        backward()
    handle.remove()
    pipe.zero_grad()
    backward()
    F.cross_entropy(plain(ids), target).backward()
    _close_to_plain(pipe, plain)


@pytest.mark.parametrize("schedule", [None, Schedule1F1B, ScheduleZeroBubble])
def test_copies_stay_equal_over_fifty_adam_steps(schedule: type | None) -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ours = torch.optim.Adam(pipe.parameters(), lr=0.01)
    theirs = torch.optim.Adam(plain.parameters(), lr=0.01)
    stepper = schedule(pipe, F.cross_entropy) if schedule is not None else None
    for k in range(50):
        ids, target = _data(100 + k)
        ours.zero_grad()
        theirs.zero_grad()
        if stepper is None:
            F.cross_entropy(pipe(ids), target).backward()
        else:
            stepper.step(ids, target)
        F.cross_entropy(plain(ids), target).backward()
        ours.step()
        theirs.step()
        assert torch.equal(pipe[0].weight, pipe[4].weight), f"copies differ after step {k}"
    torch.testing.assert_close(pipe[0].weight, plain[0].weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pipe[2].weight, plain[2].weight, rtol=1e-4, atol=1e-5)


def test_copies_in_optimizer_groups_of_different_settings_are_refused_saying_so() -> None:
    # minGPT's groups: no weight decay for embeddings, decay for linear layers; the
    # embedding's copy and the head's land in different groups, every copy held.
    pipe = GPipe(_language_model(), [2, 3], chunks=4)
    embeddings = [p for m in pipe.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    rest = [p for p in pipe.parameters() if all(p is not e for e in embeddings)]
    groups = [{"params": embeddings, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.1}]
    optimizer = torch.optim.AdamW(groups, lr=0.01)
    F.cross_entropy(pipe(_data(1)[0]), _data(1)[1]).backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"groups of different settings .* every copy of a"):
        pipe(_data(2)[0])


@pytest.mark.parametrize("schedule", [None, Schedule1F1B])
def test_copies_an_optimizer_made_before_the_pipeline_changed_unequally_are_refused(
    schedule: type | None,
) -> None:
    # The optimizer holds the weight once: it stepped the first copy alone, and the
    # copies drifted apart, silently, step after step.
    model = _language_model()
    early = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe = GPipe(model, [2, 3], chunks=4)
    stepper = schedule(pipe, F.cross_entropy) if schedule is not None else None

    def train(ids: Tensor, target: Tensor) -> None:
        if stepper is None:
            F.cross_entropy(pipe(ids), target).backward()
        else:
            stepper.step(ids, target)

    train(*_data(1))
    early.step()
    with pytest.raises(RuntimeError, match=r"tied weight 0\.weight / 4\.weight .* \[1, 0\]"):
        train(*_data(2))
    with pytest.raises(RuntimeError, match="one made before the model was wrapped"):
        train(*_data(2))  # until they are equal again
    with torch.no_grad():  # an evaluation is not refused: it may run beside a step
        pipe(_data(2)[0])
        if stepper is not None:  # a step trains under no_grad too: refused there as well
            with pytest.raises(RuntimeError, match="one made before the model was wrapped"):
                train(*_data(2))
    pipe.load_state_dict(pipe.state_dict())  # the first copy's value under both names
    train(*_data(2))
    torch.testing.assert_close(pipe[0].weight, pipe[4].weight, rtol=0, atol=0)
    # Changed alike, by an optimizer of the pipeline's or by hand, they run on.
    later = torch.optim.Adam(pipe.parameters(), lr=0.01, weight_decay=0.1)
    for k in range(3):
        later.step()
        train(*_data(3 + k))
    with torch.no_grad():
        for p in (pipe[0].weight, pipe[4].weight):
            p.mul_(0.5)
    train(*_data(6))
    with torch.no_grad():  # counted unequally, but equal: nothing drifted
        pipe[4].weight.mul_(1.0)
    train(*_data(7))


def test_freezing_either_name_freezes_the_tied_weight() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=2)
    pipe[4].weight.requires_grad_(False)  # the head's name, as plain[4].weight would be
    ids, target = _data(3)
    F.cross_entropy(pipe(ids), target).backward()
    assert not pipe[0].weight.requires_grad
    assert pipe[0].weight.grad is None
    assert pipe[4].weight.grad is None
    assert pipe[2].weight.grad is not None


def test_unfreezing_either_name_unfreezes_the_tied_weight() -> None:
    pipe = GPipe(_language_model(), [2, 3], chunks=2)
    pipe[4].weight.requires_grad_(False)
    ids, target = _data(3)
    pipe(ids)
    pipe[0].weight.requires_grad_(True)  # after a warm-up, say
    F.cross_entropy(pipe(ids), target).backward()
    assert pipe[4].weight.requires_grad
    assert pipe[0].weight.grad is not None
    assert torch.equal(pipe[0].weight.grad, pipe[4].weight.grad)


@pytest.fixture
def swap_on_conversion() -> Iterator[None]:
    """Dtype changes swap each parameter's tensor underneath (``torch.utils.swap_tensors``).

    The flag is process-wide: put back whatever the test does.
    """
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _grads_by_name(module: nn.Module) -> dict[str, Tensor | None]:
    return {n: p.grad for n, p in module.named_parameters(remove_duplicate=False)}


@pytest.mark.usefixtures("swap_on_conversion")
@pytest.mark.parametrize("schedule", [None, Schedule1F1B])
@pytest.mark.parametrize("dtype", ["float", "double"])
def test_a_dtype_change_that_swaps_the_tensors_keeps_summing_the_copies(
    dtype: str, schedule: type | None
) -> None:
    # Regression: a swap keeps the parameter's identity, so the ties kept their hook on
    # the head's copy, which no longer fired: its share of the gradient was dropped
    # silently, even by a .float() that changed nothing.
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    head = pipe[4].weight
    getattr(pipe, dtype)()
    getattr(plain, dtype)()
    assert pipe[4].weight is head  # swapped in place, not replaced
    ids, target = _data(2)
    for _ in range(2):  # and the next backward accumulates
        if schedule is None:
            F.cross_entropy(pipe(ids), target).backward()
        else:
            schedule(pipe, F.cross_entropy).step(ids, target)
        F.cross_entropy(plain(ids), target).backward()
        ours = _grads_by_name(pipe)
        for name, grad in _grads_by_name(plain).items():
            torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("rehook", ["swap", "requires_grad"])
def test_the_ties_hook_stays_ahead_of_a_users_when_hooked_anew(rehook: str) -> None:
    # Regression: hooking the copies anew (after a swapping dtype change, or a weight
    # frozen and unfrozen) put the ties' own hook after a user's registered before, so
    # what the user's returned went into the copies' sum (the README: it does not).
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(rehook == "swap")
    try:
        pipe = GPipe(_language_model(), [2, 3], chunks=2)
        ids, _ = _data(4)
        pipe(ids)
        for p in pipe.parameters():
            p.register_hook(lambda g: g)
        if rehook == "swap":
            pipe.float()
        else:
            pipe[0].weight.requires_grad_(False)
            pipe(ids)
            pipe[0].weight.requires_grad_(True)
        pipe(ids)  # hooked anew
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    kinds = [[type(h).__name__ for h in p._backward_hooks.values()] for p in pipe.parameters()]
    assert ["Record", "function"] in kinds, kinds
    assert all("Record" not in hooks[1:] for hooks in kinds), kinds


@pytest.mark.usefixtures("swap_on_conversion")
def test_a_tied_weight_swapped_while_frozen_is_summed_once_unfrozen() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=2)
    pipe[0].weight.requires_grad_(False)
    ids, target = _data(3)
    pipe(ids)  # the copies unhooked
    pipe.double()
    plain.double()
    pipe[0].weight.requires_grad_(True)
    F.cross_entropy(pipe(ids), target).backward()
    F.cross_entropy(plain(ids), target).backward()
    torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(pipe[4].weight.grad, plain[0].weight.grad)


@pytest.mark.usefixtures("swap_on_conversion")
def test_processes_keep_summing_a_tie_after_a_dtype_change_that_swaps_the_tensors() -> None:
    # A PipelineStage's ties hook the owner's copy too (its share goes to the others).
    models = [_language_model() for _ in range(2)]
    ids, target = _data(4)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        stage.double()
        Schedule1F1B(stage, F.cross_entropy).step(
            ids if stage.is_first else None, target if stage.is_last else None
        )
        return _grads_by_name(stage)

    results = run_threads(rank, 2, timeout=30.0)
    plain = _language_model().double()
    F.cross_entropy(plain(ids), target).backward()
    for value in results:
        assert not isinstance(value, BaseException), value
    ours = {**results[0], **results[1]}
    for name, grad in _grads_by_name(plain).items():
        torch.testing.assert_close(ours[name], grad, msg=name)


def test_loading_one_name_of_a_tied_weight_sets_every_copy() -> None:
    pipe = GPipe(_language_model(), [2, 3], chunks=2)
    state = {k: v + 1 for k, v in _language_model().state_dict().items() if k != "4.weight"}
    pipe.load_state_dict(state)  # filled from the other name: nothing missing
    assert torch.equal(pipe[4].weight, state["0.weight"])
    assert torch.equal(pipe[0].weight, state["0.weight"])
    # Inside another module (a prefix), and with two different values: the last wins,
    # as loading both names into the plain model's one tensor does.
    outer = nn.ModuleDict({"pipe": GPipe(_language_model(), [2, 3], chunks=2)})
    state = {f"pipe.{k}": v + 1 for k, v in _language_model().state_dict().items()}
    state["pipe.4.weight"] = state["pipe.4.weight"] + 1
    outer.load_state_dict(state)
    assert torch.equal(outer["pipe"][0].weight, state["pipe.4.weight"])
    assert torch.equal(outer["pipe"][4].weight, state["pipe.4.weight"])


@pytest.mark.parametrize("name", ["0.weight", "4.weight"])
@pytest.mark.parametrize("bad", ["shape", "not a tensor"])
def test_a_wrong_value_under_either_name_of_a_tied_weight_is_refused_as_the_plain_model_does(
    name: str, bad: str
) -> None:
    # The value of the last name was written under every name first: a wrong value
    # under an earlier one was dropped, silently, and one under the last was blamed on
    # the first.
    state: dict[str, Any] = dict(_language_model().state_dict())
    state[name] = torch.zeros(3, 3) if bad == "shape" else "not a tensor"
    said = "size mismatch for" if bad == "shape" else "While copying the parameter named"
    for model in (_language_model(), GPipe(_language_model(), [2, 3], chunks=2)):
        for strict in (True, False):
            with pytest.raises(RuntimeError, match=f'{said} "?{name}'):
                model.load_state_dict(state, strict=strict)
    with torch.device("meta"):
        meta = _language_model()
    said = (
        f"{name} has shape \\(3, 3\\) in the state dict"
        if bad == "shape"
        else f"holds {name} \\(str"
    )
    with pytest.raises(ValueError if bad == "shape" else TypeError, match=said):
        GPipe(meta, [2, 3], devices=["cpu", "cpu"], state_dict=state)


@pytest.mark.parametrize("drop", [None, "0.weight", "4.weight"])
def test_tied_state_dict_gives_each_name_what_the_plain_model_loads(drop: str | None) -> None:
    # One rule for load_state_dict and a meta model's state_dict=: the last name present.
    plain = _language_model()
    state = {**plain.state_dict(), "4.weight": torch.full((VOCAB, WIDTH), 7.0)}
    state.pop(drop or "", None)
    tied = tied_state_dict(plain, state)
    assert tied is not None
    assert tied_state_dict(plain, None) is None
    plain.load_state_dict(state, strict=False)
    for name in ("0.weight", "4.weight"):
        assert tied[name] is loaded_value(state, ["0.weight", "4.weight"])
        torch.testing.assert_close(tied[name], plain.state_dict()[name], rtol=0, atol=0)
    assert "0.weight" in state or drop == "0.weight"  # the caller's dict is left as it was


def test_assigning_a_state_dict_keeps_one_tensor_per_copy() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=2)
    pipe.load_state_dict(plain.state_dict(), assign=True)
    assert pipe[0].weight.data_ptr() != pipe[4].weight.data_ptr()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ids, target = _data(6)
    F.cross_entropy(pipe(ids), target).backward()
    F.cross_entropy(plain(ids), target).backward()
    optimizer.step()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    torch.testing.assert_close(pipe[4].weight, plain[0].weight, rtol=1e-5, atol=1e-6)
    assert torch.equal(pipe[0].weight, pipe[4].weight)


def test_assigning_a_state_dict_keeps_a_weight_used_twice_in_a_partition_one_parameter() -> None:
    # torch wraps a plain tensor in a parameter once per name under assign=True: the two
    # layers of partition 1 got parameters of their own, the second never summed. (The
    # plain model itself comes out of it with one parameter per name over one storage,
    # which Adam updates twice: the reference is the tied model, loaded without assign.)
    def tied_three() -> nn.Sequential:
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4) for _ in range(3)]
        layers[1].weight = layers[2].weight = layers[0].weight
        return nn.Sequential(*layers)

    plain = tied_three()
    pipe = GPipe(tied_three(), [1, 2], chunks=2)
    # Copies: assign=True would put the plain model's own biases in the pipeline.
    pipe.load_state_dict({k: v.clone() for k, v in plain.state_dict().items()}, assign=True)
    assert pipe[1].weight is pipe[2].weight
    assert pipe[0].weight is not pipe[1].weight
    x = torch.randn(4, 4)
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (pipe, plain)]
    for _ in range(3):
        for model, optimizer in zip((pipe, plain), optimizers, strict=True):
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_one_micro_batch_output_may_be_changed_in_place() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=1)
    ids, target = _data(4)
    output = pipe(ids)
    output.mul_(2)
    F.cross_entropy(output, target).backward()
    expected = plain(ids)
    F.cross_entropy(expected * 2, target).backward()
    torch.testing.assert_close(pipe[4].weight.grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_a_meta_model_fills_the_copies_from_the_owner() -> None:
    with torch.device("meta"):
        model = _language_model()
    pipe = GPipe(model, [2, 3])
    assert not pipe[0].weight.is_meta
    torch.testing.assert_close(pipe[4].weight, pipe[0].weight, rtol=0, atol=0)


def test_a_module_in_two_partitions_is_refused() -> None:
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Linear module is part of layers in partitions 0 and 1"):
        GPipe(nn.Sequential(nn.Sequential(shared), nn.Sequential(shared)), [1, 1])


# A buffer that layers of two partitions hold: a copy each, equal to the owner's once
# built, and not kept equal afterwards (a change to one copy stays in it).


class _Shift(nn.Module):
    def __init__(self, shift: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("shift", torch.arange(4.0) if shift is None else shift)

    def forward(self, x: Tensor) -> Tensor:
        return x + (0.0 if self.shift is None else self.shift)


def _shifts() -> nn.Sequential:
    first = _Shift()
    return nn.Sequential(first, nn.Linear(4, 4), _Shift(first.shift))


def test_a_shared_buffer_is_copied_once_equal_to_its_owner() -> None:
    torch.manual_seed(0)
    plain, x = _shifts(), torch.randn(3, 4)
    pipe = GPipe(copy.deepcopy(plain), [2, 1], chunks=3)
    assert pipe[0].shift is not pipe[2].shift
    torch.testing.assert_close(pipe[2].shift, plain[0].shift, rtol=0, atol=0)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    torch.testing.assert_close(pipe(x), plain(x))


def test_a_shared_buffer_of_a_model_made_in_inference_mode_builds() -> None:
    # Reading each copy's version counter at build failed: inference tensors have none.
    with torch.inference_mode():
        layers = _shifts()
    pipe = GPipe(layers, [2, 1], chunks=2)
    with torch.inference_mode():
        assert pipe(torch.zeros(2, 4)).shape == (2, 4)


@pytest.mark.parametrize("how", ["deepcopy", "save", "double"])
def test_a_change_to_one_copy_of_a_shared_buffer_stays_in_it(how: str) -> None:
    # A change to a later copy was undone by the owner's at the next run once the
    # tensors' ids changed (a copy, a load, a dtype): now no copy is watched at all.
    pipe = GPipe(_shifts(), [2, 1])
    if how == "deepcopy":
        pipe = copy.deepcopy(pipe)
    elif how == "save":
        saved = io.BytesIO()
        torch.save(pipe, saved)
        saved.seek(0)
        pipe = torch.load(saved, weights_only=False)
    else:
        pipe = pipe.double()
    with torch.no_grad():
        pipe[2].shift.fill_(2.0)
    pipe(torch.zeros(2, 4, dtype=pipe[2].shift.dtype))
    torch.testing.assert_close(pipe[2].shift, torch.full((4,), 2.0, dtype=pipe[2].shift.dtype))
    torch.testing.assert_close(pipe[0].shift, torch.arange(4.0, dtype=pipe[0].shift.dtype))


def test_assigning_one_layers_shared_buffer_leaves_the_others_as_the_plain_model_does() -> None:
    # The new tensor was written into the other copy; None crashed the next run.
    torch.manual_seed(0)
    plain, x = _shifts(), torch.randn(3, 4)
    pipe = GPipe(copy.deepcopy(plain), [2, 1])
    pipe[0].shift = torch.full((4,), 5.0)
    plain[0].shift = torch.full((4,), 5.0)
    torch.testing.assert_close(pipe(x), plain(x))
    torch.testing.assert_close(pipe[2].shift, torch.arange(4.0), rtol=0, atol=0)
    pipe[2].shift = None
    plain[2].shift = None
    torch.testing.assert_close(pipe(x), plain(x))


class _Table(nn.Module):
    """Rebuilds a cached table by assignment when an input is longer than it."""

    def __init__(self, table: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(2.0) if table is None else table)

    def forward(self, x: Tensor) -> Tensor:
        if self.table.numel() < x.size(0):
            self.table = torch.arange(float(x.size(0)))
        return x + self.table[: x.size(0), None]


class _Counts(nn.Module):
    """Counts its calls in a buffer: a forward that changes it in place."""

    def __init__(self, count: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()) if count is None else count)

    def forward(self, x: Tensor) -> Tensor:
        self.count.add_(1)
        return x


def _sum(output: Tensor, target: Tensor) -> Tensor:
    return output.sum()


@pytest.mark.parametrize("schedule", [None, Schedule1F1B])
def test_a_forward_that_changes_a_buffer_two_partitions_hold_changes_its_own_copy(
    schedule: type | None,
) -> None:
    # Such a forward was refused, a cache rebuilt by assignment included.
    first = _Counts()
    pipe = GPipe(nn.Sequential(first, nn.Linear(2, 2), _Counts(first.count)), [2, 1])
    x = torch.randn(4, 2)
    run = pipe if schedule is None else partial(schedule(pipe, _sum).step, target=x)
    run(x)
    assert pipe[0].count is not pipe[2].count  # each partition counts in its own copy
    first = _Table()
    plain = nn.Sequential(first, nn.Tanh(), _Table(first.table))
    pipe = GPipe(copy.deepcopy(plain), [2, 1])
    x = torch.randn(3, 4)
    torch.testing.assert_close(pipe(x), plain(x))


def test_running_statistics_that_two_partitions_hold_give_the_plain_models_eval_outputs() -> None:
    # Refused up front, even in eval mode, where the statistics do not change.
    torch.manual_seed(0)
    first, second = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    with torch.no_grad():
        first.running_mean.uniform_()
    second.running_mean = first.running_mean
    plain, x = nn.Sequential(first, nn.Tanh(), second).eval(), torch.randn(6, 4)
    pipe = GPipe(copy.deepcopy(plain), [2, 1], chunks=2).eval()
    torch.testing.assert_close(pipe(x), plain(x))


# Across processes: the copies' gradients summed over the ranks that hold them.


def _across(
    world: int, schedule: str, balance: list[int], steps: int, *, meta: bool = False
) -> tuple[list[Any], NCCLRules]:
    """``steps`` Adam steps of ``schedule`` on ``world`` ranks, under NCCL's rules.

    Each rank returns its state dict after the steps and its gradients of the first.
    """
    rules = NCCLRules(world)
    with torch.device("meta") if meta else contextlib.nullcontext():
        models = [_language_model() for _ in range(world)]  # before the threads: the RNG

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], balance, transport=transport, chunks=4)
        driver = SCHEDULES[schedule](stage, F.cross_entropy)
        parameters = list(stage.parameters())  # none on the rank of Mean
        optimizer = torch.optim.Adam(parameters, lr=0.01) if parameters else None
        first: dict[str, Tensor] = {}
        for k in range(steps):
            ids, target = _data(100 + k)
            stage.zero_grad()
            driver.step(ids if stage.is_first else None, target if stage.is_last else None)
            if k == 0:
                first = {
                    n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None
                }
            if optimizer is not None:
                optimizer.step()
        return stage.state_dict(), first

    return run_threads(rank, world, timeout=60.0, observe=rules.group), rules


def _trained(steps: int) -> tuple[nn.Sequential, dict[str, Tensor]]:
    """The plain model after ``steps`` Adam steps, and its gradients of the first."""
    plain = _language_model()
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    first: dict[str, Tensor] = {}
    for k in range(steps):
        ids, target = _data(100 + k)
        optimizer.zero_grad()
        F.cross_entropy(plain(ids), target).backward()
        if k == 0:
            first = {n: p.grad.clone() for n, p in plain.named_parameters(remove_duplicate=False)}
        optimizer.step()
    return plain, first


@pytest.mark.parametrize(
    ("world", "schedule", "balance"),
    [
        (2, "1f1b", [2, 3]),
        (4, "gpipe", [1, 1, 1, 2]),  # ranks 1 and 2 hold no copy
        (2, "interleaved", [1, 1, 1, 2]),  # stage 0 on rank 0, stage 3 on rank 1
        (2, "zero-bubble", [2, 3]),
    ],
)
def test_processes_keep_tied_copies_equal_over_fifty_adam_steps(
    world: int, schedule: str, balance: list[int]
) -> None:
    results, rules = _across(world, schedule, balance, 50)
    rules.check()
    for value in results:
        assert not isinstance(value, BaseException), value
    plain, first = _trained(50)
    grads: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    for part, its in results:
        grads.update(its)
        state.update(part)
    assert grads.keys() == first.keys()
    for name, grad in first.items():  # both names of the tied weight: the sum
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(results[0][0]["0.weight"], results[-1][0]["4.weight"])
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _crossed() -> nn.Sequential:
    """Two ties whose first uses come in opposite orders on the two ranks."""
    torch.manual_seed(0)
    a, b, c, d = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
    c.weight = b.weight  # stages 1 and 2: rank 1 meets it first
    d.weight = a.weight  # stages 0 and 3: rank 0 meets it first
    return nn.Sequential(a, nn.Sequential(b, nn.Tanh()), nn.Sequential(c, nn.Tanh()), d)


def test_several_ties_travel_in_one_order_on_every_rank() -> None:
    rules = NCCLRules(2)
    models = [_crossed() for _ in range(2)]
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [1, 1, 1, 1], transport=transport, chunks=4)
        SCHEDULES["interleaved"](stage, F.mse_loss).step(
            x if stage.is_first else None, y if stage.is_last else None
        )
        return {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    rules.check()
    plain = _crossed()
    F.mse_loss(plain(x), y).backward()
    expected = {n: p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
    for grads in results:
        assert not isinstance(grads, BaseException), grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_output_that_cannot_gather_fails_every_rank_before_the_tie_reduces() -> None:
    class Aux(nn.Module):  # a number per micro-batch, which the last rank cannot gather
        def __init__(self, head: nn.Module) -> None:
            super().__init__()
            self.head = head

        def forward(self, x: Tensor) -> tuple[Tensor, float]:
            out = self.head(x)
            return out, float(out.detach().mean())

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        a, d = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        d.weight = a.weight
        models.append(nn.Sequential(a, Aux(d)))
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [1, 1], transport=transport, chunks=4)
        loss = lambda out, t: F.mse_loss(out[0], t) + out[1]  # noqa: E731
        return Schedule1F1B(stage, loss).step(
            x if stage.is_first else None, y if stage.is_last else None
        )

    first, last = run_threads(rank, 2, timeout=20.0)
    # The last rank gathers the output before the ranks agree on how the step ended:
    # the step fails on every rank, and no rank goes on to reduce the tie alone.
    assert isinstance(first, RemoteError)
    assert "rank 1 (stages [1]) raised ValueError" in str(first)
    assert isinstance(last, ValueError)
    assert "in micro-batch 0 but" in str(last)


def _one_step_grads(models: list[nn.Sequential]) -> list[Any]:
    """One 1F1B step of ``models`` on 2 ranks (balance [2, 3]); each rank's gradients."""
    ids, target = _data(5)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        Schedule1F1B(stage, F.cross_entropy).step(
            ids if stage.is_first else None, target if stage.is_last else None
        )
        return {n: p.grad for n, p in stage.named_parameters()}

    return run_threads(rank, 2, timeout=20.0)


def test_a_failed_step_across_processes_leaves_no_share_to_the_next_sum() -> None:
    # The last rank's copy of the head noted its share of micro-batch 0, then rank 0
    # failed in its backward: the share stayed, and the next step's sum (after
    # zero_grad) added it to every copy (wrong by 0.07).
    models = [_language_model() for _ in range(2)]
    plain = _language_model()
    ids, target = _data(7)
    F.cross_entropy(plain(ids), target).backward()

    def fail(*_: Any) -> None:
        raise RuntimeError("a failing hook")

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        driver = Schedule1F1B(stage, F.cross_entropy)
        inputs = (ids if stage.is_first else None, target if stage.is_last else None)
        if stage.is_first:  # Mean: its backward comes after the head's, micro-batch 0's
            handle = stage.partitions[0][1].register_full_backward_hook(fail)
        with pytest.raises((RuntimeError, RemoteError)):
            driver.step(*inputs)
        if stage.is_first:
            handle.remove()
        stage.zero_grad()
        driver.step(*inputs)
        return [p.grad for p in stage.tie_groups[0]]

    for grads in run_threads(rank, 2, timeout=30.0):
        assert not isinstance(grads, BaseException), grads
        for grad in grads:
            torch.testing.assert_close(grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_a_rank_that_froze_a_tied_weight_alone_leaves_no_rank_waiting() -> None:
    models = [_language_model() for _ in range(2)]
    models[0][0].weight.requires_grad_(False)  # on rank 0 only: a mistake, not a hang
    first, last = _one_step_grads(models)
    assert first["0.weight"] is None
    assert last["4.weight"] is not None


def test_every_rank_loads_a_tied_weight_from_either_name() -> None:
    models = [_language_model() for _ in range(2)]
    state = {k: v + 1 for k, v in _language_model().state_dict().items() if k != "4.weight"}

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        stage.load_state_dict(state, strict=False)  # the whole model's, on every rank
        return stage.state_dict()

    first, last = run_threads(rank, 2, timeout=20.0)
    assert torch.equal(first["0.weight"], state["0.weight"])
    assert torch.equal(last["4.weight"], state["0.weight"])


def test_frozen_tied_weights_get_no_gradient_across_processes() -> None:
    models = [_language_model() for _ in range(2)]
    for model in models:
        model[0].weight.requires_grad_(False)
    first, last = _one_step_grads(models)
    assert first["0.weight"] is None
    assert last["4.weight"] is None
    assert last["2.weight"] is not None


@pytest.mark.parametrize("frozen_on", [(), (0,), (0, 1)])
def test_a_tied_weight_frozen_on_every_holder_crosses_no_wire(frozen_on: tuple[int, ...]) -> None:
    # Each step summed a frozen tie over the wire, a whole weight of zeros each way.
    models = [_language_model() for _ in range(2)]
    for r in frozen_on:
        models[r][0].weight.requires_grad_(False)
    weight_bytes = models[0][0].weight.numel() * models[0][0].weight.element_size()
    sent: list[int] = []
    built = threading.Barrier(2)

    def observe(rank: int, ops: list[tuple[int, str, int]]) -> None:
        sent.extend(n for _, kind, n in ops if kind == "send" and n == weight_bytes)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        if built.wait() == 0:
            sent.clear()  # the start's alignment of the values moved the weight once
        built.wait()
        for k in range(2):
            ids, target = _data(k)
            Schedule1F1B(stage, F.cross_entropy).step(
                ids if stage.is_first else None, target if stage.is_last else None
            )
        return {n: p.grad for n, p in stage.named_parameters()}

    first, last = run_threads(rank, 2, timeout=20.0, observe=observe)
    assert len(sent) == (0 if len(frozen_on) == 2 else 4)  # each way, each step
    assert (first["0.weight"] is None) == (0 in frozen_on)
    assert (last["4.weight"] is None) == (1 in frozen_on)


def test_a_meta_model_starts_with_the_owners_values_on_every_rank() -> None:
    results, rules = _across(2, "1f1b", [2, 3], 1, meta=True)
    rules.check()
    for value in results:
        assert not isinstance(value, BaseException), value
    # One step from equal starts, with equal gradients: still equal.
    assert torch.equal(results[0][0]["0.weight"], results[1][0]["4.weight"])


class _Halves(nn.Linear):
    """A Linear whose reset fills its weight with 0.5: values a test can recognize."""

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.5)
        nn.init.zeros_(self.bias)


class _TiedHead(nn.Module):
    """A head whose only weight is another layer's: nothing of its own to fill."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight


def test_a_tie_whose_first_holder_is_on_a_higher_rank_takes_its_values() -> None:
    # Interleaved: stage 1 (rank 1) holds the weight first, stage 2 (rank 0) after it.
    # The owner is the first holder's rank, which a meta model fills; the later
    # holder's copy, allocated and never filled, must not be the one handed round.
    def build() -> nn.Sequential:
        with torch.device("meta"):
            first = _Halves(WIDTH, WIDTH)
            return nn.Sequential(nn.Tanh(), first, _TiedHead(first.weight), nn.Tanh())

    models = [build() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [1, 1, 1, 1], transport=transport)
        return stage.state_dict()

    low, high = run_threads(rank, 2, timeout=20.0)
    assert torch.equal(high["1.weight"], torch.full((WIDTH, WIDTH), 0.5))
    assert torch.equal(low["2.weight"], torch.full((WIDTH, WIDTH), 0.5))


# On gloo, in processes: the ProcessGroupTransport's own transfers.


def _gloo_rank(rank: int, world: int) -> dict[str, Any]:
    from split_models import TinyGPT

    from torchgpipe import split

    torch.manual_seed(0)
    model = TinyGPT()
    ids = torch.randint(0, 32, (8, 8))
    target = torch.randint(0, 32, (8, 8))
    stage = PipelineStage(split(model, ids, at=["blocks.2"]), [1, 1], chunks=4)
    schedule = Schedule1F1B(stage, _lm_loss)
    # SGD: Adam would magnify the float noise of gradients that are zero in exact math
    # (attention's key bias), which is no test of the pipeline.
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        schedule.step(ids if stage.is_first else None, target if stage.is_last else None)
        optimizer.step()
    return {k: v.clone() for k, v in stage.state_dict().items()}


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_gloo_processes_train_a_split_transformer_with_its_tied_head() -> None:
    from distributed_helpers import spawn
    from split_models import TinyGPT

    first, last = spawn(_gloo_rank, 2)
    torch.manual_seed(0)
    plain = TinyGPT()
    ids = torch.randint(0, 32, (8, 8))
    target = torch.randint(0, 32, (8, 8))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        _lm_loss(plain(ids), target).backward()
        optimizer.step()
    assert torch.equal(first["tokens.weight"], last["head.weight"])
    state = {**first, **last}
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _sparse_language_model(head_sparse: bool = False) -> nn.Sequential:
    """A sparse embedding tied to a dense output head (or to a second sparse embedding)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH, sparse=True)
    if head_sparse:
        again = nn.Embedding(VOCAB, WIDTH, sparse=True)
        again.weight = embedding.weight

        class Again(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embedding = again

            def forward(self, x: Tensor) -> Tensor:  # logits from the ids' rows again
                return x @ self.embedding(torch.arange(VOCAB)).t()

        head: nn.Module = Again()
    else:
        head = nn.Linear(WIDTH, VOCAB, bias=False)
        head.weight = embedding.weight  # type: ignore[assignment]
    return nn.Sequential(embedding, Mean(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), head)


@pytest.mark.parametrize("head_sparse", [False, True])
@pytest.mark.parametrize("schedule", [None, Schedule1F1B])
def test_a_sparse_embeddings_tie_sums_as_autograd_does(
    schedule: type | None, head_sparse: bool
) -> None:
    plain = _sparse_language_model(head_sparse)
    ids, target = _data(6)
    F.cross_entropy(plain(ids), target).backward()
    expected = plain[0].weight.grad
    assert expected is not None

    pipe = GPipe(_sparse_language_model(head_sparse), [2, 3], chunks=4)
    if schedule is None:
        F.cross_entropy(pipe(ids), target).backward()
    else:
        schedule(pipe, F.cross_entropy).step(ids, target)
    head = pipe[4].get_parameter("embedding.weight" if head_sparse else "weight")
    for copy_ in (pipe[0].weight, head):
        assert copy_.grad is not None
        assert copy_.grad.is_sparse == expected.is_sparse  # dense where a use is dense
        torch.testing.assert_close(copy_.grad.to_dense(), expected.to_dense(), rtol=1e-5, atol=1e-6)


def test_processes_sum_a_sparse_embeddings_tie_under_nccl_rules() -> None:
    plain = _sparse_language_model()
    ids, target = _data(5)
    F.cross_entropy(plain(ids), target).backward()
    expected = plain[0].weight.grad
    assert expected is not None
    rules = NCCLRules(2)
    models = [_sparse_language_model() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        Schedule1F1B(stage, F.cross_entropy).step(
            ids if stage.is_first else None, target if stage.is_last else None
        )
        return {n: p.grad for n, p in stage.named_parameters()}

    first, last = run_threads(rank, 2, timeout=20.0, observe=rules.group)
    for grad in (first["0.weight"], last["4.weight"]):
        torch.testing.assert_close(grad.to_dense(), expected, rtol=1e-5, atol=1e-6)


def test_a_rank_lost_while_ties_are_summed_is_named_by_its_peers() -> None:
    models = [_language_model() for _ in range(3)]
    ids, target = _data(5)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 2, 1], transport=transport, chunks=4)
        if stage.rank == 2:  # holds the head: the tie's second holder
            lose_in_tie_sum(stage, transport)
        try:
            Schedule1F1B(stage, F.cross_entropy).step(
                ids if stage.is_first else None, target if stage.is_last else None
            )
        except Exception as error:
            return error
        return None

    owner, between, holder = run_threads(rank, 3, timeout=20.0)
    assert isinstance(holder, RuntimeError)
    assert str(holder) == "gone"
    assert isinstance(owner, RemoteError), repr(owner)
    assert owner.rank == 2
    assert owner.stages == (2,)
    assert "rank 2 (stages [2]) died or cannot be reached while the tied" in str(owner)
    assert between is None  # holds no copy: its step ended well


@pytest.mark.parametrize("short", [0, 1])  # the owner of the tie, or its other holder
def test_memory_short_for_the_ties_sum_fails_the_step_on_every_rank(short: int) -> None:
    rules = NCCLRules(2)
    models = [_language_model() for _ in range(2)]
    ids, target = _data(5)
    plain = _language_model()
    F.cross_entropy(plain(ids), target).backward()
    expected = plain[0].weight.grad

    def out_of_memory(like: Tensor) -> Tensor:
        raise RuntimeError("out of memory (as CUDA says it)")

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        schedule = Schedule1F1B(stage, F.cross_entropy)
        outcomes: list[Any] = []
        for attempt in range(2):  # short of memory, then not
            if stage.rank == short and attempt == 0:
                stage._across._buffer = out_of_memory  # type: ignore[method-assign]
            try:
                schedule.step(ids if stage.is_first else None, target if stage.is_last else None)
                outcomes.append(None)
            except Exception as error:
                outcomes.append(error)
            vars(stage._across).pop("_buffer", None)
            if attempt == 0:
                stage.zero_grad()
        grads = {n: p.grad for n, p in stage.named_parameters()}
        return outcomes, grads["0.weight" if stage.is_first else "4.weight"]

    results = run_threads(rank, 2, timeout=20.0, observe=rules.group)
    rules.check()  # every transfer matched: on NCCL, no rank left waiting
    for r, ((first, second), grad) in enumerate(results):
        if r == short:
            assert isinstance(first, RuntimeError), repr(first)
            assert str(first) == "out of memory (as CUDA says it)"
        else:  # the step failed here too, naming the rank short of memory
            assert isinstance(first, RemoteError), repr(first)
            assert first.rank == short
            assert "out of memory" in str(first)
        assert second is None  # the next step runs, its sum whole
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def _transposed_language_model() -> nn.Sequential:
    model = _language_model()
    torch.manual_seed(1)
    model[0].weight = nn.Parameter(torch.randn(WIDTH, VOCAB).t())  # not contiguous
    model[4].weight = model[0].weight
    return model


def test_a_tied_weight_that_is_not_contiguous_sums_across_processes() -> None:
    # The owner sent the bytes of a contiguous copy made before the sum: garbage (1e36).
    ids, target = _data(5)
    plain = _transposed_language_model()
    F.cross_entropy(plain(ids), target).backward()
    models = [_transposed_language_model() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        Schedule1F1B(stage, F.cross_entropy).step(
            ids if stage.is_first else None, target if stage.is_last else None
        )
        return dict(stage.named_parameters())["0.weight" if stage.is_first else "4.weight"].grad

    for grad in run_threads(rank, 2, timeout=20.0):
        torch.testing.assert_close(grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)
