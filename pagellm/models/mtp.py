"""A model's multi-token-prediction (MTP) layer, built as a model of its own for speculative
decoding's "mtp" proposer (worker/proposers/mtp.py): what DeepSeek-V3's and Qwen3.5's share.

For position p the layer reads the embedding of the token at p + 1 and the target's final hidden
state at p, norms each, concatenates them (embedding first), projects them back to the hidden size,
runs one decoder layer of the family (over its own paged KV cache) and predicts the token at
p + 2 through a final norm and the target's head. A family says where its checkpoint keeps the
layer and what it names the parts (`prefix`, `part_names`, `block_prefix`), how its decoder layer
is built (`make_block`), and the two points where released layers differ: whether position 0's
embedding is zeroed, and whether the output handed to the next link of a chain has passed the
final norm (the chain reads what the released code feeds back)."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.layers.activation import check_activation
from pagellm.layers.linear import ReplicatedLinear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.models.arch import ModelArchConfig
from pagellm.models.base import CausalLM
from pagellm.models.llama import LlamaForCausalLM


class MultiTokenPredictor(LlamaForCausalLM):
    """Put before the family's class (`class XMTP(MultiTokenPredictor, XForCausalLM)`): the family
    gives the decoder layer, its rotary tables and how its tensors load. Parameters: `enorm`,
    `hnorm` (the embedding's and the hidden state's norms), `eh_proj`, `layers.0`, `norm` (before
    the head); `embed_tokens` and `lm_head` are the target's, read from its names (both families
    train them shared; copies a checkpoint stores beside the layer are not read)."""

    # The config field counting the checkpoint's MTP layers, and its value where the config has
    # none. Only the first layer is run: the proposals of a chain all come from it.
    layers_field: str
    layers_default: int = 1
    # Checkpoint names (after `prefix`) of the parts every MTP layer has, by parameter.
    part_names: dict[str, str]
    # Where the decoder layer's tensors are, after `prefix`; names that start with one of
    # `unread` are not the layer's.
    block_prefix: str = ""
    unread: tuple[str, ...] = ()
    zero_first_embedding: bool = False
    # The output goes through `norm` in forward (and the chain reads it normed), else only
    # before the head.
    normed_output: bool = False

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        CausalLM.__init__(self, arch, tp)  # the embedding and head, not the target's stack
        self.act = getattr(self.hf, self.act_field, None) or "silu"
        check_activation(self.act, arch.model_name)
        self.set_ropes(self.make_ropes(max_positions))
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, unit_offset=self.unit_offset_norms)
        self.hnorm = RMSNorm(hidden, eps, unit_offset=self.unit_offset_norms)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        self.layers = nn.ModuleList([self.make_block(backend, tp)])
        self.norm = RMSNorm(hidden, eps, unit_offset=self.unit_offset_norms)

    @classmethod
    def prefix(cls, arch: ModelArchConfig) -> str:
        """Where the checkpoint keeps the first MTP layer's tensors."""
        raise NotImplementedError

    @classmethod
    def num_layers(cls, arch: ModelArchConfig) -> int:
        value = getattr(arch.hf, cls.layers_field, None)
        return cls.layers_default if value is None else int(value)

    @classmethod
    def required_tensors(cls, arch: ModelArchConfig) -> list[str]:
        """The tensors without which there is no layer to run (the decoder layer's are checked
        by load_weights)."""
        return [f"{cls.prefix(arch)}{cls.part_names[p]}.weight" for p in ("enorm", "hnorm", "eh_proj", "norm")]

    def make_block(self, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        """The decoder layer, as the family builds its own."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                previous_hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(input_ids)
        if self.zero_first_embedding:
            embedded = embedded.masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous_hidden.to(embedded.dtype))], dim=-1))
        layer = self.layers[0]
        tables = {name: rope.cos_sin(positions, x.dtype) for name, rope in self.ropes.items()}
        x = layer(tables.get(layer.rope_name), x, kv_caches[0], meta)
        return self.norm(x) if self.normed_output else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return super().compute_logits(hidden if self.normed_output else self.norm(hidden))

    def checkpoint_name(self, name: str) -> str | None:
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":
            return CausalLM.checkpoint_name(self, name)
        prefix = self.prefix(self.cfg)
        if not name.startswith(prefix):
            return None  # the target's stack
        rest = name.removeprefix(prefix)
        for param, stored in self.part_names.items():
            if rest.startswith(stored + "."):
                return param + rest.removeprefix(stored)
        if rest.startswith(self.unread) or not rest.startswith(self.block_prefix):
            return None  # the checkpoint's copies of the embedding and head, or a later MTP layer
        # The decoder layer, named as the target's layer 0 would be.
        return super().checkpoint_name("model.layers.0." + rest.removeprefix(self.block_prefix))
