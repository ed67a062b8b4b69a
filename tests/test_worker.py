import threading

import pytest
import torch

from torchgpipe.worker import ThreadState, spawn


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

    with spawn([job]):
        pass
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


def test_spawn_joins_every_thread_even_on_error() -> None:
    done: list[int] = []
    jobs = [lambda j=j: done.append(j) for j in range(3)]
    with pytest.raises(ZeroDivisionError), spawn(jobs, name="test"):
        raise ZeroDivisionError
    assert sorted(done) == [0, 1, 2]
    assert not [t for t in threading.enumerate() if t.name.startswith("test-worker")]
