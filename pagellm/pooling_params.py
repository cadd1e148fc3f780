"""Embeddings: how a model pools its final hidden states into one vector (its `PoolerConfig`),
and what one request asks of it (`PoolingParams`). Named as in vLLM.

A pooling request runs its prompt through the model and samples nothing. Its prompt may be
prefilled in chunks; `chunk_reduction` says what each chunk's hidden rows contribute, so that
chunked and whole prefills pool the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# LAST: the last token's hidden state (decoder embedders: Qwen3-Embedding, e5-mistral); MEAN: the
# average over the prompt's tokens; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# The keys of --pooler-config.
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """How the served model makes an embedding: from its sentence-transformers files
    (modules.json, 1_Pooling/config.json), overridden by --pooler-config, else LAST and
    normalized (vLLM's default for a decoder)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    # Matryoshka models (config.json `is_matryoshka` / `matryoshka_dimensions`) may be cut to fewer
    # dimensions; None: any length up to the hidden size. Other models refuse `dimensions`.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # What the model's files ask for that is not implemented: a sentence-transformers pooling mode
    # (max, weightedmean, ...; --pooler-config can replace it) and modules after the pooling (Dense).
    # Embeddings are refused while either is set; generation is not affected.
    unsupported_pooling: str | None = None
    unsupported_modules: tuple[str, ...] = ()

    def with_overrides(self, overrides: dict | None) -> PoolerConfig:
        """This config with --pooler-config's keys (already checked by EngineConfig) applied."""
        if not overrides:
            return self
        config = replace(self, **overrides)
        return replace(config, unsupported_pooling=None) if "pooling_type" in overrides else config

    def refusal(self) -> str | None:
        """Why embeddings cannot be made as the model's files ask; None when they can."""
        if self.unsupported_modules:
            return (f"its modules.json applies {', '.join(self.unsupported_modules)} after the pooling, which "
                    f"pagellm does not implement")
        if self.unsupported_pooling:
            return (f"its sentence-transformers pooling mode {self.unsupported_pooling!r} is not implemented "
                    f"({', '.join(POOLING_TYPES)} are; --pooler-config can choose one)")
        return None


def check_pooler_overrides(value: dict) -> bool:
    """Whether `value` is a valid --pooler-config: known keys, a known pooling type, a bool."""
    return (set(value) <= set(POOLER_CONFIG_KEYS) and value.get("pooling_type", "LAST") in POOLING_TYPES
            and isinstance(value.get("normalize", True), bool))


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options; None takes the model's (PoolerConfig).

    `dimensions`: keep the first this many (Matryoshka truncation, before normalizing).
    `pooling_type`: the offline API may pool one request otherwise than the model's default."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def resolve(self, config: PoolerConfig, hidden_size: int, model: str) -> PoolingParams:
        """Every field set, from the model's config where this request left it None; ValueError
        when the model cannot give what is asked."""
        refusal = config.refusal()
        if refusal and (config.unsupported_modules or self.pooling_type is None):
            raise ValueError(f"{model} cannot make embeddings as its files ask: {refusal}")
        d = self.dimensions
        if d is not None:
            if not config.is_matryoshka:
                raise ValueError(f"dimensions is not supported by {model}: it is not a Matryoshka model (its "
                                 f"config.json sets neither is_matryoshka nor matryoshka_dimensions), so a shortened "
                                 f"embedding would be meaningless; got dimensions {d}")
            allowed = config.matryoshka_dimensions
            if allowed is not None and d not in allowed:
                raise ValueError(f"dimensions must be one of {list(allowed)} for {model} (its "
                                 f"matryoshka_dimensions), got {d}")
            if d > hidden_size:
                raise ValueError(f"dimensions must be <= {hidden_size} (the model's hidden size), got {d}")
        return PoolingParams(dimensions=d,
                             normalize=config.normalize if self.normalize is None else self.normalize,
                             pooling_type=self.pooling_type or config.pooling_type)

    @property
    def needs_every_position(self) -> bool:
        """Whether each prompt position's hidden state is pooled (none may come from the prefix cache)."""
        return self.pooling_type != "LAST"


def chunk_reduction(pooling_type: str, start: int, end: int, num_tokens: int) -> str | None:
    """What a prefill chunk of positions [start, end) of a `num_tokens` prompt gives its pooling:
    the sum of its rows ("sum"), its last row ("last"), its first ("first"), or nothing (None)."""
    if pooling_type == "MEAN":
        return "sum"
    if pooling_type == "LAST":
        return "last" if end == num_tokens else None
    return "first" if start == 0 else None
