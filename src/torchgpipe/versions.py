"""Modules' versions for a load under other paths than the state dict's, put back after.

``load_state_dict`` reads each module's version from the state dict's ``_metadata``,
under the module's path (a module's ``_load_from_state_dict`` may convert an older
version's values). A load hook that finds modules under other paths than the state
dict names (a split model's stages, a checkpoint of torchgpipe 0.0.7) gives each its
version there for the load: in the caller's ``_metadata`` itself, the one object torch
reads from, and so takes them out again once the load ended (:func:`put_versions_back`):
the caller's state dict is left as it came.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["put_versions_back", "set_version", "start_versions"]

_ABSENT = object()  # a path the caller's versions did not have


def start_versions(module: nn.Module, metadata: dict[str, Any] | None) -> None:
    """Begin ``module``'s load from a state dict with ``metadata`` (a hook's first call)."""
    put_versions_back(module)  # of a load that raised: torch skips the post hooks then
    module.__dict__["_added_versions"] = []
    module.__dict__["_metadata_of_load"] = metadata


def set_version(module: nn.Module, path: str, data: Any) -> None:
    """Give the module at ``path`` the version ``data`` for the load (None: none)."""
    metadata = module.__dict__["_metadata_of_load"]
    module.__dict__["_added_versions"].append((path, metadata.get(path, _ABSENT)))
    if data is None:
        metadata.pop(path, None)
    else:
        metadata[path] = data


def put_versions_back(module: nn.Module, *args: Any) -> None:
    """Leave the versions of the state dict a load was given as they came.

    After the load (a post hook); where it raised (torch skips the hooks then) as
    ``GPipe.load_state_dict`` ends, else at the module's next load or ``state_dict()``.
    """
    metadata = module.__dict__.pop("_metadata_of_load", None)
    for path, was in reversed(module.__dict__.pop("_added_versions", [])):
        if metadata is not None:
            if was is _ABSENT:
                metadata.pop(path, None)
            else:
                metadata[path] = was
