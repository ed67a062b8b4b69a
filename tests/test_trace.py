"""The trace of every cell: recorded order, summary, Chrome export and timeline."""

import copy
import gc
import json
import pickle
import sys
import time
import weakref
from typing import Any

import pytest
import torch
from helpers import assert_same_grads
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.pipeline import clock_cycles
from torchgpipe.trace import CellEvent, Trace


def _model(checkpoint: str, n: int = 3, m: int = 4) -> GPipe:
    layers = [nn.Linear(4, 4) for _ in range(n)]
    return GPipe(nn.Sequential(*layers), [1] * n, chunks=m, checkpoint=checkpoint)


def _by_cell(events: list[CellEvent], kind: str) -> dict[tuple[int, int], CellEvent]:
    cells = {}
    for e in events:
        if e.kind == kind:
            assert (e.i, e.j) not in cells, f"two {kind} spans for cell {(e.i, e.j)}"
            cells[(e.i, e.j)] = e
    return cells


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_forward_spans_follow_the_clock_cycles(checkpoint: str) -> None:
    n, m = 3, 4
    model = _model(checkpoint, n, m)
    with model.trace() as trace:
        model(torch.randn(8, 4)).sum().backward()
    forward = _by_cell(trace.events, "forward")
    copies = _by_cell(trace.events, "copy")
    cells = [cell for tick in clock_cycles(m, n) for cell in tick]
    assert set(forward) == set(cells) == set(copies)
    for i, j in cells:  # (i, j) starts after (i - 1, j) and (i, j - 1) end
        for before in [(i - 1, j), (i, j - 1)]:
            if before in forward:
                assert forward[(i, j)].start >= forward[before].end
        assert copies[(i, j)].end <= forward[(i, j)].start
        # The caller's thread runs partition 0, worker j partition j.
        thread = "MainThread" if j == 0 else f"torchgpipe-worker-{j}"
        assert forward[(i, j)].thread == thread


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.usefixtures("backward_by")
def test_backward_spans_run_in_reverse_micro_batch_order(checkpoint: str) -> None:
    n, m = 3, 4
    model = _model(checkpoint, n, m)
    with model.trace() as trace:
        model(torch.randn(8, 4)).sum().backward()
    backward = _by_cell(trace.events, "backward")
    recompute = _by_cell(trace.events, "recompute")
    assert len(backward) == n * m
    checkpointed = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]
    assert set(recompute) == {(i, j) for i in range(checkpointed) for j in range(n)}
    for (i, j), span in recompute.items():
        assert span.end <= backward[(i, j)].start  # recomputed, then backpropagated
    for j in range(n):
        for i in range(1, m):  # micro-batch i is done on partition j before i - 1 starts
            assert backward[(i, j)].end <= backward[(i - 1, j)].start


def test_tracing_changes_no_result_and_stops_with_the_block() -> None:
    model = _model("except_last")
    plain = copy.deepcopy(model)
    x = torch.randn(8, 4)
    with model.trace() as trace:
        out = model(x)
        out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    assert_same_grads(model, plain)
    count = len(trace.events)
    assert model._tracer is None
    model(x).sum().backward()
    assert len(trace.events) == count  # nothing recorded outside the block


def test_one_trace_at_a_time() -> None:
    model = _model("never")
    with model.trace(), pytest.raises(RuntimeError, match="traced already"), model.trace():
        pass
    assert model._tracer is None


def _synthetic(n: int, m: int, busy: float, ticks: int) -> Trace:
    """A trace of n partitions where partition j works on ticks j .. j + m - 1."""
    trace = Trace(n)
    trace.m = m
    for j in range(n):
        for i in range(m):
            start = float(i + j)  # each partition on a worker of its own
            trace.events.append(CellEvent(j, i, "forward", start, start + busy, f"worker-{j}"))
    assert ticks == m + n - 1
    return trace


def test_summary_of_an_ideal_schedule_has_the_ideal_bubble() -> None:
    n, m = 4, 8
    summary = _synthetic(n, m, 1.0, m + n - 1).summary()
    assert summary.span == pytest.approx(m + n - 1)
    assert summary.busy == pytest.approx((m,) * n)
    assert summary.bubble == pytest.approx((n - 1) / (m + n - 1))
    assert summary.ideal_bubble == pytest.approx((n - 1) / (m + n - 1))
    assert "bubble 27.3%" in str(summary)


def test_summary_counts_overlapping_spans_once() -> None:
    trace = Trace(1)
    trace.m = 1
    trace.record(0, 0, "copy", 0.0, 1.0)
    trace.record(0, 0, "forward", 0.5, 2.0)
    trace.record(0, 0, "backward", 3.0, 4.0)
    summary = trace.summary()
    assert summary.busy == pytest.approx((3.0,))
    assert summary.bubble == pytest.approx(0.25)


