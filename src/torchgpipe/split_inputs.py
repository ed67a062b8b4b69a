"""How a split model takes its input: as ``split``'s example gives it.

One tensor (the forward's first argument), a tuple (its positional arguments) or a dict
(arguments by name); the arguments left out keep their defaults, which the capture
takes as constants.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from torchgpipe.split_stage import InputKind, SplitError

__all__ = ["inputs_of"]


def inputs_of(module: nn.Module, example: Any) -> tuple[InputKind, tuple[str, ...], dict[str, Any]]:
    """How the split model takes its input, the names it fills, and the defaults kept."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    variadic = [stars[p.kind] + p.name for p in parameters if p.kind in stars]
    if variadic:
        raise SplitError(
            f"{type(module).__name__}.forward takes {variadic[0]}; split needs named "
            f"parameters: wrap the module in one whose forward names its arguments"
        )
    kind: InputKind
    if isinstance(example, dict):
        kind, given = "kwargs", list(example)
        unknown = [name for name in given if name not in [p.name for p in parameters]]
        if unknown:
            raise TypeError(f"{type(module).__name__}.forward has no parameters {unknown}")
        given = [p.name for p in parameters if p.name in example]  # in the forward's order
    elif isinstance(example, tuple):
        kind, given = "args", [p.name for p in parameters[: len(example)]]
        if len(example) > len(parameters):
            raise TypeError(
                f"example_input gives {len(example)} positional arguments; "
                f"{type(module).__name__}.forward takes {len(parameters)}"
            )
    else:
        kind, given = "one", [p.name for p in parameters[:1]]
    values = {"kwargs": example, "args": dict(zip(given, example, strict=False))}.get(kind, {})
    nones = [name for name in given if values.get(name, ...) is None]
    if nones:
        raise SplitError(
            f"example_input gives {type(module).__name__}.forward's {nones} as None; split "
            f"traces each argument it is given as a tensor, so code for None cannot be "
            f"captured: leave them out (pass a dict of the other arguments: they keep their "
            f"defaults), or give tensors"
        )
    concrete = {}
    for p in parameters:
        if p.name in given:
            continue
        if p.default is p.empty:
            raise TypeError(
                f"example_input does not give {type(module).__name__}.forward's argument "
                f"{p.name!r}, which has no default; give it (a tuple or dict of arguments)"
            )
        concrete[p.name] = p.default
    return kind, tuple(given), concrete
