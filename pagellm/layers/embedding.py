"""The token embedding and the LM head, split over ranks by vocabulary rows (padded to a
multiple of the group size). A token looks up its row on the rank that holds it, zeros
elsewhere, and an all-reduce assembles the embedding exactly; the head's partial logits
are gathered on rank 0."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.linear import LinearMethod, default_linear_method
from pagellm.layers.parallel import rank_and_size


class VocabParallelEmbedding(nn.Module):
    """The table is stored by a linear method, like a linear layer's weight (a GGUF file's
    embedding and head are often quantized, e.g. Q6_K), which also serves it as the LM head."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallelGroup | None = None,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp = tp
        rank, size = rank_and_size(tp)
        self.vocab_size = vocab_size
        self.num_local = -(-vocab_size // size)
        self.start = rank * self.num_local
        self.method = method or default_linear_method()
        self.method.create_weights(self, dim, self.num_local)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = max(0, min(self.num_local, loaded.shape[0] - self.start))
        part = loaded.narrow(0, self.start, rows)
        if rows < self.num_local:  # the last rank's rows past the vocabulary: zeros
            pad = self.num_local - rows
            part = (F.pad(part, (0, 0, 0, pad)) if isinstance(part, torch.Tensor)
                    else part.with_rows(F.pad(part.data, (0, 0, 0, pad))))
        self.method.load(self, part, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.method.embedding(self, ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = self.method.embedding(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ table^T: this rank's logits, as the LM head."""
        return self.method.apply(self, hidden)


class LogitsHead(nn.Module):
    """Hidden states -> float32 logits over the vocabulary, on rank 0 (None elsewhere).

    `head` is the model's own (an embedding-shaped table) or the tied embedding. `scale` divides the
    logits (Granite's logits_scaling); `softcap` squashes them into (-cap, cap) as
    cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping)."""

    def __init__(self, vocab_size: int, tp: TensorParallelGroup | None, scale: float = 1.0,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.scale = scale
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor | None:
        logits = head.project(hidden)
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
