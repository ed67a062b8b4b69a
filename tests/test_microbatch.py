import dataclasses
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.microbatch import flatten, gather, leaf_paths, map_tensors, scatter, unflatten

Pair = namedtuple("Pair", ["a", "b"])


def _equal(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, list | tuple):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))  # type: ignore[arg-type]
    if isinstance(x, dict):
        return type(x) is type(y) and list(x) == list(y) and all(_equal(x[k], y[k]) for k in x)  # type: ignore[union-attr]
    return x == y


def test_flatten_unflatten_keeps_containers_and_types() -> None:
    value = {"x": (torch.ones(2), [None, 3]), "p": Pair(torch.zeros(2), "s"), "o": OrderedDict(k=1)}
    leaves, spec = flatten(value)
    assert len(leaves) == spec.num_leaves == 6
    rebuilt = unflatten(leaves, spec)
    assert _equal(rebuilt, value)
    assert type(rebuilt["p"]) is Pair
    assert type(rebuilt["o"]) is OrderedDict


class Tagged(list):  # type: ignore[type-arg]
    """A list subclass whose constructor does not take the items."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag


def test_container_subclasses_keep_their_type_and_state() -> None:
    d: defaultdict[str, object] = defaultdict(list, x=torch.ones(4))
    c = Counter(a=torch.ones(4))
    t = Tagged("t")
    t.extend([torch.zeros(4), 1])
    leaves, spec = flatten((d, c, t))
    assert len(leaves) == 4
    rebuilt_d, rebuilt_c, rebuilt_t = unflatten(leaves, spec)
    assert type(rebuilt_d) is defaultdict
    assert rebuilt_d.default_factory is list
    assert rebuilt_d["missing"] == []  # the factory still works
    assert type(rebuilt_c) is Counter
    assert torch.equal(rebuilt_c["a"], torch.ones(4))  # not added to a count
    assert type(rebuilt_t) is Tagged
    assert rebuilt_t.tag == "t"
    assert len(rebuilt_t) == 2
    assert rebuilt_t[1] == 1
    assert len(t) == 2  # the original is left as it was


def test_scatter_gather_dict_subclass() -> None:
    d = defaultdict(int, x=torch.arange(6.0))
    batches = scatter(d, 3)
    assert all(type(b) is defaultdict and b.default_factory is int for b in batches)
    assert [b["x"].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    gathered = gather(batches)
    assert type(gathered) is defaultdict
    assert torch.equal(gathered["x"], torch.arange(6.0))


def test_unflatten_wrong_number_of_leaves() -> None:
    _, spec = flatten((1, 2))
    with pytest.raises(ValueError, match="fewer leaves"):
        unflatten([1], spec)
    with pytest.raises(ValueError, match="more leaves"):
        unflatten([1, 2, 3], spec)


def test_scatter_tensor_balanced_sizes() -> None:
    batches = scatter(torch.arange(10), 4)
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_scatter_fewer_chunks_when_batch_is_small() -> None:
    assert len(scatter(torch.zeros(3, 2), 8)) == 3


def test_scatter_nested_keeps_non_tensor_leaves() -> None:
    value = {"x": torch.arange(4), "opts": [None, 7, "mode", True], "pair": (torch.ones(4, 2),)}
    batches = scatter(value, 2)
    assert len(batches) == 2
    for i, batch in enumerate(batches):
        assert batch["opts"] == [None, 7, "mode", True]
        assert batch["x"].tolist() == [2 * i, 2 * i + 1]
        assert batch["pair"][0].shape == (2, 2)


def test_scatter_rejects_0_dim_leaf_by_name() -> None:
    with pytest.raises(ValueError, match=r"0-dim tensor.*input\['scale'\]"):
        scatter({"x": torch.zeros(4), "scale": torch.tensor(2.0)}, 2)


def test_scatter_rejects_mismatched_batch_sizes_by_name() -> None:
    with pytest.raises(ValueError, match=r"input\[0\] has 4 but input\[1\]\[0\] has 3"):
        scatter((torch.zeros(4), [torch.zeros(3)]), 2)


def test_scatter_rejects_input_without_tensors() -> None:
    with pytest.raises(TypeError, match="holds no tensor"):
        scatter((1, "a"), 2)


def test_scatter_rejects_empty_batch() -> None:
    with pytest.raises(ValueError, match="empty"):
        scatter(torch.zeros(0, 3), 2)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_forward_mode_tangent_is_refused_not_lost() -> None:
    from torch.autograd import forward_ad

    # The cells cut their inputs apart: the output's tangent came out None, silently.
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)
    x = torch.randn(4, 2)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match=r"input carries a forward-mode tangent"):
            pipe(dual)
        with pytest.raises(NotImplementedError, match=r"\['x'\]"):
            scatter({"x": dual, "y": x}, 2)
        assert pipe(x).shape == (4, 2)  # a plain input under a dual level passes


def test_a_sparse_input_is_refused_with_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"input\['x'\] \(torch.sparse_coo\); pass them dense"):
        scatter({"x": torch.eye(4).to_sparse()}, 2)


class _Pair(tuple):  # type: ignore[type-arg]
    def __new__(cls, a: object, b: object) -> "_Pair":
        return super().__new__(cls, (a, b))


def test_a_tuple_subclass_that_cannot_be_rebuilt_says_so() -> None:
    leaves, spec = flatten(_Pair(torch.ones(1), torch.zeros(1)))
    with pytest.raises(TypeError, match=r"a _Pair \(a subclass of tuple\) could not be rebuilt"):
        unflatten(leaves, spec)


def test_a_pipeline_inside_a_torch_func_transform_is_refused_with_what_to_do() -> None:
    # It failed deep in a cell, in torch's words about requires_grad_.
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)
    params = dict(pipe.named_parameters())
    x = torch.randn(4, 2)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(pipe, p, (x,)).sum()

    with pytest.raises(NotImplementedError, match=r"inside a torch.func transform"):
        torch.func.grad(loss)(params)
    assert pipe(x).shape == (4, 2)  # outside one, as ever


def test_gather_concatenates_in_order() -> None:
    out = gather([(torch.tensor([1]), "a"), (torch.tensor([2, 3]), "a")])
    assert out[0].tolist() == [1, 2, 3]
    assert out[1] == "a"


def test_gather_rejects_0_dim_output() -> None:
    with pytest.raises(ValueError, match=r"output\[1\] is a 0-dim tensor"):
        gather([(torch.ones(1), torch.tensor(1.0)), (torch.ones(1), torch.tensor(2.0))])


def test_gather_rejects_different_structures() -> None:
    with pytest.raises(TypeError, match="micro-batch 1 produced an output of a different"):
        gather([(torch.ones(1),), [torch.ones(1)]])


def test_gather_rejects_tensor_in_some_micro_batches_only() -> None:
    with pytest.raises(TypeError, match=r"output\[0\] is a tensor in some"):
        gather([(torch.ones(1),), (None,)])


@dataclass
class Output:
    logits: torch.Tensor
    extra: object = None


@dataclass(frozen=True, slots=True)
class Frozen:
    """Frozen, with slots, and a field that __init__ does not take."""

    h: torch.Tensor
    count: int = field(default=3, init=False)

    def __post_init__(self) -> None:
        if self.h.dim() != 2:  # __post_init__ must not run again on a rebuilt copy
            raise AssertionError("rebuilt through __init__")


def test_flatten_dataclass_by_fields_and_rebuild_same_class() -> None:
    value = [Output(torch.ones(2), {"k": torch.zeros(2)}), Frozen(torch.ones(2, 2))]
    leaves, spec = flatten(value)
    assert len(leaves) == spec.num_leaves == 4
    assert leaf_paths(spec, "input") == [
        "input[0].logits",
        "input[0].extra['k']",
        "input[1].h",
        "input[1].count",
    ]
    rebuilt = unflatten([x * 2 if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    assert type(rebuilt[0]) is Output
    assert type(rebuilt[1]) is Frozen
    assert torch.equal(rebuilt[0].extra["k"], torch.zeros(2))
    assert torch.equal(rebuilt[1].h, torch.full((2, 2), 2.0))
    assert rebuilt[1].count == 3
    assert torch.equal(value[1].h, torch.ones(2, 2))  # the original is left as it was


def test_scatter_then_gather_dataclass_splits_every_field() -> None:
    value = Output(torch.arange(6.0), (torch.arange(6), "tag"))
    batches = scatter(value, 3)
    assert all(type(b) is Output for b in batches)
    assert [b.logits.tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    gathered = gather(batches)
    assert type(gathered) is Output
    assert torch.equal(gathered.logits, torch.arange(6.0))
    assert gathered.extra[1] == "tag"


class Box:
    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class Slotted:
    __slots__ = ("hs",)

    def __init__(self, hs: list[torch.Tensor]) -> None:
        self.hs = hs


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((torch.ones(2), Box(torch.ones(2))), r"input\[1\] is a Box, whose attributes 'h'"),
        ({"k": Slotted([torch.ones(2)])}, r"input\['k'\] is a Slotted, whose attributes 'hs'"),
    ],
)
def test_flatten_rejects_object_holding_tensors_by_path(value: object, message: str) -> None:
    with pytest.raises(TypeError, match=message + r".*tuple, list, dict or dataclass"):
        flatten(value, "input")


def test_flatten_rejects_dataclass_with_tensors_outside_its_fields() -> None:
    @dataclass
    class Cached:
        h: torch.Tensor

        def __post_init__(self) -> None:
            self.cache = self.h * 2

    with pytest.raises(TypeError, match=r"value\[0\] is a dataclass Cached.*'cache'.*not fields"):
        flatten([Cached(torch.ones(2))])


def test_flatten_keeps_objects_without_tensors_as_leaves() -> None:
    box = Box(None)  # type: ignore[arg-type]
    pair = Pair(torch.ones(2), "s")
    leaves, spec = flatten((box, pair))
    assert leaves[0] is box
    assert type(unflatten(leaves, spec)[1]) is Pair


def test_gather_rejects_non_tensor_leaves_that_differ() -> None:
    with pytest.raises(
        ValueError, match=r"output\[1\] is 'a' in micro-batch 0 but 'b' in micro-batch 1"
    ):
        gather([(torch.ones(1), "a"), (torch.ones(1), "b")])


def test_gather_keeps_equal_non_tensor_leaves_nan_and_arrays_included() -> None:
    np = pytest.importorskip("numpy")
    x = torch.ones
    outputs = [(x(1, 2), float("nan"), np.ones(3), np.array([np.nan, 1.0])) for _ in range(3)]
    gathered = gather(outputs)
    assert gathered[1] != gathered[1]  # NaN, kept
    assert (gathered[2] == np.ones(3)).all()
    with pytest.raises(ValueError, match=r"output\[2\] is array"):
        gather([(x(1, 2), 0.0, np.ones(3)), (x(1, 2), 0.0, np.zeros(3))])
    with pytest.raises(ValueError, match=r"output\[1\] is nan in micro-batch 0 but 1.0"):
        gather([(x(1, 2), float("nan")), (x(1, 2), 1.0)])
    with pytest.raises(ValueError, match=r"output\[1\] is array"):
        gather([(x(1, 2), np.ones(3)), (x(1, 2), np.ones(4))])


def test_gather_refuses_one_tensor_returned_by_every_micro_batch() -> None:
    # A layer returning a parameter as it is (h, self.weight): joined along the batch it
    # came out m times (and its gradient counted m times), where the plain model's once.
    weight = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"output\[1\] is one tensor in every micro-batch"):
        gather([(torch.ones(2, 4), weight) for _ in range(3)])
    with pytest.raises(ValueError, match=r"output\[1\] is one tensor in every micro-batch"):
        gather([(torch.ones(2, 4), weight.detach()[:2]) for _ in range(3)])  # one memory
    # A constant expanded along the batch is per-sample values: joined as it is, one
    # sample each too (expand(1, ...) of a cls token leaves it as it is).
    row = torch.arange(4.0)
    joined = gather([row.expand(2, 4), row.expand(3, 4)])
    assert torch.equal(joined, row.expand(5, 4))
    token = torch.randn(1, 1, 4)
    joined = gather([token.expand(1, -1, -1) for _ in range(3)])
    assert torch.equal(joined, token.expand(3, -1, -1))


def test_gather_refuses_sparse_outputs_that_want_a_gradient() -> None:
    # torch.cat of sparse tensors has no backward: the backward failed with a raw
    # NotImplementedError. Without a gradient they are joined.
    parts = [torch.randn(2, 3).to_sparse() for _ in range(2)]
    assert torch.equal(gather(parts).to_dense(), torch.cat([p.to_dense() for p in parts]))
    wanting = [p.requires_grad_() for p in parts]
    with pytest.raises(TypeError, match=r"output is a torch.sparse_coo tensor.*to_dense"):
        gather(wanting)


def test_a_dataclass_field_left_unset_is_not_part_of_the_value() -> None:
    @dataclass
    class Unset:
        x: Tensor
        y: Tensor = field(init=False)

    value = Unset(torch.arange(6.0).reshape(6, 1))
    pieces = scatter(value, 3)
    assert [p.x.shape[0] for p in pieces] == [2, 2, 2]
    assert not hasattr(pieces[0], "y")
    joined = gather(pieces)
    assert torch.equal(joined.x, value.x)
    assert not hasattr(joined, "y")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_a_nested_tensor_input_is_refused_with_what_to_do() -> None:
    # Of the strided layout: tensor_split failed on it with torch's bare message.
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    with pytest.raises(TypeError, match=r"input \(nested\).*to_padded_tensor"):
        scatter(nested, 2)


def test_gather_rejects_object_output_instead_of_keeping_the_first() -> None:
    with pytest.raises(TypeError, match=r"output is a Box"):
        gather([Box(torch.ones(1)), Box(torch.ones(1))])


def test_scatter_names_the_target_in_its_errors() -> None:
    with pytest.raises(ValueError, match=r"0-dim tensor.*: target; give the target .*loss_fn"):
        scatter(torch.tensor(1.0), 2, name="target")
    with pytest.raises(TypeError, match=r"the target holds no tensor.*loss_fn"):
        scatter(1.0, 2, name="target")
    with pytest.raises(ValueError, match=r"of the target .*target\['w'\] has 5"):
        scatter({"y": torch.zeros(6), "w": torch.zeros(5)}, 2, name="target")


def test_map_tensors_leaves_other_leaves() -> None:
    out = map_tensors(lambda x: x + 1, [torch.zeros(1), 5])
    assert out[0].item() == 1
    assert out[1] == 5


nested = st.recursive(
    st.sampled_from(["t", "t2", None, 3, "s"]),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.sampled_from("abc"), children, max_size=3)
    ),
    max_leaves=6,
)


def _build(shape: object, batch: int) -> object:
    if shape == "t":
        return torch.randn(batch)
    if shape == "t2":
        return torch.randn(batch, 2)
    if isinstance(shape, list):
        return [_build(s, batch) for s in shape]
    if isinstance(shape, tuple):
        return tuple(_build(s, batch) for s in shape)
    if isinstance(shape, dict):
        return {k: _build(v, batch) for k, v in shape.items()}
    return shape


@given(shape=nested, batch=st.integers(1, 9), chunks=st.integers(1, 12))
def test_scatter_then_gather_is_identity(shape: object, batch: int, chunks: int) -> None:
    value = ("t", shape)  # at least one tensor leaf
    built = _build(value, batch)
    batches = scatter(built, chunks)
    assert len(batches) == min(chunks, batch)
    assert _equal(gather(batches), built)


class ModelOutput(OrderedDict):  # type: ignore[type-arg]
    """What transformers' ModelOutput does: items mirrored in fields, update() refused."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def update(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"You cannot use ``update`` on a {type(self).__name__} instance.")

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@dataclass
class EncoderOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    attentions: torch.Tensor | None = None


