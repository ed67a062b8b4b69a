import gc
import threading

import torch

from torchgpipe.worker import ThreadState, WorkerPool


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
    pool.submit(0, job)
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


def test_pool_runs_jobs_in_order_per_worker_and_survives_a_raising_job() -> None:
    pool = WorkerPool(2, name="test")
    done: list[tuple[int, int]] = []

    def fail() -> None:
        raise ZeroDivisionError

    for k in range(3):
        for j in range(2):
            pool.submit(j, lambda j=j, k=k: done.append((j, k)))
        pool.submit(0, fail)
    pool.close()
    for thread in pool.threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert [k for j, k in done if j == 0] == [0, 1, 2]
    assert [k for j, k in done if j == 1] == [0, 1, 2]


def test_pool_threads_exit_when_the_pool_is_collected() -> None:
    pool = WorkerPool(3, name="test")
    threads = pool.threads
    assert all(t.is_alive() and t.daemon for t in threads)
    del pool
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
