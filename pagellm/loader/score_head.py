"""A cross-encoder's score head (models.registry.SEQUENCE_CLASSIFIERS): `score.weight`
[num_labels, hidden] applied to the final hidden state of the pair's last token that is not
padding, as transformers' *ForSequenceClassification does, then the activation
sentence-transformers' CrossEncoder.predict applies (its config's `sentence_transformers.activation_fn`,
else sigmoid for one label). The decoder runs as the engine's ordinary pooling request (LAST, not
normalized); the head is applied to its vector outside the engine, being one dot product per pair.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from safetensors import safe_open

from pagellm.models.registry import SEQUENCE_CLASSIFIERS

# sentence-transformers' activation paths (and their pre-v4 key's) that are served here.
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}
_HEAD = "score.weight"


@dataclass(frozen=True)
class ScoreHead:
    weight: tuple[tuple[float, ...], ...]  # [num_labels][hidden], float32 values as Python floats
    activation: str  # "sigmoid" | "identity"
    pad_token_id: int | None
    architecture: str

    @property
    def num_labels(self) -> int:
        return len(self.weight)

    def check_scores(self) -> None:
        """ValueError unless this head gives one score per pair (what /rerank, /score and LLM.score return)."""
        if self.num_labels != 1:
            raise ValueError(f"this {self.architecture} has {self.num_labels} labels; rerank and score need a "
                             f"cross-encoder with num_labels 1 (one relevance score per pair)")

    def pair_ids(self, tokenizer: Any, query: str, document: str) -> list[int]:
        """The pair's tokens as its tokenizer (loader.tokenizer.Tokenizer) joins a (query, document) pair
        (CrossEncoder.predict's `tokenizer(query, document)`: the model's own special tokens between and
        around), with any
        trailing padding tokens dropped: transformers scores the last token that is not padding, and
        a causal decoder's state there does not see what follows."""
        ids = tokenizer.encode_pair(query, document)
        while len(ids) > 1 and ids[-1] == self.pad_token_id:
            ids.pop()
        return ids

    def score(self, hidden: Sequence[float]) -> float:
        """The activation of the head's one output on the last token's final hidden state."""
        self.check_scores()
        logit = math.fsum(w * h for w, h in zip(self.weight[0], hidden))
        if self.activation == "identity":
            return logit
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))


def read_score_head(model_path: str) -> ScoreHead | None:
    """The score head of the cross-encoder in directory `model_path`; None for any other model."""
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    architecture = (config.get("architectures") or [""])[0]
    if architecture not in SEQUENCE_CLASSIFIERS:
        return None
    path = (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    if path is None:
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        activation = "sigmoid" if labels == 1 else "identity"
    elif path in ACTIVATIONS:
        activation = ACTIVATIONS[path]
    else:
        raise ValueError(f"{config_path}: activation_fn {path!r} is not supported for a cross-encoder "
                         f"(supported: {', '.join(ACTIVATIONS)})")
    weight = _read_tensor(model_path, _HEAD)
    if weight is None:
        raise ValueError(f"{model_path}: {architecture} has no {_HEAD} in its safetensors files")
    return ScoreHead(tuple(tuple(row) for row in weight.float().tolist()), activation,
                     config.get("pad_token_id"), architecture)


def _read_tensor(model_path: str, name: str):
    """Tensor `name` from the directory's safetensors files (sharded or not); None if none holds it."""
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shard = (json.load(f).get("weight_map") or {}).get(name)
        files = [os.path.join(model_path, shard)] if shard else []
    else:
        files = sorted(os.path.join(model_path, n) for n in os.listdir(model_path) if n.endswith(".safetensors"))
    for path in files:
        with safe_open(path, framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None