def test_dict_that_is_a_dataclass_is_rebuilt_item_by_item() -> None:
    # Rebuilt by update() before the fix, which ModelOutput refuses.
    h, a = torch.arange(8.0).view(4, 2), torch.ones(4, 3)
    value = EncoderOutput(last_hidden_state=h, attentions=a)
    leaves, spec = flatten(value)
    assert len(leaves) == 2  # the items: the fields mirror them
    rebuilt = unflatten([h * 2, a * 2], spec)
    assert type(rebuilt) is EncoderOutput
    assert list(rebuilt) == ["last_hidden_state", "attentions"]
    assert torch.equal(rebuilt["last_hidden_state"], h * 2)
    assert rebuilt.last_hidden_state is rebuilt["last_hidden_state"]
    assert rebuilt.attentions is rebuilt["attentions"]
    assert rebuilt.hidden_states is None
    assert value.last_hidden_state is h  # the value taken apart is left as it was
    gathered = gather(scatter(value, chunks=2))
    assert type(gathered) is EncoderOutput
    assert _equal(gathered, value)
    assert torch.equal(gathered.attentions, a)


def test_dict_that_is_a_dataclass_passes_between_partitions() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> EncoderOutput:
            return EncoderOutput(last_hidden_state=self.linear(x))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, output: EncoderOutput) -> EncoderOutput:
            assert output.last_hidden_state is not None
            return EncoderOutput(self.linear(output.last_hidden_state), output["last_hidden_state"])

    plain = nn.Sequential(Encoder(), Head())
    x = torch.randn(8, 4)
    expected = plain(x)
    output = GPipe(plain, [1, 1], chunks=2)(x)
    assert type(output) is EncoderOutput
    assert list(output) == list(expected)
    for name in ("last_hidden_state", "hidden_states"):
        torch.testing.assert_close(output[name], expected[name])
        assert getattr(output, name) is output[name]
    assert output.attentions is None


