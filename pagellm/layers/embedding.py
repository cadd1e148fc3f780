"""The token embedding and the LM head, split over ranks by vocabulary rows (padded to a
multiple of the group size). A token looks up its row on the rank that holds it, zeros
elsewhere, and an all-reduce assembles the embedding exactly; the head's partial logits
are gathered on rank 0."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.group import TensorParallelGroup
from pagellm.layers.parallel import load_whole, rank_and_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        rank, size = rank_and_size(tp)
        self.vocab_size = vocab_size
        self.num_local = -(-vocab_size // size)
        self.start = rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start:self.start + self.num_local]
        if part.shape[0] < self.num_local:
            part = F.pad(part, (0, 0, 0, self.num_local - part.shape[0]))
        load_whole(param, part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LogitsHead(nn.Module):
    """Hidden states -> float32 logits over the vocabulary, on rank 0 (None elsewhere).

    `weight` is the head's own (ParallelLMHead) or the tied embedding's. `scale` divides the
    logits (Granite's logits_scaling); `softcap` squashes them into (-cap, cap) as
    cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping)."""

    def __init__(self, vocab_size: int, tp: TensorParallelGroup | None, scale: float = 1.0,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.scale = scale
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, weight)
        if self.tp is not None:
            full = self.tp.gather_last_dim(logits)
            if full is None:
                return None
            logits = full[:, :self.vocab_size]
        logits = logits.float()
        if self.scale != 1.0:
            logits = logits / self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
