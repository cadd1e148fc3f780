"""benchmarks/make_gguf_shape.py's real shapes: the configs build transformers' model of the
released size, and gpt-oss's experts come out in OpenAI's MXFP4 layout with sane values."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagellm.loader.mxfp4 import gguf_blocks
from pagellm.loader.synthetic import CHECKPOINT_SHAPES

_spec = importlib.util.spec_from_file_location(
    "make_gguf_shape", Path(__file__).resolve().parents[2] / "benchmarks" / "make_gguf_shape.py")
make_gguf_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf_shape)


def test_gpt_oss_20b_has_the_released_parameter_counts() -> None:
    """OpenAI's model card: 20.91B parameters in all, 3.61B active (4 of 32 experts, the
    embedding table not counted)."""
    cfg = CHECKPOINT_SHAPES["gpt-oss-20b"]
    shapes = make_gguf_shape.hf_tensor_shapes(cfg)
    count = {name: int(np.prod(s)) for name, s in shapes.items()}
    total = sum(count.values())
    experts = sum(n for name, n in count.items() if ".mlp.experts." in name)
    active = total - experts * (1 - cfg["num_experts_per_tok"] / cfg["num_local_experts"]) \
        - count["model.embed_tokens.weight"]
    assert round(total / 1e9, 2) == 20.91 and round(active / 1e9, 2) == 3.61


def test_qwen3_5_4b_is_the_hybrid_of_the_release() -> None:
    shapes = make_gguf_shape.hf_tensor_shapes(CHECKPOINT_SHAPES["qwen3.5-4b"])
    full = sorted(int(n.split(".")[2]) for n in shapes if n.endswith("self_attn.q_proj.weight"))
    assert full == list(range(3, 32, 4))
    assert sum(n.endswith("linear_attn.in_proj_qkv.weight") for n in shapes) == 24
    assert "lm_head.weight" not in shapes  # tied, as released
    # pins the table: 3.57e9 in the 32 layers, 0.64e9 in the embedding the head shares
    assert round(sum(int(np.prod(s)) for s in shapes.values()) / 1e9, 2) == 4.21


def test_gpt_oss_experts_are_written_as_openai_mxfp4() -> None:
    gen = torch.Generator().manual_seed(0)
    experts, n_in, n_out = 2, 64, 96  # transformers' gate_up_proj [experts, hidden, 2 * intermediate]
    (bname, blocks), (sname, scales) = make_gguf_shape.random_mxfp4("mlp.experts.gate_up_proj",
                                                                      (experts, n_in, n_out), gen)
    assert (bname, sname) == ("mlp.experts.gate_up_proj_blocks", "mlp.experts.gate_up_proj_scales")
    assert blocks.shape == (experts, n_out, n_in // 32, 16) and scales.shape == (experts, n_out, n_in // 32)
    w = dequantize(gguf_blocks(blocks, scales).numpy(), GGMLQuantizationType.MXFP4)
    assert w.shape == (experts, n_out, n_in) and np.isfinite(w).all()
    assert 0 < np.abs(w).max() <= 6 * 2.0 ** -4 and np.abs(w).std() > 0.01
