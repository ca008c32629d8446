"""Kept loaded forms handed to a layer's processing without a copy (``vllm_plugin.loaded_form``), on a real
module through vLLM's own reload steps: only once the layer's processing was seen to leave its input as it
was; a processing that changes its input in place keeps getting a copy, and the kept form stays the delta's
base either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

from vllm_plugin.loaded_form import LoadedForms


class _Packing(QuantizeMethodBase):
    """Packs the weight into a K-major copy and empties ``weight``, as vLLM's CPU GEMM dispatch does;
    ``in_place``: first scales the loaded weight by 2 where it lies (as some GPU repacks shuffle theirs)."""

    def __init__(self, in_place: bool) -> None:
        self.in_place = in_place

    def create_weights(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight.data
        if self.in_place:
            weight.mul_(2)
        layer.packed = weight.t().contiguous()
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)


class _Model(torch.nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Module()
        self.proj.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16), requires_grad=False)
        self.proj.quant_method = _Packing(in_place)


def _sync(forms: LoadedForms, values: torch.Tensor) -> None:
    """One update of layer ``proj``: write ``values`` into its (kept) loaded form, then close it."""
    opened = forms.open("proj")
    opened["proj.weight"].copy_(values)
    forms.close("proj")


@pytest.mark.parametrize("in_place", [False, True], ids=["reads_its_input", "changes_its_input"])
def test_a_kept_loaded_form_is_lent_to_processing_only_once_it_was_seen_to_leave_it(in_place: bool) -> None:
    model = _Model(in_place)
    record_metadata_for_reloading(model)
    model.proj.quant_method.process_weights_after_loading(model.proj)  # as at load: now transformed
    forms = LoadedForms.find(model)
    assert list(forms.layers) == ["proj"]
    forms.keep(True)
    scale = 2 if in_place else 1
    for step in range(3):
        values = torch.randn(4, 8).to(torch.bfloat16)
        _sync(forms, values)
        # the kernel's form is made from exactly what was written, and the kept form still holds it
        assert torch.equal(model.proj.packed, (values * scale).t().contiguous()), step
        assert torch.equal(forms.kept["proj"]["proj.weight"], values), step
        assert forms.lends_kept["proj"] is not in_place
    assert forms.rebuilt == 3 and forms.lent == (0 if in_place else 2)
