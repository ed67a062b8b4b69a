"""Worker threads, one per partition, and the caller's state they must carry.

A pipeline keeps its workers between calls: starting threads costs from tens of
microseconds to milliseconds each, which a pipeline of short cells cannot afford on
every step. The workers hold no reference to the pipeline between jobs, so when the
pipeline is collected a finalizer tells them to stop and they exit. A process forked
after the workers started (a DataLoader worker, say) has no such threads: the pipeline
notices the new process id and starts fresh workers there.

A new thread starts with PyTorch's thread-local defaults (grad mode on, autocast off,
the default CUDA stream), so the caller's state is captured in a :class:`ThreadState`
and entered again on each worker.
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch

from torchgpipe.mailbox import Mailbox, add_note, real_failures, where
from torchgpipe.schedules import Action

if TYPE_CHECKING:
    from torchgpipe.executor import StepRun

__all__ = ["Phase", "ThreadState", "WorkerPool", "Workers"]

Phase = Literal["all", "forward", "backward"]
"""Which of a rank's actions a run of the workers takes: all, the F ones, the others."""

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type``, or None when autocast is off."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    if device_type == "cpu":  # pragma: no cover - torch < 2.4
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    else:  # pragma: no cover - torch < 2.4
        enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return dtype if enabled else None


@dataclass(frozen=True)
class ThreadState:
    """The thread-local state of the caller that every cell must run under."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # device types where it is on
    inference: bool = False  # torch.inference_mode

    @classmethod
    def capture(cls) -> ThreadState:
        """Read the calling thread's grad mode, inference mode and autocast state."""
        autocast = []
        for device_type in _AUTOCAST_DEVICE_TYPES:
            dtype = _autocast_dtype(device_type)
            if dtype is not None:
                autocast.append((device_type, dtype))
        return cls(torch.is_grad_enabled(), tuple(autocast), torch.is_inference_mode_enabled())

    @contextmanager
    def apply(self, *, grad_enabled: bool | None = None) -> Iterator[None]:
        """Enter this state on the calling thread; ``grad_enabled`` overrides grad mode.

        Inference mode is entered unless grad mode is forced on (a step records
        gradients, whatever the caller's mode).
        """
        grad = self.grad_enabled if grad_enabled is None else grad_enabled
        with ExitStack() as stack:
            if self.inference and grad_enabled is None:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield


Job = Callable[[], None]
OnFailure = Callable[[BaseException], None]
_Queue = queue.SimpleQueue[tuple[Job, OnFailure, threading.Event | None] | None]  # None: stop


class WorkerPool:
    """Threads that each run, in order, the jobs submitted to them.

    A job reports its own failures through its own channels (a cell's failure travels
    down the pipeline). If it raises anyway, its reporting failed, and someone is still
    waiting for it: the worker hands the exception to the job's ``on_failure``, which
    must wake that caller, and goes on with the next job.
    """

    def __init__(self, n: int, *, name: str = "torchgpipe") -> None:
        self.pid = os.getpid()
        self._queues: list[_Queue] = [queue.SimpleQueue() for _ in range(n)]
        self.threads = [
            threading.Thread(target=_serve, args=(q,), name=f"{name}-worker-{j}", daemon=True)
            for j, q in enumerate(self._queues)
        ]
        for thread in self.threads:
            thread.start()
        # Stop the threads when the pool is collected; the threads do not refer to it.
        self._finalizer = weakref.finalize(self, _stop, self._queues)

    def submit(
        self, j: int, job: Job, on_failure: OnFailure, done: threading.Event | None = None
    ) -> None:
        """Run ``job`` on worker ``j`` after the jobs submitted to it before.

        ``on_failure(error)`` runs on the worker if ``job`` raises ``error``. ``done``,
        when given, is set once the job is over and the worker holds nothing of it: a
        caller woken by it may drop the last reference to what the job used.
        """
        self._queues[j].put((job, on_failure, done))

    def close(self) -> None:
        """Tell every worker to exit once its queued jobs are done."""
        self._finalizer()


def _stop(queues: list[_Queue]) -> None:
    for q in queues:
        q.put(None)