def test_empty_trace_has_no_summary() -> None:
    with pytest.raises(ValueError, match="the trace is empty"):
        Trace(2).summary()


def _two_ranks(label: str = "") -> Trace:
    """Partitions 0 and 2 on one thread, 1 and 3 on another, each thread always busy."""
    trace = Trace(4)
    trace.m = 2
    for j, start in [(0, 0.0), (2, 2.0), (1, 1.0), (3, 3.0)]:
        thread = f"{label}worker-{j % 2}"
        trace.events.append(CellEvent(j, 0, "forward", start, start + 2.0, thread))
    return trace


def test_summary_counts_a_rank_busy_while_it_runs_any_of_its_partitions() -> None:
    # The bug: idle time was counted per partition, so a rank running its other
    # partition sat idle, and the ideal was GPipe's for n = 4 rather than interleaved's.
    summary = _two_ranks().summary()
    assert summary.bubble == pytest.approx(1 - 8 / (2 * 5))
    assert summary.ideal_bubble == pytest.approx((2 - 1) / (2 * 2 + 2 - 1))  # v = 2, m = 2
    assert summary.busy == pytest.approx((2.0,) * 4)
    assert summary.ranks == ((0, 2), (1, 3))
    assert summary.rank_busy == pytest.approx((4.0, 4.0))
    assert "4 partitions on 2 ranks" in str(summary)
    assert "rank 1 (partitions 1, 3)" in str(summary)
    assert "bubble 20.0% (interleaved 1F1B's ideal for 2 ranks, v = 2, m = 2: 20.0%)" in str(
        summary
    )


def test_summary_of_an_interleaved_step_that_failed_before_a_partition_keeps_its_ranks() -> None:
    # Regression: a rank whose second partition never ran lowered the partitions per
    # rank: "4 partitions on 2.66667 ranks", and the ideal of v = 1.5.
    trace = _two_ranks()
    trace.events = [e for e in trace.events if e.j != 3]
    summary = trace.summary()
    assert summary.per_rank == 2
    assert summary.ideal_bubble == pytest.approx((2 - 1) / (2 * 2 + 2 - 1))
    assert "4 partitions on 2 ranks" in str(summary)
    assert "ideal for 2 ranks, v = 2, m = 2" in str(summary)


def test_summary_of_a_merged_trace_counts_per_process() -> None:
    # gather_trace labels each process's threads: the same thread name in two processes
    # is two ranks.
    merged = Trace(4)
    for r in range(2):
        events = [e for e in _two_ranks().on_wall_clock() if e[0] % 2 == r]
        merged.merge([(j, i, kind, a, b, "MainThread") for j, i, kind, a, b, _ in events],
                     f"rank {r}")  # fmt: skip
    merged.m = 2
    summary = merged.summary()
    assert summary.bubble == pytest.approx(0.2)
    assert summary.ranks == ((0, 2), (1, 3))


def test_summary_of_one_process_s_own_trace_leaves_out_the_other_processes_stages() -> None:
    # A process's own trace of a run across processes holds its stages' spans only: the
    # others were counted as idle ranks of its own, and the bubble and ideal were wrong.
    trace = Trace(4)
    trace.m = 2
    trace.events = [e for e in _two_ranks().events if e.j % 2 == 0]  # rank 0's stages
    summary = trace.summary()
    assert summary.ranks == ((0, 2),)
    assert summary.busy == pytest.approx((2.0, 0.0, 2.0, 0.0))
    assert summary.bubble == pytest.approx(0.0)  # rank 0 ran from 0.0 to 4.0 without a pause
    assert summary.ideal_bubble == pytest.approx((2 - 1) / (2 * 2 + 2 - 1))  # as merged
    text = str(summary)
    assert "partitions 1, 3: not in this trace" in text
    assert "partition 1: busy" not in text
    assert "of the rank traced (interleaved 1F1B's ideal for 2 ranks, v = 2" in text
    one = Trace(2)  # one stage per process: GPipe's ideal for the whole pipeline
    one.m = 4
    one.events = [e for e in _synthetic(2, 4, 1.0, 5).events if e.j == 1]
    assert one.summary().ideal_bubble == pytest.approx(1 / 5)
    assert "GPipe's ideal for n = 2, m = 4" in str(one.summary())


