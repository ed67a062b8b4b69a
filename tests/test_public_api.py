import pytest

import torchgpipe
import torchgpipe.skip


def test_public_names() -> None:
    assert sorted(torchgpipe.__all__) == sorted(
        [
            "BalanceError",
            "GPipe",
            "PipelineSchedule",
            "Schedule1F1B",
            "ScheduleGPipe",
            "ScheduleInterleaved1F1B",
            "ScheduleZeroBubble",
            "SplitError",
            "StepResult",
            "__version__",
            "is_checkpointing",
            "is_recomputing",
            "split",
        ]
    )
    for name in torchgpipe.__all__:
        assert getattr(torchgpipe, name) is not None


def test_version_is_a_string() -> None:
    assert isinstance(torchgpipe.__version__, str)
    assert torchgpipe.__version__[0].isdigit()


def test_public_objects_are_documented() -> None:
    for name in torchgpipe.__all__:
        obj = getattr(torchgpipe, name)
        if callable(obj):
            assert obj.__doc__, name


def test_skip_public_names() -> None:
    assert sorted(torchgpipe.skip.__all__) == sorted(
        [
            "Namespace",
            "SkipError",
            "SkipLayout",
            "SkipRoute",
            "pop",
            "skippable",
            "stash",
            "verify_skippables",
        ]
    )
    for name in torchgpipe.skip.__all__:
        assert getattr(torchgpipe.skip, name).__doc__, name


def test_trace_batchnorm_and_schedules_names_are_documented() -> None:
    import torchgpipe.batchnorm
    import torchgpipe.schedules
    import torchgpipe.trace
    import torchgpipe.training

    assert sorted(torchgpipe.trace.__all__) == ["CellEvent", "Trace", "TraceSummary"]
    for module in (
        torchgpipe.trace,
        torchgpipe.batchnorm,
        torchgpipe.schedules,
        torchgpipe.training,
    ):
        assert module.__doc__
        for name in module.__all__:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name}"


def test_distributed_public_names_are_documented() -> None:
    import torchgpipe.distributed

    assert sorted(torchgpipe.distributed.__all__) == [
        "LocalTransport",
        "PipelineSchedule",
        "PipelineStage",
        "ProcessGroupTransport",
        "RemoteError",
        "Schedule1F1B",
        "ScheduleGPipe",
        "ScheduleInterleaved1F1B",
        "ScheduleZeroBubble",
        "StepResult",
        "Transport",
        "TransportError",
        "all_reduce_gradients",
    ]
    for name in torchgpipe.distributed.__all__:
        assert getattr(torchgpipe.distributed, name).__doc__, name


def test_the_single_process_core_does_not_import_torch_distributed() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torchgpipe, torchgpipe.training, torchgpipe.skip, torchgpipe.balance; "
        "print(sorted(m for m in sys.modules if m.startswith('torchgpipe.distributed')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_no_source_file_is_over_500_lines() -> None:
    # Issue 12: a module per concept, each small enough to read in one sitting.
    from pathlib import Path

    import torchgpipe

    root = Path(torchgpipe.__file__).parent
    long = {
        str(path.relative_to(root)): n
        for path in root.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, f"source files over 500 lines: {long}"


def test_the_module_balancing_first_lived_in_points_to_torchgpipe_balance() -> None:
    # torchgpipe 0.0.7 shipped torchgpipe_balancing to say where balancing had gone.
    import importlib

    with pytest.raises(ImportError, match=r"from torchgpipe\.balance import balance_by_time"):
        importlib.import_module("torchgpipe_balancing")
