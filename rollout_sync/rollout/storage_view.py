"""Where the storage of one logical tensor lives on one vLLM rank: a flat range of one of the model's
parameters viewed with a shape, or a staging buffer handed to vLLM's ``load_weights`` (pure: no vLLM, no
torch). Target maps (``local_targets``, ``shape_targets``) pair each map with its ``StorageView``;
``apply`` resolves a view against the live parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

__all__ = ["StorageView"]


@dataclass(frozen=True, slots=True)
class StorageView:
    """Where the storage of one logical tensor lives on one rank.

    ``param`` names a parameter of the vLLM model (``model.named_parameters()``); the storage is elements
    ``[offset, offset + numel)`` of that (contiguous) parameter's flattening, viewed with ``shape``:
    ``param.data.view(-1)[offset : offset + numel].view(shape)``. ``param is None`` means a staging buffer
    of the logical tensor's shape (``offset`` 0), filled by the sync and then handed to vLLM's
    ``load_weights`` (the fallback for refused loaders).
    """

    param: str | None
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def to_dict(self) -> dict[str, object]:
        return {"param": self.param, "offset": self.offset, "shape": list(self.shape)}

    @staticmethod
    def from_dict(data: Mapping[str, object]) -> StorageView:
        param = data["param"]
        offset = data["offset"]
        shape = data["shape"]
        if (
            (param is not None and not isinstance(param, str))
            or not isinstance(offset, int)
            or not isinstance(shape, (list, tuple))
        ):
            raise ValueError(f"malformed storage view {dict(data)!r}")
        return StorageView(param, offset, tuple(int(s) for s in shape))
