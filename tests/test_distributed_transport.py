"""Transports: LocalTransport between threads, ProcessGroupTransport between processes.

The LocalTransport tests run in this process, most of them on one thread: a send never
waits for its receiver. One test starts two processes joined by gloo, to send messages
of every shape over ProcessGroupTransport.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import mlp, run_threads, spawn
from torch import Tensor

from torchgpipe.distributed import (
    LocalTransport,
    PipelineStage,
    ProcessGroupTransport,
    TransportError,
)
from torchgpipe.distributed.groups import backends_of
from torchgpipe.distributed.transport import Transfer
from torchgpipe.distributed.wire import filled, pack, packed_size, shell, unpack

# LocalTransport


def test_local_transport_keeps_the_order_of_each_peers_messages() -> None:
    def rank(transport: LocalTransport) -> Any:
        if transport.rank < 2:  # ranks 0 and 1 both send to rank 2, in turns
            for k in range(20):
                transport.send(2, (transport.rank, k), [torch.tensor([transport.rank, k])])
            transport.send(1 - transport.rank, "between 0 and 1", [])
            return transport.recv(1 - transport.rank)
        # Rank 1's messages first, although rank 0's may have come in between.
        return [transport.recv(1) for _ in range(20)], [transport.recv(0) for _ in range(20)]

    out = run_threads(rank, 3, timeout=10.0)
    assert out[0] == ("between 0 and 1", [])
    assert out[1] == ("between 0 and 1", [])
    for sender, messages in zip((1, 0), out[2], strict=True):
        assert [header for header, _ in messages] == [(sender, k) for k in range(20)]
        for k, (_, tensors) in enumerate(messages):
            assert len(tensors) == 1
            assert torch.equal(tensors[0], torch.tensor([sender, k]))


def test_local_transport_copies_tensors_on_the_way() -> None:
    t0, t1 = LocalTransport.mesh(2)
    sent = torch.ones(2, 3, requires_grad=True)
    view = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    t0.send(1, "copies", [sent, view])
    with torch.no_grad():
        sent.mul_(5)
    view.zero_()
    header, (a, b) = t1.recv(0)
    assert header == "copies"
    assert torch.equal(a, torch.ones(2, 3))
    assert torch.equal(b, torch.arange(12.0).reshape(3, 4).t())
    assert not a.requires_grad
    assert a.grad_fn is None
    assert a.untyped_storage().data_ptr() != sent.untyped_storage().data_ptr()
    b.fill_(7)  # and the receiver's copy is its own
    assert view.sum() == 0


def test_local_transport_round_trips_a_nested_header_of_plain_values() -> None:
    t0, t1 = LocalTransport.mesh(2)
    header = {
        "key": ("F", 3, 1),
        "leaves": [None, 2.5, "text", b"bytes", True, -7],
        "nested": {"deep": [{"range": range(3), "slice": slice(1, None, 2)}]},
        "dtype": torch.bfloat16,
        "shape": torch.Size([2, 0, 3]),
        "set": frozenset({1, 2}),
    }
    t0.send(1, header, [])
    t0.send(1, None, [torch.zeros(())])
    assert t1.recv(0) == (header, [])
    received, tensors = t1.recv(0)
    assert received is None
    assert len(tensors) == 1
    assert tensors[0].shape == ()


def test_local_transport_refuses_a_header_that_could_not_cross_processes() -> None:
    t0, t1 = LocalTransport.mesh(2, timeout=0.05)
    with pytest.raises(TypeError, match="pickle"):
        t0.send(1, {"lock": threading.Lock()}, [])
    with pytest.raises(TransportError):  # nothing was queued
        t1.recv(0)


def test_local_transport_close_makes_the_peers_fail_to_reach_the_rank() -> None:
    t0, t1, t2 = LocalTransport.mesh(3, timeout=10.0)
    t1.send(0, "last words", [torch.ones(1)])
    t1.close()
    header, tensors = t0.recv(1)  # what was sent before closing still arrives first
    assert header == "last words"
    assert torch.equal(tensors[0], torch.ones(1))
    with pytest.raises(TransportError, match="rank 1 closed its transport"):
        t0.recv(1)
    with pytest.raises(TransportError, match="rank 1 closed its transport"):
        t0.send(1, "anyone?", [])
    with pytest.raises(TransportError, match="rank 1 closed its transport"):
        t1.send(2, "from beyond", [])
    with pytest.raises(TransportError, match="rank 1 closed its transport"):
        t1.recv(2)
    t2.send(0, "the others go on", [])
    assert t0.recv(2) == ("the others go on", [])


def test_local_transport_close_wakes_a_peer_waiting_in_recv() -> None:
    t0, t1 = LocalTransport.mesh(2, timeout=10.0)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            t0.recv(1)
        except BaseException as error:
            caught.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    start = time.monotonic()
    waiter.start()
    t1.close()
    waiter.join(timeout=10.0)
    assert not waiter.is_alive()
    assert len(caught) == 1
    assert isinstance(caught[0], TransportError)
    assert "rank 1 closed its transport" in str(caught[0])
    assert time.monotonic() - start < 5.0  # woken by the close, not by the timeout


def test_local_transport_recv_from_a_closed_peer_fails_at_once_every_time() -> None:
    t0, t1 = LocalTransport.mesh(2, timeout=0.2)
    t1.close()
    for _ in range(2):
        with pytest.raises(TransportError, match="rank 1 closed its transport"):
            t0.recv(1)


def test_local_transport_close_wakes_the_closing_ranks_own_recv() -> None:
    t0, _ = LocalTransport.mesh(2, timeout=0.5)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            t0.recv(1)
        except BaseException as error:
            caught.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    t0.close()
    waiter.join(timeout=5.0)
    assert len(caught) == 1
    assert "rank 0 closed its transport" in str(caught[0])


def test_local_transport_recv_times_out_naming_both_ranks() -> None:
    _, t1, _ = LocalTransport.mesh(3, timeout=0.05)
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"rank 2 sent nothing to rank 1 in 0\.05 s"):
        t1.recv(2)
    assert time.monotonic() - start < 5.0


def test_local_transport_pair_that_timed_out_is_given_up_both_ways() -> None:
    # As gloo's: a message sent late was read by the next step's listener as its own.
    t0, t1 = LocalTransport.mesh(2, timeout=0.05)
    with pytest.raises(TransportError, match="sent nothing"):
        t1.recv(0)
    with pytest.raises(TransportError, match="ranks 0 and 1 gave their connection up"):
        t0.send(1, "late", [])
    with pytest.raises(TransportError, match="ranks 1 and 0 gave their connection up"):
        t1.issue([Transfer("send", 0, torch.zeros(1, dtype=torch.uint8))])


def test_local_transport_mesh_gives_one_connected_transport_per_rank() -> None:
    transports = LocalTransport.mesh(4, timeout=1.5)
    assert [t.rank for t in transports] == [0, 1, 2, 3]
    assert all(t.world_size == 4 for t in transports)
    assert all(t.device == torch.device("cpu") for t in transports)
    assert all(t.timeout == 1.5 for t in transports)
    (single,) = LocalTransport.mesh(1)
    assert (single.rank, single.world_size) == (0, 1)


@pytest.mark.parametrize(
    "world_size",
    [
        0,
        -2,
        1.5,
        "2",
        None,
        True,
    ],
)
def test_local_transport_mesh_rejects_a_bad_world_size(world_size: Any) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got"):
        LocalTransport.mesh(world_size)


@pytest.mark.parametrize(
    "timeout",
    [
        0,
        -1.0,
        float("nan"),
    ],
)
def test_local_transport_mesh_rejects_a_bad_timeout(timeout: float) -> None:
    with pytest.raises(
        ValueError, match="timeout must be a finite positive number of seconds, got"
    ):
        LocalTransport.mesh(2, timeout=timeout)


def test_local_transfers_match_in_issue_order_and_refuse_another_size() -> None:
    seen: list[Any] = []
    t0, t1 = LocalTransport.mesh(2, timeout=0.5, observe=lambda *group: seen.append(group))
    first, second = torch.arange(4, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    t0.issue([Transfer("send", 1, first), Transfer("send", 1, second)])
    a, b = torch.empty(4, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)
    wait_a, wait_b = t1.issue([Transfer("recv", 0, a), Transfer("recv", 0, b)])
    wait_b.wait()  # fills the earlier receive first, as NCCL matches in order
    assert torch.equal(a, first)
    assert torch.equal(b, second)
    wait_a.wait()
    assert seen == [(0, [(1, "send", 4), (1, "send", 8)]), (1, [(0, "recv", 4), (0, "recv", 8)])]
    t0.issue([Transfer("send", 1, first)])
    (wrong,) = t1.issue([Transfer("recv", 0, torch.empty(5, dtype=torch.uint8))])
    with pytest.raises(RuntimeError, match="received 4 bytes from rank 0 into a buffer of 5"):
        wrong.wait()


def test_local_transfer_from_a_closed_or_silent_peer_raises() -> None:
    t0, t1 = LocalTransport.mesh(2, timeout=0.05)
    (silent,) = t1.issue([Transfer("recv", 0, torch.empty(1, dtype=torch.uint8))])
    with pytest.raises(TransportError, match=r"sent no transfer to rank 1 in 0\.05 s"):
        silent.wait()
    t0, t1 = LocalTransport.mesh(2, timeout=5.0)
    (waiting,) = t1.issue([Transfer("recv", 0, torch.empty(1, dtype=torch.uint8))])
    t0.close()
    with pytest.raises(TransportError, match="rank 0 closed its transport"):
        waiting.wait()


def test_pack_and_unpack_round_trip_every_kind_of_tensor() -> None:
    tensors = _messages()[0][1]
    layout = [(tuple(t.shape), t.dtype) for t in tensors]
    buffer = pack(tensors, torch.device("cpu"))
    assert buffer is not None
    assert buffer.numel() == packed_size(layout)
    for got, want in zip(unpack(buffer, layout, torch.device("cpu")), tensors, strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert pack([torch.empty(0)], torch.device("cpu")) is None


def test_pack_sends_the_values_of_conjugate_and_negative_views() -> None:
    # Regression: the byte view of a conjugate view (z.conj()) raised, and so did that
    # of a negative view that is contiguous.
    h = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    z = torch.complex(h, 2 * h).conj()
    # z.imag is a negative view that is not contiguous; torch._neg_view(h) one that is.
    tensors = [z, z.imag, torch._neg_view(h), z.t()]
    assert [z.is_conj(), z.imag.is_neg(), tensors[2].is_neg()] == [True, True, True]
    layout = [(tuple(t.shape), t.dtype) for t in tensors]
    buffer = pack(tensors, torch.device("cpu"))
    for got, want in zip(unpack(buffer, layout, torch.device("cpu")), tensors, strict=True):
        assert [got.is_conj(), got.is_neg()] == [False, False]
        assert torch.equal(got, want.resolve_conj().resolve_neg())


def test_pack_refuses_a_sparse_tensor_saying_what_to_do() -> None:
    # Regression: torch's own "unsupported memory format option Contiguous".
    with pytest.raises(
        TypeError,
        match=r"a tensor of layout torch.sparse_coo \(shape \[3, 3\]\) cannot pass between "
        r"stages on different processes, only dense ones: return it dense from its stage "
        r"\(.to_dense\(\)\)",
    ):
        pack([torch.eye(3), torch.eye(3).to_sparse()], torch.device("cpu"))


class _Tagged(dict[str, Any]):
    """A dict subclass with an attribute: its rest carries a template."""

    tag: Any = None


def _tagged(tensor: Tensor, tag: Any) -> _Tagged:
    value = _Tagged(x=tensor)
    value.tag = tag
    return value


def test_shell_and_filled_rebuild_each_value_as_it_was() -> None:
    # Values that compare equal but are not the same come back as sent: leaves, dict
    # keys and attributes (a cache of pickled rests keyed by equality would break this).
    t = torch.ones(2, requires_grad=True)
    values: list[Any] = [
        t,
        t.detach(),
        [t],  # an activation and a gradient: their bodies made once
        [t.detach()],
        (t,),
        [t, t],
        [None],
        {"a": t, "b": (t, t.detach())},
        (t, 1),
        (t, True),  # equal to (t, 1), pickles otherwise
        {1: t},
        {True: t},
        (t, 0.0),
        (t, -0.0),
        _tagged(t, "first"),
        _tagged(t, "second"),  # equal specs: the template is not compared
    ]
    for _ in range(2):  # alike the second time
        for value in values:
            tensors, body = shell(value)
            got = filled(body, [x.detach() for x in tensors])
            _assert_same_structure(got, value)
    tensors, body = shell({"a": t, "b": (t, t.detach())})
    assert len(tensors) == 2  # t travels once
    got = filled(body, [x.detach() for x in tensors])
    assert got["a"] is got["b"][0]
    assert got["a"].requires_grad
    assert not got["b"][1].requires_grad


def test_a_leaf_object_filled_twice_is_two_objects() -> None:
    # A layer may change a leaf it gets: two messages never share one.
    leaf = [0]
    value = (torch.ones(1), {"state": _Box(leaf)})
    tensors, body = shell(value)
    first = filled(body, tensors)
    first[1]["state"].items.append(1)
    second = filled(body, tensors)
    assert second[1]["state"].items == [0]


class _Box:
    def __init__(self, items: list[int]) -> None:
        self.items = items


def _assert_same_structure(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, Tensor):
        assert torch.equal(got, want)
        assert got.requires_grad == want.requires_grad
    elif isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want]
        for k in want:
            _assert_same_structure(got[k], want[k])
        assert getattr(got, "tag", None) == getattr(want, "tag", None)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same_structure(a, b)
    else:
        assert repr(got) == repr(want)  # -0.0 and 0.0 differ here


# ProcessGroupTransport, between two processes


def _messages() -> list[tuple[Any, list[Tensor]]]:
    """What rank 0 sends rank 1, built the same in both processes."""
    g = torch.Generator().manual_seed(0)
    big = {
        "name": "a header that does not fit in the first transfer " * 10,
        "numbers": list(range(100)),
        "nested": {"deep": [("x", 1.5, None)] * 5},
    }
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randn(2, 2, generator=g, dtype=torch.float64),
        torch.randint(-(2**40), 2**40, (7,), generator=g),
        torch.randn(3, 3, generator=g) > 0,
        torch.randn(5, generator=g).to(torch.bfloat16),  # 10 bytes: the next is unaligned
        torch.tensor(3.25),  # 0-dim
        torch.empty(0, 3),
        torch.arange(24.0).reshape(4, 6)[:, ::2].t(),  # not contiguous, offset strides
        torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
    ]
    messages: list[tuple[Any, list[Tensor]]] = [
        (big, tensors),
        ("no tensors", []),
        (("only empty ones",), [torch.empty(0), torch.empty(2, 0, dtype=torch.int64)]),
        (None, [torch.tensor(True)]),
    ]
    # Headers of every size around the first transfer's 512 bytes (with what else it
    # carries, the pickled header crosses the limit at k = 453 or so).
    messages += [("x" * k, [torch.full((1,), float(k))]) for k in range(430, 480)]
    return messages


def _round_trip_rank(rank: int, world: int) -> list[Any]:
    transport = ProcessGroupTransport()
    out: list[Any] = [[transport.rank, transport.world_size, str(transport.device)]]
    if rank == 0:
        for header, tensors in _messages():
            transport.send(1, header, tensors)
    else:
        received = [transport.recv(0) for _ in _messages()]
        out.append([[t.is_contiguous() for t in tensors] for _, tensors in received])
        # A message's tensors are views of one byte buffer, as different dtypes, which
        # torch.save refuses to write together: send back copies.
        out.append([(header, [t.clone() for t in tensors]) for header, tensors in received])
    # A gloo send returns before its receiver has read it, and a rank leaves with
    # os._exit: without this, rank 0 may be gone before rank 1 read its last messages.
    dist.barrier()
    return out


@pytest.mark.distributed
def test_process_group_transport_round_trips_headers_and_tensors_of_every_kind() -> None:
    results = spawn(_round_trip_rank, 2)
    assert results[0] == [[0, 2, "cpu"]]
    assert results[1][0] == [1, 2, "cpu"]
    assert all(all(flags) for flags in results[1][1])  # received contiguous
    received = results[1][2]
    expected = _messages()
    assert len(received) == len(expected)
    for k, ((header, tensors), (want_header, want_tensors)) in enumerate(
        zip(received, expected, strict=True)
    ):
        assert header == want_header, k
        assert len(tensors) == len(want_tensors), k
        for got, want in zip(tensors, want_tensors, strict=True):
            assert got.dtype == want.dtype, (k, want.dtype)
            assert got.shape == want.shape, (k, want.shape)
            assert got.device == torch.device("cpu")
            assert torch.equal(got, want), (k, want)


def _transfers_rank(rank: int, world: int) -> dict[str, Any]:
    side = dist.new_group([0, 1], backend="gloo")
    lone = dist.new_group([0], backend="gloo")
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            ProcessGroupTransport(side_group=lone)
        except ValueError as error:
            out["refused"] = str(error)
    transport = ProcessGroupTransport(side_group=side)
    sets = (_messages()[0][1], [torch.arange(5.0) * 2])
    mine = sets[rank]
    theirs = [(tuple(t.shape), t.dtype) for t in sets[1 - rank]]
    buffer = pack(mine, transport.wire)
    assert buffer is not None
    incoming = torch.empty(packed_size(theirs), dtype=torch.uint8)
    # Both ranks send to each other in one group: no hang.
    works = transport.issue(
        [Transfer("send", 1 - rank, buffer), Transfer("recv", 1 - rank, incoming)]
    )
    for work in works:
        work.wait()
    out["received"] = [t.clone() for t in unpack(incoming, theirs, torch.device("cpu"))]
    transport.send(1 - rank, ("side", rank), [])  # the side channel on the group given
    out["side"] = transport.recv(1 - rank)[0]
    dist.barrier()
    return out


@pytest.mark.distributed
def test_process_group_transport_transfers_a_group_both_ways_and_takes_a_side_group() -> None:
    results = spawn(_transfers_rank, 2)
    refused = results[0]["refused"]
    assert "side_group must be a gloo group of the pipeline's processes" in refused
    assert "(global ranks [0, 1]), got a gloo group of global ranks [0]" in refused
    for got, want in zip(results[1]["received"], _messages()[0][1], strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    torch.testing.assert_close(results[0]["received"][0], torch.arange(5.0) * 2)
    assert results[0]["side"] == ("side", 1)
    assert results[1]["side"] == ("side", 0)


def _configured_rank(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group([0, 1], backend="cpu:gloo")  # named by that string
    ProcessGroupTransport(side_group=dist.new_group([0, 1], backend="cpu:gloo"))  # taken
    transport = ProcessGroupTransport(group)
    return {
        "backend": transport.backend,
        "wire": str(transport.wire),
        "side": transport.side_group is group,
    }


@pytest.mark.distributed
def test_process_group_transport_reads_a_groups_backends_from_its_configuration() -> None:
    # A group named "cpu:gloo" (or "undefined", made without a backend) was taken for
    # neither gloo nor NCCL: a side group made anew, the transfers through torch's checks.
    assert spawn(_configured_rank, 2) == [{"backend": "gloo", "wire": "cpu", "side": True}] * 2


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("cpu:gloo", {"cpu": "gloo"}),
        ("nccl", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ],
)
def test_backends_of_reads_which_backend_moves_each_device(
    config: str, expected: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "get_backend_config", lambda group: config)
    assert backends_of(object()) == expected


def _outside_rank(rank: int, world: int) -> dict[str, Any]:
    pair = dist.new_group([0, 1])  # every process makes it; rank 2 is not in it
    out: dict[str, Any] = {}
    if rank == 2:
        for case, arguments in [("group", {"group": pair}), ("side_group", {"side_group": pair})]:
            try:
                ProcessGroupTransport(**arguments)
            except ValueError as error:
                out[case] = str(error)
        try:  # a stage builds its transport first: the same error
            PipelineStage(mlp(), [4, 4], group=pair)
        except ValueError as error:
            out["stage"] = str(error)
    else:
        transport = ProcessGroupTransport(pair)  # its members are unaffected
        out["rank"] = (transport.rank, transport.world_size)
    return out


@pytest.mark.distributed
def test_process_group_transport_refuses_a_group_this_process_is_not_in() -> None:
    # Regression: a process outside the group failed deep inside torch.distributed with
    # "Invalid process group specified", naming neither the process nor the fix.
    results = spawn(_outside_rank, 3, timeout=30.0)
    assert results[0] == {"rank": (0, 2)}
    assert results[1] == {"rank": (1, 2)}
    for case in ("group", "side_group"):
        text = results[2][case]
        assert text.startswith(
            f"this process (global rank 2) is not in the process group given as {case}=; "
            f"pass a group that includes it"
        ), text
        assert "the one of its own pipeline, or leave it out" in text
    assert results[2]["stage"] == results[2]["group"]


def _after_the_ends(
    rank: int,
    world: int,
    ends: dict[int, Any],
    lost: dict[int, str],
    given_up: set[int] | None = None,
) -> Any:
    """An exchange holding only the bookkeeping ``remote_failure`` reads, after a halt."""
    from torchgpipe.distributed.exchange import Exchange

    exchange = Exchange.__new__(Exchange)
    exchange.rank, exchange.stages = rank, [(r,) for r in range(world)]
    exchange.tag, exchange.halted = "start", True
    exchange.ends, exchange.lost, exchange.given_up = ends, lost, given_up or set()
    exchange.transport = SimpleNamespace(global_ranks=None)  # the group is every process
    return exchange


def test_a_peer_lost_after_its_end_came_is_not_the_cause_of_a_failure() -> None:
    # A rank that ended its step may exit at once; a rank still draining then finds it
    # unreachable. The cause to report is the rank that died in the step (rank 1), not
    # the lower rank that ended well and left (rank 0).
    status = {"failed": True, "error": None, "lost": {1: "died"}, "tag": "start"}
    exchange = _after_the_ends(
        2, 3, {0: (status, [])}, {0: "closed its transport", 1: "died or cannot be reached"}
    )
    failure = exchange.remote_failure()
    assert failure is not None
    assert failure.rank == 1
    assert "rank 1 (stages [1]) died or cannot be reached" in str(failure)


def test_a_peer_lost_before_its_end_came_is_not_the_cause_where_others_lost_another() -> None:
    # Rank 0 ended on rank 1's death and exited before its end reached rank 3: rank 3
    # lost both, rank 2 (whose end came) lost rank 1 only. The one the most ranks lost,
    # rank 1, is the cause (the lower rank was reported now and then: a flaky CI run).
    status = {"failed": True, "error": None, "lost": {1: "died"}, "tag": "start"}
    exchange = _after_the_ends(
        3, 4, {2: (status, [])}, {0: "closed its transport", 1: "died or cannot be reached"}
    )
    failure = exchange.remote_failure()
    assert failure is not None
    assert failure.rank == 1


def test_a_peer_only_given_up_as_mute_is_not_the_cause_where_another_was_lost() -> None:
    # Rank 1 died between steps and rank 0's connections stalled (gloo's event loop
    # spinning): ranks 2 and 3 each lost rank 1 and gave up on rank 0, as many losses
    # each. The cause is rank 1, which they lost for a reason.
    lost = {0: "sent no end", 1: "died or cannot be reached"}
    status = {"failed": True, "error": None, "lost": lost, "given_up": [0], "tag": "start"}
    exchange = _after_the_ends(2, 4, {3: (status, [])}, dict(lost), given_up={0})
    failure = exchange.remote_failure()
    assert failure is not None
    assert failure.rank == 1
    assert "rank 1 (stages [1]) died or cannot be reached" in str(failure)
    exchange.given_up, status["given_up"] = set(), []  # both lost for a cause: the lower
    assert exchange.remote_failure().rank == 0


def test_the_reason_of_a_loss_for_a_cause_is_told_over_that_of_giving_up() -> None:
    # Rank 2 gave up the dead rank 1 (its receive stalled) and mute rank 0; rank 3's end
    # says it lost rank 1 for a cause: rank 1 is named, with rank 3's reason.
    from torchgpipe.distributed.errors import first_failure

    stages = [(0,), (1,), (2,), (3,)]
    mine = {0: "sent no end", 1: "sent no end"}
    theirs = {"failed": True, "error": None, "lost": {1: "died or cannot be reached"}}
    failure = first_failure(2, stages, {3: (theirs, [])}, mine, {0, 1})
    assert failure is not None
    assert failure.rank == 1
    assert str(failure) == "rank 1 (stages [1]) died or cannot be reached"


def test_of_peers_lost_alike_the_one_lost_first_is_the_cause() -> None:
    # Rank 1 died; rank 0 then failed its step over it and its process ended, so rank 2
    # lost rank 0 too, later. Rank 3 lost neither (it halted on rank 2's end first): one
    # loss each, and rank 0, the lower, was named though alive when the step failed.
    from torchgpipe.distributed.errors import first_failure

    stages = [(0,), (1,), (2,), (3,)]
    mine = {1: "died or cannot be reached", 0: "died or cannot be reached"}
    theirs = {"failed": True, "error": None, "lost": {}, "given_up": []}
    failure = first_failure(2, stages, {3: (theirs, [])}, mine, set())
    assert failure is not None
    assert failure.rank == 1


class _Work:
    def __init__(self, fails: bool) -> None:
        self.fails, self.waited = fails, False

    def wait(self) -> None:
        self.waited = True
        if self.fails:
            raise RuntimeError("Connection closed by peer")


def test_flush_waits_for_every_send_after_one_failed() -> None:
    # gloo drops a send whose work goes unwaited: a dead peer's failure lost the live
    # peers' ends of the step, and they named a live rank dead.
    from torchgpipe.distributed.transport import ProcessGroupTransport

    transport = object.__new__(ProcessGroupTransport)
    transport.rank = 0
    works = [_Work(True), _Work(False), _Work(False)]
    empty = torch.empty(0, dtype=torch.uint8)
    transport._pending = [(work, empty, peer) for peer, work in enumerate(works, 1)]
    with pytest.raises(TransportError, match="rank 0 could not send to rank 1") as info:
        transport.flush()
    assert info.value.peer == 1
    assert [w.waited for w in works] == [True, True, True]


class _Stalled:
    """A send to a live peer that posts no receive: its wait returns once released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def wait(self) -> None:
        self.released.wait()


