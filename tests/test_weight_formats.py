"""The weight formats are one registry (layers/quant), filled by the modules that implement them;
the option's choices and the refusals come from it."""
from __future__ import annotations

import pytest
import torch

from pagellm.config import QUANTIZATIONS
from pagellm.layers.quant import WEIGHT_FORMATS, linear_methods, quantized_on_load, weight_format


def test_every_format_is_registered_by_its_module():
    weight_format("dense")  # loads the modules that register the others
    assert set(WEIGHT_FORMATS) == {"dense", "gguf", "int8", "int4"}


def test_the_quantization_option_offers_the_formats_that_quantize_as_they_load():
    weight_format("dense")
    on_load = {name for name, f in WEIGHT_FORMATS.items() if f.quantizes_on_load}
    assert set(QUANTIZATIONS) == {"auto", "none"} | on_load
    assert {q: getattr(quantized_on_load(q), "name", None) for q in QUANTIZATIONS} == \
        {"auto": None, "none": None, **{name: name for name in on_load}}


def test_refusals_name_the_format_and_why():
    with pytest.raises(ValueError, match="weight format 'fp4' is not one of dense, "):
        weight_format("fp4")
    with pytest.raises(ValueError, match="batch-invariant mode does not cover quantization 'int8' yet .*packed"):
        linear_methods("int8", torch.float32, batch_invariant=True)
    assert weight_format("int4").devices == ("cpu",)