def test_dict_subclasses_are_filled_in_order_with_values_as_they_are() -> None:
    ordered = OrderedDict([("b", torch.ones(2)), ("a", torch.zeros(2))])
    ordered.move_to_end("b")
    counts = Counter({"x": torch.ones(2), "y": -torch.ones(2)})  # negative counts kept
    for value in (ordered, counts):
        leaves, spec = flatten(value)
        assert _equal(unflatten(leaves, spec), value)


def test_a_dict_dataclass_field_that_is_not_an_item_is_refused_by_name() -> None:
    @dataclass
    class Batch(dict):  # type: ignore[type-arg]
        ids: torch.Tensor | None = None

    batch = Batch(ids=torch.arange(4))
    batch["x"] = torch.ones(4)
    with pytest.raises(TypeError, match="'ids' hold tensors but are not among its items"):
        scatter(batch, 2)


@pytest.mark.parametrize("holder", [set, frozenset, deque])
def test_a_set_or_deque_of_tensors_is_refused(holder: type) -> None:
    # Neither split nor given gradients: each micro-batch would get the whole tensor.
    with pytest.raises(TypeError, match=rf"input\[1\] is a {holder.__name__} holding tensors"):
        scatter((torch.ones(4, 2), holder([torch.ones(4, 2)])), 2)