def test_flush_after_a_failed_send_waits_for_a_stalled_peer_a_grace_at_most() -> None:
    # Else a live but stalled peer held the rank until the process group's timeout.
    from torchgpipe.distributed.transport import ProcessGroupTransport

    transport = object.__new__(ProcessGroupTransport)
    transport.rank = 0
    stalled = _Stalled()
    empty = torch.empty(0, dtype=torch.uint8)
    transport._pending = [(_Work(True), empty, 1), (stalled, empty, 2)]
    start = time.monotonic()
    with pytest.raises(TransportError, match="rank 0 could not send to rank 1"):
        transport.flush(0.1)
    assert time.monotonic() - start < 5.0
    stalled.released.set()


def test_of_peers_lost_by_two_ranks_in_two_orders_every_rank_names_one() -> None:
    # Ranks 2 and 3 died together; rank 0 lost 3 first, rank 1 lost 2 first, and each
    # got the other's end: by each rank's own order alone, they named different ranks.
    from torchgpipe.distributed.errors import first_failure

    stages = [(0,), (1,), (2,), (3,)]
    why = "died or cannot be reached"
    named = []
    for rank, mine in ((0, [3, 2]), (1, [2, 3])):
        theirs = {"failed": True, "error": None, "lost": {p: why for p in mine[::-1]}}
        failure = first_failure(
            rank, stages, {1 - rank: (theirs, [])}, dict.fromkeys(mine, why), set()
        )
        assert failure is not None
        named.append(failure.rank)
    assert named == [2, 2]