def _serve(jobs: _Queue) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        job, on_failure, done = item
        try:
            job()
        except BaseException as error:  # the job could not report it: its caller must hear
            try:
                on_failure(error)
            except BaseException:  # nobody left to tell: print it rather than lose it
                traceback.print_exc()
        del item, job, on_failure  # hold nothing of the pipeline between jobs
        if done is not None:
            done.set()


class Workers:
    """The threads of a pipeline's ranks, which run one :class:`StepRun` at a time.

    A worker thread per rank, kept from run to run. The caller's own thread runs rank 0
    itself when nothing on it would reach rank 0 alone: the caller would otherwise only
    wait, and each hand-over between threads costs a wake-up, after which code runs
    cold (``benchmarks/pipeline_speed`` prints it: a multiply right after a 10 ms sleep
    took 155 us on our 2-core VM, 10 us right after another). What would reach it
    alone: torch function or dispatch modes (``with torch.device(...)``,
    ``FlopCounterMode``) and saved-tensor hooks (``save_on_cpu``), which a worker thread
    does not have; with any of them on, rank 0 runs on its worker like the others, so
    every partition runs alike. A table with
    fewer ranks (interleaved) uses the first ones. A copy of the model, or a process
    forked from this one, starts workers of its own.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool: WorkerPool | None = None  # started by the first run
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def run(self, run: StepRun, phase: Phase, describe: Callable[[Action], str]) -> None:
        """Run each rank's actions of ``phase``; return when all are done.

        Raises:
            BaseException: the first failure of an action, with a note saying where
                (``describe(action)`` names its stage and device), or what a rank
                raised while reporting.
        """
        try:
            self._run(run, phase, describe)
        except BaseException:
            run.step.drop()  # the cells' tensors go now, not when the traceback is collected
            raise

    def _run(self, run: StepRun, phase: Phase, describe: Callable[[Action], str]) -> None:
        step, ranks = run.step, len(run.table.ranks)
        inline = _plain_thread()
        with self._lock:
            pool = self.pool
            if pool is None or pool.pid != os.getpid():
                pool = self.pool = WorkerPool(self.n)
            first = 1 if inline else 0
            done = [threading.Event() for _ in range(first, ranks)]
            lost: list[BaseException] = []  # what a rank raised while reporting
            for r, event in zip(range(first, ranks), done, strict=True):
                pool.submit(r, partial(run.rank, r, phase), partial(_lost, lost, step), event)
            try:
                if inline:
                    try:
                        run.rank(0, phase)
                    except Exception as failure:  # reporting failed: the others must not wait
                        _lost(lost, step, failure)
                for event in done:
                    event.wait()
            except BaseException:  # KeyboardInterrupt: stop the workers, let them finish
                step.halt()
                for event in done:
                    event.wait()
                raise
            if lost:
                # A rank's messages may be missing: the workers could wait on them
                # forever. Leave those threads, and start fresh ones next time.
                pool.close()
                self.pool = None
        if lost:
            add_note(lost[0], "torchgpipe: a worker failed while reporting a result")
            raise lost[0]
        real = real_failures(step)
        if real:
            error, action = real[0]
            add_note(error, where(action, describe(action), len(step.outputs)))
            raise error


def _plain_thread() -> bool:
    """Whether the calling thread has no torch mode and no saved-tensor hooks on.

    Read through torch's private accessors; where one is missing (another torch
    version), the answer is no, and rank 0 runs on its worker.
    """
    if _ACCESSORS is None:  # pragma: no cover - another torch
        return False
    function_modes, dispatch_modes, saved_hooks = _ACCESSORS
    try:
        hooks = saved_hooks(False)
    except TypeError:  # pragma: no cover - another torch
        return False
    return not (function_modes() or dispatch_modes() or hooks)


def _accessors() -> tuple[Callable[[], Any], Callable[[], Any], Callable[[bool], Any]] | None:
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        hooks = torch._C._autograd._top_saved_tensors_default_hooks
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        return None
    return _get_current_function_mode_stack, _get_current_dispatch_mode_stack, hooks


_ACCESSORS = _accessors()


def _lost(lost: list[BaseException], step: Mailbox, error: BaseException) -> None:
    """A rank's worker raised ``error`` while reporting: stop the step; the caller raises it."""
    lost.append(error)
    step.halt()  # the other ranks stop waiting for what this one will not send
