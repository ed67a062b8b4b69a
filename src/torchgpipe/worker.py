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

A pipeline runs one call at a time, so a layer that calls its own pipeline (in its
forward or backward, on the caller's thread or a worker) would wait for itself forever.
Each thread knows the runs it works for (the caller's thread for the whole run, a
worker for its job, which inherits what the caller worked for: a pipeline nested in a
partition of another): such a call is refused at once (:meth:`Workers.check_caller`).
::

    caller (outside any run)     runs = ()
      └ outer.workers.run        runs = (outer,)          on the caller and outer's workers
          └ inner.workers.run    runs = (outer, inner)    on those and inner's workers
              └ outer(...)       refused: outer is in runs
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
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch

from torchgpipe.mailbox import Mailbox, add_note, real_failures, where
from torchgpipe.schedules import Action

if TYPE_CHECKING:
    from torchgpipe.executor import StepRun

__all__ = ["Before", "Hold", "Phase", "ThreadState", "WorkerPool", "Workers"]

Phase = Literal["all", "forward", "backward"]
"""Which of a rank's actions a run of the workers takes: all, the F ones, the others."""

Before: TypeAlias = Callable[[], Callable[[], None] | None]
"""What readies a run's shared state; what it returns, if anything, ends the run well."""

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type``, or None when autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@dataclass(frozen=True)
class ThreadState:
    """The thread-local state of the caller that every cell must run under."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # device types where it is on
    inference: bool = False  # torch.inference_mode
    function_off: int = 0  # __torch_function__ off: 1 for subclasses, 2 for all (capture)

    @classmethod
    def capture(cls) -> ThreadState:
        """Read the calling thread's grad mode, inference mode and autocast state."""
        autocast = []
        for device_type in _AUTOCAST_DEVICE_TYPES:
            dtype = _autocast_dtype(device_type)
            if dtype is not None:
                autocast.append((device_type, dtype))
        # A subclass's .backward() runs with subclasses off: a recomputation sees the forward's.
        off = 0 if torch._C._is_torch_function_enabled() else 1
        off += torch._C._is_torch_function_all_disabled()
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        return cls(grad, tuple(autocast), inference, off)

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
            if self.function_off:
                off = (torch._C.DisableTorchFunctionSubclass, torch._C.DisableTorchFunction)
                stack.enter_context(off[self.function_off - 1]())
            elif not torch._C._is_torch_function_enabled():  # in a subclass's .backward()
                stack.enter_context(torch._C._EnableTorchFunction())
            yield


class _Within(threading.local):
    """What the calling thread works for: runs, sections held (innermost last); at first none."""

    runs: tuple[Workers, ...] = ()
    held: tuple[Workers, ...] = ()


_within = _Within()


@contextmanager
def _working_for(runs: tuple[Workers, ...], held: tuple[Workers, ...]) -> Iterator[None]:
    """The calling thread works for ``runs`` and ``held`` while the block runs."""
    saved = _within.runs, _within.held
    _within.runs, _within.held = runs, held
    try:
        yield
    finally:
        _within.runs, _within.held = saved


def _job_for(runs: tuple[Workers, ...], held: tuple[Workers, ...], job: Callable[[], None]) -> None:
    """Run ``job`` on a worker as part of what its submitter works for."""
    with _working_for(runs, held):
        job()


class _Holds:
    """The one hold :meth:`Workers.exclusive` takes, for every pipeline of the process.

    One for all: a backward keeps its hold until the engine took in what it handed
    (``pipeline.py``), and may reach another pipeline's node meanwhile (a layer in two
    pipelines). Two threads reaching two pipelines' holds in opposite orders would each
    keep one and wait for the other's; with one, a thread waits only while it holds none.
    """

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.holder: int | None = None  # the thread holding it
        self.count = 0  # how many times it took it

    def let_go(self) -> None:
        with self.changed:
            self.count -= 1
            if not self.count:
                self.holder = None
                self.changed.notify_all()


_HOLD = _Holds()


class Hold:
    """A pipeline held by :meth:`Workers.exclusive`, let go of once."""

    def __init__(self, let_go: Callable[[], None]) -> None:
        self._let_go: Callable[[], None] | None = let_go
        self._lock = threading.Lock()
        self.kept = False

    def keep(self) -> Callable[[], None]:
        """Keep the pipeline held past the block; return what lets go of it, from any thread."""
        self.kept = True
        return self.release

    def release(self) -> None:
        """Let go of the pipeline; nothing the second time."""
        with self._lock:
            let_go, self._let_go = self._let_go, None
        if let_go is not None:
            let_go()


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
    ``FlopCounterMode``), saved-tensor hooks (``save_on_cpu``), which a worker thread does
    not have, and ``__torch_function__`` turned off (a tensor subclass's backward); with
    any of them, rank 0 runs on its worker like the others, so every partition runs alike.
    A table with fewer ranks (interleaved) uses the first ones. A copy of the model, or a
    process forked from this one, starts workers of its own.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool: WorkerPool | None = None  # started by the first run
        self._lock = threading.Lock()  # one run at a time
        _ALL.add(self)

    def check_caller(self) -> None:
        """Refuse a call made from inside one of these workers' own runs.

        Such a call (a layer of the pipeline that calls the pipeline, in its forward or
        its backward, a step or a backward through an output of the pipeline made
        inside) would wait for the run it is part of, which waits for it.

        Raises:
            RuntimeError: the calling thread works for a run of these workers.
        """
        if any(w is self for w in _within.runs):
            raise RuntimeError(
                "torchgpipe: a GPipe was called from inside one of its own partitions "
                "(a layer's forward or backward, or a hook run by it): the GPipe runs "
                "one call at a time, and this one would wait forever for the call it is "
                "part of. Call a separate copy of the model there (copy.deepcopy(model), "
                "or the plain nn.Sequential), or call the GPipe after its own call returns"
            )

    @contextmanager
    def exclusive(self) -> Iterator[Hold]:
        """Hold the pipeline while its parameters' hooks and ``.grad`` are set aside.

        ``model(x)``'s backward through the stages and a schedule's step each silence
        the hooks of the parameters and set their ``.grad`` aside while the stages run
        (``grad_hooks.py``); the backward then hands the engine gradients it
        accumulates later. Another thread's backward or step of this pipeline (or of
        any other: one hold serves them all, see :class:`_Holds`) waits until all that
        is over: it would otherwise find the hooks silent, and call
        them with a micro-batch's share, or mix its gradient with this one's. The
        block may keep the pipeline held past its end (:meth:`Hold.keep`); an
        exception in it lets go at once.

        The thread that holds the pipeline may take it again (a hook, or a second
        call of the model in one backward), and so may the workers that run for it (a
        step's backward into the caller's graph may reach an output of this
        pipeline, or of one that holds it in a partition): each runs while the holder
        waits for it. Nothing else waits while holding it: a run's own threads are
        refused by :meth:`check_caller` first.

        Raises:
            RuntimeError: the calling thread works for a run of these workers
                (:meth:`check_caller`).
        """
        self.check_caller()
        me = threading.get_ident()
        with _HOLD.changed:
            # A thread that works for the holder (a worker of its run) may enter too.
            while _HOLD.count and _HOLD.holder != me and not _within.held:
                _HOLD.changed.wait()
            if not _HOLD.count:
                _HOLD.holder = me
            _HOLD.count += 1
        hold = Hold(_HOLD.let_go)
        try:
            with _working_for(_within.runs, (*_within.held, self)):
                yield hold
        except BaseException:
            hold.release()
            raise
        if not hold.kept:
            hold.release()

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def run(
        self,
        run: StepRun,
        phase: Phase,
        describe: Callable[[Action], str],
        before: Before | None = None,
    ) -> None:
        """Run each rank's actions of ``phase``; return when all are done.

        ``before``, when given, is called once these workers are the caller's, before
        any action: what gets a run's shared state ready (deferred batch norm's count of
        micro-batches) must not reset another thread's run under way. What it returns,
        if anything, is called after every action ended well, the workers still held.

        Raises:
            BaseException: the first failure of an action, with a note saying where
                (``describe(action)`` names its stage and device), or what a rank
                raised while reporting.
            RuntimeError: called from inside a run of these workers (:meth:`check_caller`).
        """
        self.check_caller()
        try:
            self._run(run, phase, describe, before)
        except BaseException:
            run.step.drop()  # the cells' tensors go now, not when the traceback is collected
            raise

    def _run(
        self,
        run: StepRun,
        phase: Phase,
        describe: Callable[[Action], str],
        before: Before | None,
    ) -> None:
        step, ranks = run.step, len(run.table.ranks)
        if ranks > self.n:  # before any job goes out: the others would wait for its rank
            raise ValueError(
                f"a schedule table of {ranks} ranks cannot run on the {self.n} threads of "
                f"this GPipe (one per partition); give a table with at most {self.n} ranks"
            )
        inline = _plain_thread()
        runs, held = (*_within.runs, self), _within.held
        with self._lock, _working_for(runs, held):
            after = before() if before is not None else None
            pool = self.pool
            if pool is None or pool.pid != os.getpid():
                pool = self.pool = WorkerPool(self.n)
            first = 1 if inline else 0
            done = [threading.Event() for _ in range(first, ranks)]
            lost: list[BaseException] = []  # what a rank raised while reporting
            for r, event in zip(range(first, ranks), done, strict=True):
                job = partial(_job_for, runs, held, partial(run.rank, r, phase))
                pool.submit(r, job, partial(_lost, lost, step), event)
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
            elif after is not None and not real_failures(step):
                run.hand_over()  # CUDA: the caller's streams wait for what after() reads
                after()
        # Raised with no name bound to it here, and no record of it left in the step:
        # the frames of its traceback hold the step (and its tensors), which a reference
        # back to the error would keep in a cycle that only the collector frees.
        if lost:
            add_note(lost[0], "torchgpipe: a worker failed while reporting a result")
            raise _first(lost, step)
        if real_failures(step):
            raise _first([], step, describe, len(step.outputs))


def _first(
    lost: list[BaseException],
    step: Mailbox,
    describe: Callable[[Action], str] | None = None,
    m: int = 0,
) -> BaseException:
    """The first of ``lost``, or the step's first real failure noted with where it was.

    ``lost`` and the step's record of failures are emptied. ``m``: the step's micro-batches.
    """
    real = real_failures(step)
    step.failures.clear()
    if lost:
        first = lost[0]
        lost.clear()
        return first
    error, action = real[0]
    assert describe is not None
    add_note(error, where(action, describe(action), m))
    return error


_ALL: weakref.WeakSet[Workers] = weakref.WeakSet()  # for _forked


def _forked() -> None:
    """In a process just forked: let go of what the parent's other threads held.

    The child has only the thread that forked: a run under way on another thread left
    its workers' lock held, and maybe the one hold (:class:`_Holds`), with no thread to
    release them; the first call in the child would wait forever. (Its workers are
    gone too: a pool made in another process is replaced at the next run.)
    """
    for workers in list(_ALL):
        workers._lock = threading.Lock()
    if _HOLD.holder != threading.get_ident():
        _HOLD.__init__()  # type: ignore[misc]


os.register_at_fork(after_in_child=_forked)


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
    functions = torch._C._is_torch_function_enabled()  # off: a subclass's Tensor.backward
    return functions and not (function_modes() or dispatch_modes() or hooks)


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