def test_losses_after_a_ranks_end_do_not_order_its_choice_apart_from_the_others() -> None:
    # Ranks 2 and 3 died after ranks 0 and 1 sent their ends (no loss told): rank 0 then
    # lost 2 before 3, rank 1 3 before 2; by their own orders they named two ranks.
    from torchgpipe.distributed.errors import first_failure

    stages = [(0,), (1,), (2,), (3,)]
    why = "died or cannot be reached"
    named = []
    for rank, mine in ((0, [2, 3]), (1, [3, 2])):
        theirs = {"failed": True, "error": None, "lost": {}}
        lost = dict.fromkeys(mine, why)
        failure = first_failure(rank, stages, {1 - rank: (theirs, [])}, lost, set(), told={})
        assert failure is not None
        named.append(failure.rank)
    assert named == [2, 2]


def test_a_peer_lost_after_its_end_came_is_the_cause_when_no_other_is() -> None:
    # Rank 0 sent its end, then died while its last transfers were under way: the
    # others' step halted for that loss alone, which names it.
    status = {"failed": False, "error": None, "lost": {}, "tag": "start"}
    exchange = _after_the_ends(1, 3, {0: (status, [])}, {0: "died or cannot be reached"})
    failure = exchange.remote_failure()
    assert failure is not None
    assert failure.rank == 0