def test_summary_of_spans_of_no_length_prints() -> None:
    trace = Trace(2)
    trace.events = [CellEvent(j, 0, "forward", 1.0, 1.0, "worker") for j in range(2)]
    assert "busy     0.00 ms (  0.0%)" in str(trace.summary())


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_steps_loss_is_inside_the_last_stages_cell(checkpoint: str) -> None:
    # Inside its forward span, or its recomputation's where the cell is checkpointed:
    # a loss outside every span showed as idle time, more so without checkpointing.
    from torchgpipe import Schedule1F1B

    called: list[float] = []

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        called.append(time.perf_counter())
        return nn.functional.mse_loss(output, target)

    m = 3
    model = _model(checkpoint, n=2, m=m)
    with model.trace() as trace:
        Schedule1F1B(model, loss_fn).step(torch.randn(6, 4), torch.randn(6, 4))
    spans = [e for e in trace.events if e.j == 1 and e.kind in ("forward", "recompute")]
    assert len(called) == m
    for moment in called:
        assert any(e.start <= moment <= e.end for e in spans), (moment, spans)


def test_summary_of_an_interleaved_step_knows_its_ranks() -> None:
    from torchgpipe import ScheduleInterleaved1F1B

    m = 4
    model = _model("never", n=4, m=m)
    with model.trace() as trace:
        ScheduleInterleaved1F1B(model, nn.functional.mse_loss).step(
            torch.randn(8, 4), torch.randn(8, 4)
        )
    summary = trace.summary()
    assert summary.ideal_bubble == pytest.approx(1 / (2 * m + 1))
    assert summary.ranks == ((0, 2), (1, 3))