def test_a_set_of_plain_values_passes() -> None:
    (_, tags), _ = scatter((torch.ones(4, 2), {"a", "b"}), 2)
    assert tags == {"a", "b"}


def test_gather_names_an_output_whose_shapes_differ_beyond_the_batch() -> None:
    # A layer that trims padding to its micro-batch's longest sequence, say.
    values = [(torch.ones(2, 5), torch.ones(2)), (torch.ones(2, 7), torch.ones(2))]
    with pytest.raises(
        ValueError, match=r"output\[0\] cannot be joined.*\[2, 5\] torch.float32, \[2, 7\]"
    ):
        gather(values)


def test_gather_refuses_outputs_whose_dtypes_differ_instead_of_promoting_them() -> None:
    # A layer whose output dtype follows its data: the plain model takes one branch for
    # the whole batch, so a joined float64 would be a value it never returns.
    values = [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)]
    with pytest.raises(
        ValueError,
        match=r"output cannot be joined.*torch.float32, \[2, 3\] torch.float64.*one dtype",
    ):
        gather(values)


def test_a_pipeline_refuses_a_layer_whose_output_dtype_follows_its_micro_batch() -> None:
    class Widens(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.double() if bool(x.max() > 10) else x

    model = GPipe(nn.Sequential(nn.Identity(), Widens()), balance=[1, 1], chunks=2)
    x = torch.tensor([[1.0], [1.0], [11.0], [1.0]])
    with pytest.raises(ValueError, match="one dtype"):
        model(x)


def test_flatten_passes_objects_whose_attributes_it_cannot_read_or_holding_modules() -> None:
    class Raises:
        __slots__ = ("value",)

        def __getattr__(self, name: str) -> object:
            raise KeyError(name)  # not an AttributeError

    holder = Box(Raises())  # type: ignore[arg-type]
    layer = Box(nn.Linear(2, 2))  # type: ignore[arg-type]  # a layer's weights are no batch data
    leaves, _ = flatten((torch.ones(2), holder, layer))
    assert leaves[1] is holder
    assert leaves[2] is layer


def test_flatten_looks_into_the_sets_and_deques_of_an_objects_attributes() -> None:
    for held in (deque([torch.ones(2)]), frozenset({torch.ones(2)})):
        with pytest.raises(TypeError, match=r"input\[0\] is a Box, whose attributes 'h'"):
            flatten((Box(held),), "input")  # type: ignore[arg-type]


def test_flatten_of_an_object_holding_a_large_table_or_a_deep_list_stays_cheap() -> None:
    deep: list[object] = []
    for _ in range(5000):  # deeper than Python's recursion allows
        deep = [0, deep]
    table = {f"token {k}": k for k in range(50_000)}
    leaves, _ = flatten((torch.ones(2), Box(table), Box(deep)))  # type: ignore[arg-type]
    assert len(leaves) == 3


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_a_plain_tensor_splits_and_joins_as_the_same_tensor_in_a_tuple_does(chunks: int) -> None:
    x = torch.arange(10.0).view(5, 2)
    pieces = scatter(x, chunks)
    assert isinstance(pieces, list)
    assert _equal(pieces, [piece for (piece,) in scatter((x,), chunks)])
    assert torch.equal(gather(pieces), gather([(p,) for p in pieces])[0])
    scalars = [torch.tensor(float(k)) for k in range(3)]
    assert torch.equal(gather(scalars, stack_scalars=True), torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="output is a 0-dim tensor"):
        gather(scalars)
    with pytest.raises(ValueError, match="micro-batches: input; give the input a batch"):
        scatter(torch.tensor(1.0), chunks)
    with pytest.raises(ValueError, match=r"target is an empty batch \(target has size 0"):
        scatter(torch.empty(0, 2), chunks, name="target")


class _Derived(namedtuple("_Derived", "x doubled")):
    __slots__ = ()

    def __new__(cls, x: Tensor) -> "_Derived":  # the second field derived from the first
        return super().__new__(cls, x, x * 2)


def test_a_named_tuple_with_a_new_of_its_own_is_rebuilt_from_its_fields() -> None:
    # Regression: rebuilt as cls(*fields), through its own __new__, which took one.
    class Make(nn.Module):
        def forward(self, x: Tensor) -> _Derived:
            return _Derived(x)

    class Use(nn.Module):
        def forward(self, pair: _Derived) -> Tensor:
            return pair.x + pair.doubled

    model = GPipe(nn.Sequential(Make(), Use()), [1, 1], chunks=2)
    x = torch.randn(4, 2)
    torch.testing.assert_close(model(x), 3 * x)


def test_an_object_holding_tensors_beside_an_unset_field_is_refused_by_name() -> None:
    # Regression: building the refusal read the unset field: AttributeError.
    class Holder:
        def __init__(self, t: Tensor) -> None:
            self.t = t

    @dataclass
    class Batch:
        x: Tensor
        extra: Holder
        cache: Tensor = field(init=False)

    with pytest.raises(TypeError, match=r"input\.extra is a Holder, whose attributes 't'"):
        scatter(Batch(torch.randn(4, 3), Holder(torch.zeros(4))), 2)


class _Tagged(Tensor):
    unit: str


def test_an_input_whose_subclass_attributes_the_split_drops_is_refused() -> None:
    # Regression: tensor_split dropped them silently (a layer reading x.unit with a
    # default saw the default); a subclass without attributes of its own passes.
    tagged = torch.randn(4, 2).as_subclass(_Tagged)
    tagged.unit = "km"
    with pytest.raises(TypeError, match=r"input\[0\] is a _Tagged whose attributes \['unit'\]"):
        scatter((tagged, torch.ones(4)), 2)
    plain = torch.randn(4, 2).as_subclass(_Tagged)
    assert type(scatter(plain, 2)[0]) is _Tagged


def test_a_parameter_with_flags_or_an_unwrapping_subclass_without_attributes_passes() -> None:
    class Unwrapping(Tensor):  # as torchvision's tv_tensors: operations give plain tensors
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    boxes = torch.randn(4, 2).as_subclass(Unwrapping)
    flagged = nn.Parameter(torch.randn(4, 2))
    flagged._is_hf_initialized = True
    for value in (boxes, flagged):
        assert [p.shape for p in scatter(value, 2)] == [(2, 2), (2, 2)]
    boxes.format = "XYXY"  # which a layer reading it would not find in a piece
    with pytest.raises(TypeError, match=r"attributes \['format'\] do not survive"):
        scatter(boxes, 2)


class _Scaled(namedtuple("_Scaled", "value scale")):
    __slots__ = ()

    def __new__(cls, value: Tensor, scale: float) -> "_Scaled":  # as many as its fields
        return super().__new__(cls, value * scale, scale)


def test_a_named_tuple_is_rebuilt_from_its_values_not_through_its_constructor() -> None:
    # Regression: rebuilt as cls(*values), which a __new__ taking as many arguments as
    # the fields applied again: every split and hand-over scaled the value once more.
    (first, _) = scatter(_Scaled(torch.full((4, 1), 3.0), 2.0), 2)
    torch.testing.assert_close(first.value, torch.full((2, 1), 6.0))


def test_gather_refuses_0_dim_outputs_whose_dtypes_differ_instead_of_promoting_them() -> None:
    values = [torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"output has other dtypes .*torch.float32, torch.float64"):
        gather(values, stack_scalars=True)
