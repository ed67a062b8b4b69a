import gc
import multiprocessing
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torchgpipe.executor import Step
from torchgpipe.worker import ThreadState, WorkerPool, Workers


def _in_thread(state: ThreadState) -> tuple[bool, bool, torch.dtype]:
    seen: list[tuple[bool, bool, torch.dtype]] = []

    def job() -> None:
        with state.apply():
            seen.append(
                (
                    torch.is_grad_enabled(),
                    torch.is_autocast_enabled("cpu"),
                    torch.get_autocast_dtype("cpu"),
                )
            )

    pool = WorkerPool(1, name="test")
    pool.submit(0, job, _unexpected)
    pool.close()
    pool.threads[0].join(timeout=10)
    return seen[0]


def test_a_new_thread_does_not_inherit_state_but_thread_state_carries_it() -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = ThreadState.capture()
        bare: list[bool] = []
        thread = threading.Thread(target=lambda: bare.append(torch.is_grad_enabled()))
        thread.start()
        thread.join()
    assert bare == [True]  # PyTorch's default, not the caller's
    assert state == ThreadState(False, (("cpu", torch.bfloat16),))
    assert _in_thread(state) == (False, True, torch.bfloat16)


def test_apply_overrides_grad_mode() -> None:
    state = ThreadState(False, ())
    with state.apply(grad_enabled=True):
        assert torch.is_grad_enabled()
    with state.apply():
        assert not torch.is_grad_enabled()


def _unexpected(error: BaseException) -> None:
    raise AssertionError(f"a job raised {error!r}")


def test_pool_runs_jobs_in_order_per_worker_and_hands_on_what_a_job_raises() -> None:
    pool = WorkerPool(2, name="test")
    done: list[tuple[int, int]] = []
    raised: list[BaseException] = []

    def fail() -> None:
        raise ZeroDivisionError("could not report")

    for k in range(3):
        for j in range(2):
            pool.submit(j, lambda j=j, k=k: done.append((j, k)), _unexpected)
        pool.submit(0, fail, raised.append)
    pool.close()
    for thread in pool.threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert [k for j, k in done if j == 0] == [0, 1, 2]
    assert [k for j, k in done if j == 1] == [0, 1, 2]
    assert [str(e) for e in raised] == ["could not report"] * 3


def test_a_failure_of_on_failure_is_printed_not_lost(capsys: pytest.CaptureFixture[str]) -> None:
    pool = WorkerPool(1, name="test")

    def fail() -> None:
        raise ZeroDivisionError("the job")

    def worse(error: BaseException) -> None:
        raise KeyError("the handler")

    pool.submit(0, fail, worse)
    pool.close()
    pool.threads[0].join(timeout=10)
    assert "KeyError: 'the handler'" in capsys.readouterr().err


def test_a_pipeline_worker_that_cannot_report_fails_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, the worker swallowed this and the caller waited for an output forever.
    from torch import nn

    from torchgpipe import GPipe, executor

    class FailsOnce(nn.Module):
        failed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.failed:
                self.failed = True
                raise ValueError("in a layer")
            return x

    model = GPipe(nn.Sequential(nn.Linear(2, 2), FailsOnce()), [1, 1], chunks=2)
    real = executor.Step.fail

    def broken(self: executor.Step, error: BaseException, action: object) -> None:
        raise MemoryError("while reporting")

    monkeypatch.setattr(executor.Step, "fail", broken)
    with pytest.raises(MemoryError, match="while reporting") as info:
        model(torch.randn(4, 2))
    assert any("failed while reporting" in note for note in info.value.__notes__)
    monkeypatch.setattr(executor.Step, "fail", real)
    assert model(torch.randn(4, 2)).shape == (4, 2)  # fresh workers serve the next call


def test_pool_threads_exit_when_the_pool_is_collected() -> None:
    pool = WorkerPool(3, name="test")
    threads = pool.threads
    assert all(t.is_alive() and t.daemon for t in threads)
    del pool
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_schedule_worker_that_cannot_report_fails_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch import nn

    from torchgpipe import GPipe, executor, training

    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("in a layer")

    model = GPipe(nn.Sequential(nn.Linear(2, 2), Fails()), [1, 1], chunks=2)
    schedule = training.Schedule1F1B(model, nn.functional.mse_loss)

    def broken(self: executor.Step, error: BaseException, action: object) -> None:
        raise MemoryError("while reporting")

    monkeypatch.setattr(executor.Step, "fail", broken)
    with pytest.raises(MemoryError, match="while reporting") as info:
        schedule.step(torch.randn(4, 2), torch.randn(4, 2))
    assert any("failed while reporting" in note for note in info.value.__notes__)


def test_exclusive_lets_the_holder_in_again_and_another_thread_wait() -> None:
    workers = Workers(1)
    order: list[str] = []
    entered = threading.Event()

    def other() -> None:
        with workers.exclusive():
            order.append("other")
            entered.set()

    with workers.exclusive() as hold:
        with workers.exclusive():  # the holder again (a second call in one backward)
            order.append("again")
        let_go = hold.keep()
        thread = threading.Thread(target=other)
        thread.start()
    # Kept past the block: the other thread still waits (a second to show it would not).
    assert not entered.wait(timeout=1)
    order.append("let go")
    let_go()
    let_go()  # nothing the second time
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert order == ["again", "let go", "other"]


def test_exclusive_lets_go_when_its_block_raises_even_if_kept() -> None:
    workers = Workers(1)

    def kept_then_raises() -> None:
        with workers.exclusive() as hold:
            hold.keep()
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        kept_then_raises()
    done = threading.Event()

    def other() -> None:
        with workers.exclusive():
            done.set()

    threading.Thread(target=other, daemon=True).start()
    assert done.wait(timeout=10)


def test_a_table_of_more_ranks_than_workers_is_refused_before_any_job_goes_out() -> None:
    workers = Workers(2)
    run = SimpleNamespace(step=Step(3, 1), table=SimpleNamespace(ranks=((), (), ())))
    with pytest.raises(ValueError, match="3 ranks cannot run on the 2 threads"):
        workers.run(run, "all", str)  # type: ignore[arg-type]
    assert workers.pool is None  # no thread was started, none waits for rank 2


class _Parked(torch.nn.Module):
    """Waits in the parent process until released; passes at once in a forked child."""

    def __init__(self) -> None:
        super().__init__()
        self.parent = os.getpid()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.getpid() == self.parent:
            self.entered.set()
            assert self.release.wait(timeout=30)
        return x + 1


def _call_in_child(pipe: Any, x: torch.Tensor, results: Any) -> None:
    results.put(pipe(x).tolist())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_during_another_threads_run_calls_the_model_anew() -> None:
    # The child copied the run's lock locked, with no thread to release it: its first
    # call waited forever.
    from torchgpipe import GPipe

    parked = _Parked()
    pipe = GPipe(torch.nn.Sequential(torch.nn.Identity(), parked), [1, 1], chunks=2)
    x = torch.zeros(4, 1)
    busy = threading.Thread(target=pipe, args=(x,))
    busy.start()
    try:
        assert parked.entered.wait(timeout=30)
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(target=_call_in_child, args=(pipe, x, results))
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0, "the forked child hung or failed"
        assert results.get(timeout=10) == [[1.0]] * 4
    finally:
        parked.release.set()
        busy.join(timeout=30)