def test_chrome_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _model("always", n=2, m=2)
    with model.trace() as trace:
        model(torch.randn(4, 4)).sum().backward()
    path = tmp_path / "trace.json"
    trace.save_chrome(path)
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(trace.events)
    assert {e["tid"] for e in spans} == {0, 1}
    assert {e["cat"] for e in spans} == {"copy", "forward", "recompute", "backward"}
    assert min(e["ts"] for e in spans) == 0
    assert all(e["dur"] >= 0 for e in spans)
    names = [e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["partition 0", "partition 1"]
    # Perfetto takes process 0 for the kernel's idle process.
    assert {e["pid"] for e in data["traceEvents"]} == {1}
    assert not _misnested(spans)


def _misnested(spans: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The pairs of "X" events on one row that overlap in part (Perfetto cannot draw)."""
    bad = []
    for tid in {e["tid"] for e in spans}:
        row = sorted((e for e in spans if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
        for k, a in enumerate(row):
            for b in row[k + 1 :]:
                a_end, b_end = a["ts"] + a["dur"], b["ts"] + b["dur"]
                if a["ts"] < b["ts"] < a_end - 1e-3 and b_end > a_end + 1e-3:
                    bad.append((a["name"], b["name"]))
    return bad


def test_chrome_export_nests_spans_that_overlap_in_part() -> None:
    # Backward spans of neighbouring micro-batches may overlap in part in the engine;
    # Perfetto draws one row as a stack of nested spans, so the export cuts the earlier
    # short, and the events keep what was recorded.
    trace = Trace(2)
    trace.record(0, 1, "backward", 0.0, 4.0)
    trace.record(0, 1, "recompute", 1.0, 3.0)  # nested in the first: left alone
    trace.record(0, 0, "backward", 2.0, 6.0)  # overlaps both in part
    trace.record(0, 0, "recompute", 5.0, 5.5)
    trace.record(1, 0, "backward", 3.0, 7.0)  # another row: left alone
    recorded = list(trace.events)
    spans = [e for e in trace.chrome()["traceEvents"] if e["ph"] == "X"]
    assert not _misnested(spans)
    assert trace.events == recorded
    shown = {(e["tid"], e["cat"], e["args"]["micro_batch"]): e for e in spans}
    assert shown[(0, "backward", 1)]["dur"] == pytest.approx(2e6)  # cut at 2.0
    assert shown[(0, "backward", 1)]["args"]["recorded_dur"] == pytest.approx(4e6)
    assert shown[(0, "recompute", 1)]["dur"] == pytest.approx(1e6)  # cut at 2.0 too
    for key in [(0, "backward", 0), (0, "recompute", 0), (1, "backward", 0)]:
        event = next(e for e in recorded if (e.j, e.kind, e.i) == key)
        assert shown[key]["dur"] == pytest.approx(event.duration * 1e6)
        assert "recorded_dur" not in shown[key]["args"]


def test_chrome_export_cuts_a_span_at_the_next_ones_start_exactly() -> None:
    # Its ts and dur were each converted to microseconds: their sum could pass the next
    # span's ts by an ulp (370 of 1999 such cuts), an overlap in part in the JSON.
    for k in range(1, 400):
        trace = Trace(2)
        trace.record(1, 0, "forward", 0.123456789, 0.2)  # the first span, on another row
        first, second = 1.0, 1.0 + k * 1.37e-6  # seconds, as perf_counter gives
        trace.record(0, 0, "backward", first, second + 1e-3)
        trace.record(0, 1, "backward", second, second + 2e-3)
        a, b = [e for e in trace.chrome()["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
        assert a["ts"] + a["dur"] <= b["ts"], k


def test_the_timeline_title_of_one_process_trace_names_what_it_holds() -> None:
    from torchgpipe._timeline import default_title

    # It said "n = 2 on 1 ranks" of a trace of one process's stage 0 of two.
    trace = Trace(2)
    trace.record(0, 0, "forward", 0.0, 1.0)
    title = default_title(trace)
    assert title.startswith("timeline: n = 2 (traced here: partitions [0]), m = 1"), title


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_trace_round_trip(how: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The bug: a Trace held a threading.Lock, so it could not be copied or saved.
    model = _model("except_last")
    with model.trace() as trace:
        model(torch.randn(8, 4)).sum().backward()
    if how == "pickle":
        twin = pickle.loads(pickle.dumps(trace))
    elif how == "deepcopy":
        twin = copy.deepcopy(trace)
    else:
        torch.save(trace, tmp_path / "trace.pt")
        twin = torch.load(tmp_path / "trace.pt", weights_only=False)
    assert twin == trace
    assert twin.events == trace.events
    assert str(twin.summary()) == str(trace.summary())
    twin.record(0, 0, "copy", 0.0, 1.0)  # a lock of its own, and events of its own
    assert len(twin.events) == len(trace.events) + 1


def test_timeline_picture(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    model = _model("except_last")
    with model.trace() as trace:
        model(torch.randn(8, 4)).sum().backward()
    path = tmp_path / "timeline.png"
    trace.draw(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A folder was drawn beside, as <folder>.png, with no word.
    with pytest.raises(ValueError, match="is a folder: name a file in it"):
        trace.draw(tmp_path)
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.suffix == ".png") == []


def test_timeline_picture_leaves_the_backend_and_pyplot_alone(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The bug: draw() called matplotlib.use("Agg"), which switched a notebook's or an
    # application's backend, and drew through pyplot's global figures.
    matplotlib = pytest.importorskip("matplotlib")
    model = _model("except_last")
    with model.trace() as trace:
        model(torch.randn(8, 4)).sum().backward()
    switched: list[object] = []
    monkeypatch.setattr(matplotlib, "use", lambda *args, **kwargs: switched.append(args))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # importing it fails
    path = tmp_path / "timeline.png"
    trace.draw(path)
    assert switched == []
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_legend_covers_no_span(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The bug: the legend sat in the plot's upper right corner, over partition 0's last
    # spans. Now it is outside the plot, and inside the picture.
    figure_module = pytest.importorskip("matplotlib.figure")
    model = _model("except_last")
    with model.trace() as trace:
        model(torch.randn(8, 4)).sum().backward()
    boxes = []
    save = figure_module.Figure.savefig

    def saving(figure, *args, **kwargs):  # type: ignore[no-untyped-def]
        save(figure, *args, **kwargs)
        renderer = figure.canvas.get_renderer()
        axes = figure.axes[0]
        boxes.append((axes.get_legend().get_window_extent(renderer),
                      axes.get_window_extent(renderer), figure.bbox))  # fmt: skip

    monkeypatch.setattr(figure_module.Figure, "savefig", saving)
    trace.draw(tmp_path / "timeline.png")
    ((legend, plot, picture),) = boxes
    assert not legend.overlaps(plot)
    assert picture.x0 <= legend.x0
    assert legend.x1 <= picture.x1
    assert picture.y0 <= legend.y0
    assert legend.y1 <= picture.y1


def test_backward_spans_of_a_partition_whose_input_needs_no_grad() -> None:
    # Token ids need no gradient: the span ends when the partition's parameters have
    # theirs, and tracing does not make the input need one (no extra work).
    model = GPipe(
        nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)), [1, 1], chunks=2, checkpoint="never"
    )
    ids = torch.randint(10, (4, 3))
    with model.trace() as trace:
        model(ids).sum().backward()
    backward = _by_cell(trace.events, "backward")
    assert set(backward) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for i in range(2):
        assert backward[(i, 0)].start >= backward[(i, 1)].start  # partition 1 first


def test_a_traced_forward_without_backward_leaves_no_hook_and_frees_the_trace(
    backward_by: str,
) -> None:
    # In the engine's backward, the first partition's input needs no gradient, so the
    # nodes of each micro-batch's graph get hooks that end its backward span; with no
    # backward, they must go with the graph. On the workers, no hooks at all: the
    # worker records the spans. Nothing is ever hooked on the model's parameters.
    model = GPipe(
        nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)), [1, 1], chunks=2, checkpoint="never"
    )
    with model.trace() as trace:
        out = model(torch.randint(10, (4, 3)))
    assert bool(_graph_hooks(out)) == (backward_by == "engine")  # meanwhile, in the graph
    assert not model[0].weight._post_accumulate_grad_hooks
    alive = weakref.ref(trace)
    del trace, out
    gc.collect()
    assert alive() is None
    assert not model[0].weight._post_accumulate_grad_hooks


def _graph_hooks(output: Tensor) -> int:
    """How many hooks and pre-hooks the nodes of ``output``'s graph hold."""
    # Nodes, not their ids: a C++ node's Python object is freed when let go, and its id
    # reused by the next (with torch 2.11 this walk skipped most of the graph).
    stack, seen, count = [output.grad_fn], set(), 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += _node_hooks(node)
        stack += [n for n, _ in node.next_functions]
    return count


def _node_hooks(node: Any) -> int:
    """How many hooks and pre-hooks ``node`` holds."""
    count = 0
    for register in (node.register_hook, node.register_prehook):
        probe = register(lambda *grads: None)
        count += len(probe.hooks_dict_ref()) - 1  # the node's hooks share one dict
        probe.remove()
    return count


def _first_partition_with_a_spare_weight(m: int, spare: bool = True) -> GPipe:
    class WithSpare(nn.Module):  # a weight that this forward does not use
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.spare = nn.Parameter(torch.zeros(3), requires_grad=spare)

        def forward(self, x: Tensor) -> Tensor:
            return self.linear(x)

    layers = nn.Sequential(WithSpare(), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    return GPipe(layers, [2, 3], chunks=m, checkpoint="never")


@pytest.mark.usefixtures("engine_backward")
@pytest.mark.parametrize("spare", [False, True])
def test_engine_backward_spans_of_the_first_partition_follow_each_other(spare: bool) -> None:
    # The bug: the first partition's input needs no gradient, and its spans ended when
    # its parameters had their gradients: once per backward, for every micro-batch at
    # once, so each span ran to the end of the whole backward, the spans nested, and a
    # weight unused by the forward left no span at all.
    m = 4
    model = _first_partition_with_a_spare_weight(m, spare)
    with model.trace() as trace:
        out = model(torch.randn(16, 8))
    out.sum().backward(retain_graph=True)
    backward = _by_cell(trace.events, "backward")
    assert set(backward) == {(i, j) for i in range(m) for j in range(2)}
    for j in range(2):  # the engine runs micro-batch i's cell before i - 1's, whole
        for i in range(1, m):
            assert backward[(i, j)].end <= backward[(i - 1, j)].start
    assert _graph_hooks(out) > 0  # the graph is kept: it may run again
    out.sum().backward()
    assert len([e for e in trace.events if e.kind == "backward"]) == 2 * 2 * m
    assert _graph_hooks(out) == 0  # removed with the graph, freed by that backward
    assert not model[0].spare._post_accumulate_grad_hooks


@pytest.mark.usefixtures("engine_backward")
def test_engine_backward_that_stops_short_of_a_cell_keeps_its_hooks_for_the_next() -> None:
    # Only the first layer's bias: its weight's part of the graph never runs, so the
    # first partition's spans cannot end. No span, rather than a wrong one; the hooks
    # stay while the graph is kept, and a full backward through it records the spans,
    # then leaves no hook behind.
    model = _first_partition_with_a_spare_weight(2)
    with model.trace() as trace:
        out = model(torch.randn(8, 8))
    assert _graph_hooks(out) > 0
    torch.autograd.grad(out.sum(), [model[0].linear.bias], retain_graph=True)
    assert {e.j for e in trace.events if e.kind == "backward"} == {1}
    assert _graph_hooks(out) > 0
    out.sum().backward()
    spans = [(e.j, e.i) for e in trace.events if e.kind == "backward"]
    assert sorted(spans) == sorted([(0, 0), (0, 1)] + 2 * [(1, 0), (1, 1)])
    assert _graph_hooks(out) == 0
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_trace_under_no_grad_and_after_a_failure() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ArithmeticError("boom")

    model = _model("always")
    with model.trace() as trace, torch.no_grad():
        model(torch.randn(8, 4))
    assert {e.kind for e in trace.events} == {"copy", "forward"}

    failing = GPipe(nn.Sequential(nn.Linear(4, 4), Boom()), [1, 1], chunks=2)
    with pytest.raises(ArithmeticError), failing.trace():
        failing(torch.randn(4, 4))
    assert failing._tracer is None  # the trace ended with the block


def test_copies_made_during_a_trace_are_not_traced() -> None:
    model = _model("except_last")
    with model.trace():
        twin = copy.deepcopy(model)
    assert twin._tracer is None
    twin(torch.randn(8, 4)).sum().backward()


# torch 2.11 warns at a profile's start that it keeps one cycle's events (it still
# reports them): not what the test is about.
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_actions_show_in_torch_profiler_by_name() -> None:
    # torch.profiler records threads other than its own only with profile_all_threads.
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from torchgpipe.training import Schedule1F1B

    try:
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        pytest.skip("this torch's profiler cannot record all threads")
    model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2,
                  checkpoint="always")  # fmt: skip
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    # The CPU alone: on a CUDA build the default asks for CUDA too, and warns (an error
    # here) where conftest hides the GPU.
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        model(x).sum().backward()  # forward cells, and the checkpointed cells' backward
        Schedule1F1B(model, nn.functional.mse_loss).step(x, y)
    names = {event.name for event in prof.events()}
    cells = {f"{j}{kind}{i}" for j in range(2) for kind in "FB" for i in range(2)}
    assert cells <= names


class _Slow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.05)
        return x


def test_waiting_for_the_previous_stage_is_not_a_copy() -> None:
    # Partition 1 waits 50 ms for partition 0's output; its copy span starts after.
    model = GPipe(nn.Sequential(_Slow(), nn.Identity()), [1, 1], chunks=2)
    with model.trace() as trace:
        model(torch.randn(2, 2))
    copies = [e for e in trace.events if e.j == 1 and e.kind == "copy"]
    assert copies
    assert all(e.end - e.start < 0.025 for e in copies)


class _FailsOnce(torch.autograd.Function):
    """Identity whose first backward raises."""

    failed = False

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if not _FailsOnce.failed:
            _FailsOnce.failed = True
            raise RuntimeError("the first backward fails")
        return grad


class _Fails(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _FailsOnce.apply(x)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("engine_backward")
@pytest.mark.parametrize("input_wants_grad", [False, True])
def test_engine_backward_run_again_after_a_failure_records_spans_of_one_run(
    input_wants_grad: bool,
) -> None:
    # A span whose first backward failed before it ended took its start from that run,
    # and so straddled the time between the two.
    _FailsOnce.failed = False
    layers = nn.Sequential(nn.Linear(8, 8), _Fails(), nn.Linear(8, 8), nn.Linear(8, 8))
    model = GPipe(layers, [2, 2], chunks=2, checkpoint="never")
    x = torch.randn(4, 8, requires_grad=input_wants_grad)
    with model.trace() as trace:
        out = model(x)
    with pytest.raises(RuntimeError, match="the first backward fails"):
        out.sum().backward(retain_graph=True)
    failed = time.perf_counter()
    out.sum().backward()
    spans = [e for e in trace.events if e.kind == "backward"]
    assert {(e.j, e.i) for e in spans} == {(j, i) for j in range(2) for i in range(2)}
    assert all(e.end <= failed or e.start >= failed for e in spans)


class _Complex(nn.Module):
    """A layer whose output is complex: the next partition's input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.polar(torch.ones_like(x), self.linear(x))


class _Magnitude(nn.Module):
    def forward(self, z: Tensor) -> Tensor:
        return z.abs()


@pytest.mark.usefixtures("engine_backward")
def test_engine_backward_spans_end_at_a_complex_input() -> None:
    # A complex input was taken for one that needs no gradient: the span of the
    # partition it entered ran on into the previous partition's backward.
    model = GPipe(nn.Sequential(_Complex(), _Magnitude(), nn.Linear(8, 2)), [1, 2], chunks=2)
    with model.trace() as trace:
        out = model(torch.randn(4, 8))
    out.sum().backward()
    backward = _by_cell(trace.events, "backward")
    for i in range(2):
        assert backward[(i, 1)].end <= backward[(i, 0)].start


class _Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, x * 3


class _Both(nn.Module):
    def forward(self, t: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return t[0] + 1, t[1] + 1


class _Second(nn.Module):
    def forward(self, t: tuple[Tensor, Tensor]) -> Tensor:
        return t[1]


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_backward_spans_of_cells_whose_first_input_gets_no_gradient(
    backward_by: str, checkpoint: str
) -> None:
    # The bug: on the engine's path a span started at the cell's first output that needs
    # a gradient and ended at its first such input. Partition 2 uses t[1] only, so its
    # first input, and partition 1's first output and input, get no gradient: neither
    # partition recorded a backward span. Now every such input and output is marked:
    # the span starts at the first output a gradient reaches, and ends at the last
    # input that passed one on.
    layers = nn.Sequential(nn.Linear(4, 4), _Pair(), _Both(), _Second(), nn.Linear(4, 2))
    model = GPipe(layers, [2, 1, 2], chunks=2, checkpoint=checkpoint)
    with model.trace() as trace:
        model(torch.randn(4, 4)).sum().backward()
    backward = _by_cell(trace.events, "backward")
    assert set(backward) == {(i, j) for i in range(2) for j in range(3)}
    for i in range(2):  # each ends before the previous partition's starts
        for j in range(1, 3):
            assert backward[(i, j)].start <= backward[(i, j)].end <= backward[(i, j - 1)].start


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), self.b(x)


class _FirstOnly(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0]


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_a_first_partition_whose_output_the_next_ignores_records_its_span(
    backward_by: str, checkpoint: str
) -> None:
    # The bug: on the engine's path the first partition (its input needs no gradient)
    # ended its span when every sink of its graph had run; the sinks behind the output
    # the next partition ignores never run, so nothing was recorded.
    model = GPipe(nn.Sequential(_TwoHeads(), _FirstOnly()), [1, 1], chunks=2, checkpoint=checkpoint)
    with model.trace() as trace:
        model(torch.randn(4, 4)).sum().backward()
    backward = _by_cell(trace.events, "backward")
    assert set(backward) == {(i, j) for i in range(2) for j in range(2)}
    assert all(span.start <= span.end for span in backward.values())


def _scaled_first_layer() -> tuple[GPipe, Tensor]:
    """A pipeline, and a weight for its first layer that the caller computes.

    Called through ``torch.func.functional_call``, the first partition reads the
    caller's graph: the node of ``weight * scale``, shared by every micro-batch.
    """
    model = GPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), [1, 1], chunks=4,
                  checkpoint="never")  # fmt: skip
    scale = torch.tensor(2.0, requires_grad=True)
    return model, model[0].weight * scale


@pytest.mark.usefixtures("engine_backward")
def test_engine_backward_spans_end_at_the_cells_own_nodes_not_the_callers() -> None:
    # The bug: the first partition's input needs no gradient, and the walk for the last
    # nodes of its graph went on into the caller's: each micro-batch's span ended at the
    # caller's node, run once all of them were done, so the spans nested.
    model, weight = _scaled_first_layer()
    with model.trace() as trace:
        out = torch.func.functional_call(model, {"0.weight": weight}, (torch.randn(8, 8),))
    assert _node_hooks(weight.grad_fn) == 0
    out.sum().backward()
    backward = _by_cell(trace.events, "backward")
    assert set(backward) == {(i, j) for i in range(4) for j in range(2)}
    for j in range(2):
        for i in range(1, 4):
            assert backward[(i, j)].end <= backward[(i - 1, j)].start
    assert _node_hooks(weight.grad_fn) == 0


@pytest.mark.usefixtures("engine_backward")
def test_engine_traced_forward_under_functional_call_leaves_no_hook_and_frees_the_trace() -> None:
    # The bug: hooks on the caller's node outlived the traced forward, kept the ended
    # trace alive, and a later backward of the caller's through that node added spans
    # to it.
    model, weight = _scaled_first_layer()
    with model.trace() as trace:
        out = torch.func.functional_call(model, {"0.weight": weight}, (torch.randn(8, 8),))
    count = len(trace.events)
    del out  # a traced forward whose backward never runs
    gc.collect()
    assert _node_hooks(weight.grad_fn) == 0
    (weight * 1).sum().backward()  # the caller's own backward
    assert len(trace.events) == count
    alive = weakref.ref(trace)
    del trace
    gc.collect()
    assert alive() is None


class _Keeps(nn.Linear):
    """A layer that keeps its last output: the caller may backpropagate from it."""

    def forward(self, x: Tensor) -> Tensor:
        self.kept = super().forward(x)
        return self.kept


@pytest.mark.usefixtures("engine_backward")
def test_engine_backward_that_reaches_no_output_of_a_cell_records_nothing() -> None:
    # A backward of the caller's through the cell's own nodes (here from a tensor the
    # layer kept; or through the caller's graph the cell reads) runs hooked nodes
    # without any gradient reaching the cell's outputs: not the cell's backward.
    model = GPipe(nn.Sequential(_Keeps(8, 8), nn.Linear(8, 8)), [1, 1], chunks=2,
                  checkpoint="never")  # fmt: skip
    weight = model[0].weight * torch.tensor(2.0, requires_grad=True)
    with model.trace() as trace:
        out = torch.func.functional_call(model, {"0.weight": weight}, (torch.randn(4, 8),))
    assert _graph_hooks(out) > 0
    count = len(trace.events)
    model[0].kept.sum().backward(retain_graph=True)
    (weight * 1).sum().backward(retain_graph=True)
    assert len(trace.events) == count
    out.sum().backward()  # the pipeline's own: a span per cell
    assert len(_by_cell(trace.events, "backward")) == 4


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 20 ms: another partition's work, in the engine."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(0.02)
        return grad


class _SlowInBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _SlowBackward.apply(x)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("engine_backward")
def test_engine_backward_span_of_a_first_partition_covers_its_own_slow_node() -> None:
    # The bug (torch 2.11, the GPU machine's): the walk for the first partition's last
    # nodes kept the ids of the nodes it had seen, not the nodes; a freed node's id was
    # soon another's, the chain's last node was taken for one seen, no sink was found,
    # and each span was recorded empty, at the moment its output's gradient arrived.
    layers = nn.Sequential(
        nn.Linear(8, 8), _SlowInBackward(), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 8),
    )  # fmt: skip
    model = GPipe(layers, [5, 1], chunks=2, checkpoint="never")
    with model.trace() as trace:
        out = model(torch.randn(4, 8))  # needs no gradient: the span ends at the sinks
    out.sum().backward()
    backward = _by_cell(trace.events, "backward")
    for i in range(2):
        assert backward[(i, 0)].end - backward[(i, 0)].start >= 0.02  # the slow node's sleep


@pytest.mark.usefixtures("engine_backward")
def test_engine_backward_span_of_a_stashing_cell_starts_with_its_main_output() -> None:
    # The bug: a cell's span started at the first gradient to reach any of its outputs.
    # A skip's comes back from the last partition before the middle partition's slow
    # backward has run, so the first partition's spans covered it: busy 97% of the
    # time, where its own work takes a fraction of a millisecond per micro-batch.
    from torchgpipe.skip import pop, skippable, stash

    @skippable(stash=["skip"])
    class Down(nn.Linear):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x)
            return super().forward(x)

    @skippable(pop=["skip"])
    class Up(nn.Linear):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            skip = yield pop("skip")
            return super().forward(x) + skip

    layers = nn.Sequential(Down(8, 8), _SlowInBackward(), Up(8, 8))
    model = GPipe(layers, [1, 1, 1], chunks=4, checkpoint="never")
    with model.trace() as trace:
        model(torch.randn(8, 8, requires_grad=True)).sum().backward()
    backward = _by_cell(trace.events, "backward")
    for i in range(4):  # the main output's gradient leaves partition 1's cell first
        assert backward[(i, 1)].end <= backward[(i, 0)].start <= backward[(i, 0)].end
    summary = trace.summary()
    assert summary.busy[0] / summary.span < 0.5  # 20 ms sleeps, each covered 3 times
    spans = [e for e in trace.chrome()["traceEvents"] if e["ph"] == "X"]
    assert not _misnested(spans)


@pytest.mark.usefixtures("engine_backward")
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("input_wants_grad", [False, True])
def test_engine_backward_twice_through_a_kept_graph_records_a_span_each(
    checkpoint: str, input_wants_grad: bool
) -> None:
    # The bug: a cell that is not checkpointed recorded the first backward through it
    # only, where a checkpointed one recorded each.
    model = _model(checkpoint, n=2, m=2)
    with model.trace() as trace:
        out = model(torch.randn(4, 4, requires_grad=input_wants_grad))
    out.pow(2).mean().backward(retain_graph=True)  # two losses on one output
    between = time.perf_counter()
    out.abs().mean().backward()
    for j in range(2):
        for i in range(2):
            spans = [e for e in trace.events if e.kind == "backward" and (e.j, e.i) == (j, i)]
            assert len(spans) == 2, (j, i)
            assert sum(e.end <= between for e in spans) == 1


def test_a_trace_is_a_dataclass_that_asdict_and_astuple_take() -> None:
    import dataclasses

    trace = Trace(2)
    trace.events.append(CellEvent(0, 0, "forward", 0.0, 1.0, "worker-0"))
    assert dataclasses.asdict(trace)["events"][0]["kind"] == "forward"
    assert dataclasses.astuple(trace)[0] == 2
