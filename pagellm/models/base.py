"""What every family shares: the decoder stack's forward over a flat batch of tokens, the
logits, and loading Hugging Face-named checkpoint tensors through each parameter's loader.

Tokens of all sequences in a step are concatenated into one [T, hidden] tensor, so every
linear layer runs once per step; attention goes through the backend, which reads and
writes the paged KV cache.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.embedding import LogitsHead, VocabParallelEmbedding
from pagellm.layers.linear import LinearMethod
from pagellm.layers.parallel import HeadSplit, load_whole
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.arch import ModelArchConfig

# Checkpoint name fragment -> (the fused parameter's fragment, the part it fills).
STACKED_QKV_GATE_UP = (
    (".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1),
)


def sliding_window(hf, layer: int) -> int | None:
    """Layer `layer`'s window in the reference: per layer type where the config has them
    (Qwen2/3, SmolLM3, Gemma), otherwise the config's one window for every layer (Mistral,
    Phi-3, Mixtral)."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:  # Qwen2/3, SmolLM3: a window kept but off
        return None
    types = getattr(hf, "layer_types", None)
    if types:
        return window if types[layer] == "sliding_attention" else None
    return window


class CausalLM(nn.Module):
    """A decoder-only language model. A family sets `embed_tokens`, `layers` (modules called as
    layer(rope tables or None, x, kv_cache, meta)), `norm`, `lm_head` (None when tied) and
    `ropes` (name -> RotaryEmbedding; each layer's `rope_name` picks one, or None)."""

    # Checkpoint names this family's fused parameters are made of.
    stacked_params: tuple[tuple[str, str, object], ...] = STACKED_QKV_GATE_UP
    embedding_scale: float = 1.0  # multiplies the embeddings (Granite, Gemma)

    def __init__(self, arch: ModelArchConfig, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.cfg = arch
        self.hf = arch.hf
        self.tp = tp
        self.heads = HeadSplit.of(arch.num_attention_heads, arch.num_key_value_heads, tp)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        # A bare decoder (ModelArchConfig.has_lm_head False) has no head and makes no logits.
        untied = not arch.tie_word_embeddings and arch.has_lm_head
        self.lm_head = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp) if untied else None
        self.logits = LogitsHead(arch.vocab_size, tp)
        self.ropes: dict[str, RotaryEmbedding] = {}

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches per layer."""
        return self.heads.num_kv_heads

    def kv_cache_rows(self) -> tuple[int, int, int]:
        """(heads, K row features, V row features) of one token in one layer's cache on this rank.
        Latent attention (layers/mla.py) overrides it: one head, one row, no V."""
        return self.num_kv_heads, self.cfg.head_dim, self.cfg.head_dim

    def layer_kv_rows(self, layer: nn.Module) -> tuple[int, int, int]:
        """kv_cache_rows of one caching layer (an Attention or RecurrentMixer module): the same for
        every layer unless a family's layers differ (Gemma 4's full and sliding layers)."""
        return self.kv_cache_rows()

    def set_ropes(self, ropes: dict[str, RotaryEmbedding]) -> None:
        self.ropes = ropes
        for name, rope in ropes.items():
            self.add_module(f"rope_{name}", rope)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embedding_scale == 1.0 else x * self.embedding_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        # cos/sin are looked up once per step and handed to every layer that rotates.
        tables = {name: rope.cos_sin(positions, x.dtype) for name, rope in self.ropes.items()}
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(tables.get(layer.rope_name), x, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; under tensor parallelism on rank 0 only (None elsewhere)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.logits(hidden, head)

    def compute_cost(self) -> dict:
        """This rank's work: FLOPs per token computed (2 x the multiply-adds of its linear layers,
        top-k experts and head; attention's score products left out) and the weight bytes a decode
        step of one sequence streams (those layers' weights in their stored form, GGUF blocks at
        their size; of a mixture of experts only the top-k experts of its one token; the embedding
        table only when it is the tied head). The roofline's numerators. A model with experts adds
        `expert_weight_bytes` (every expert's weights) and `expert_share` (top_k / experts: the share
        one token reads), from which bench/roofline.py counts a step of more tokens (step_weight_bytes)."""
        from pagellm.layers.linear import LinearBase
        from pagellm.layers.moe import FusedMoE

        def nbytes(module: nn.Module) -> int:
            # recurse: a GGUF layer keeps its blocks in a ParameterList of segments.
            return sum(p.numel() * p.element_size() for p in module.parameters())

        macs = streamed = experts = 0
        shares = set()
        for module in self.modules():
            if isinstance(module, LinearBase):
                macs += module.in_features * module.out_features
                streamed += nbytes(module)
            elif isinstance(module, FusedMoE):
                macs += module.macs_per_token()
                experts += nbytes(module)
                shares.add(module.top_k / module.num_experts)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        macs += head.num_local * self.cfg.hidden_size
        streamed += nbytes(head)
        cost = {"flops_per_token": 2 * macs, "weight_bytes_per_step": streamed}
        if experts:
            if len(shares) != 1:
                raise ValueError(f"layers of experts pick different shares of their experts: {sorted(shares)}")
            (share,) = shares
            cost.update(weight_bytes_per_step=streamed + round(experts * share), expert_weight_bytes=experts,
                        expert_share=share)
        return cost

    # ---- weights -----------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor feeds, before fusing; None to skip it."""
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the head
        return name.removeprefix("model.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in through each parameter's loader (which fuses
        q/k/v and gate/up, and cuts this rank's shard under tensor parallelism), then check
        that every parameter was filled."""
        params = dict(self.named_parameters())
        filled: dict[str, set] = {}
        for ckpt_name, tensor in weights:
            name = self.checkpoint_name(ckpt_name)
            if name is None:
                continue
            target, part = self.route(name, params)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {ckpt_name!r} for a {self.cfg.architecture} model")
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    load_whole(param, tensor)
                elif part is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, part)
            except ValueError as e:
                raise ValueError(f"weight {ckpt_name!r}: {e}") from None
            filled.setdefault(target, set()).add(part)
        missing = [n for n in params if n not in filled or not self._complete(n, filled[n])]
        if missing:
            raise ValueError(f"model file lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        for module_name, module in self.named_modules():
            if isinstance(getattr(module, "method", None), LinearMethod):
                try:
                    module.method.finish(module)  # e.g. pack GGUF parts into segments
                except ValueError as e:
                    raise ValueError(f"weights of {module_name}: {e}") from None

    def route(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str, object]:
        """(the parameter, the part of it) a checkpoint tensor fills; part None: all of it."""
        for ckpt_frag, param_frag, part in self.stacked_params:
            if ckpt_frag in name and name.replace(ckpt_frag, param_frag) in params:
                return name.replace(ckpt_frag, param_frag), part
        return name, None

    def _complete(self, name: str, parts: set) -> bool:
        """Whether a parameter got every part it is made of (or was stored whole)."""
        if None in parts:
            return True
        param = self.get_parameter(name)
        needed = getattr(param, "parts_needed", None)
        if needed is None:
            needed = {part for _, frag, part in self.stacked_params if frag in name}
        expand = getattr(param, "expand_part", None)  # a part that fills several (stacked experts)
        if expand is not None:
            parts = set().union(*(expand(p) for p in parts))
        return needed <= parts
