"""How a model directory says its embeddings are made: sentence-transformers' modules.json and
its Pooling module's config.json, and config.json's Matryoshka keys. A GGUF file, or a directory
without modules.json, gets the defaults (PoolerConfig)."""
from __future__ import annotations

import json
import os

from pagellm.pooling_params import PoolerConfig

# sentence-transformers' pooling modes, in both spellings it has written (6.x: "pooling_mode": "lasttoken";
# before: one "pooling_mode_<mode>" flag per mode), and ours.
_MODES = {"lasttoken": "LAST", "mean": "MEAN", "mean_tokens": "MEAN", "cls": "CLS", "cls_token": "CLS"}
# Modules whose effect is already had: the decoder itself, the pooling, the final L2 normalization.
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


def read_pooler_config(path: str) -> PoolerConfig:
    """The pooling `path` (a model directory or a GGUF file) asks for."""
    if not os.path.isdir(path):
        return PoolerConfig()
    matryoshka = _matryoshka(_read(os.path.join(path, "config.json")) or {})
    modules = _read(os.path.join(path, "modules.json"))
    if not isinstance(modules, list):
        return PoolerConfig(**matryoshka)
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], m.get("path", "")) for m in modules if isinstance(m, dict)]
    pooling = next((p for kind, p in kinds if kind == _POOLING), None)
    mode, unsupported_pooling = "LAST", None
    if pooling is not None:
        modes = _pooling_modes(_read(os.path.join(path, pooling, "config.json")) or {})
        ours = [_MODES.get(m) for m in modes]
        if len(modes) == 1 and ours[0] is not None:
            mode = ours[0]
        else:
            unsupported_pooling = " + ".join(modes) or "none"
    after = [kind for kind, _ in kinds if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    return PoolerConfig(pooling_type=mode, normalize=any(kind == _NORMALIZE for kind, _ in kinds),
                        unsupported_pooling=unsupported_pooling, unsupported_modules=tuple(after), **matryoshka)


def _pooling_modes(config: dict) -> list[str]:
    if isinstance(config.get("pooling_mode"), str):
        return [config["pooling_mode"]]
    return [key.removeprefix("pooling_mode_") for key, on in config.items() if key.startswith("pooling_mode_") and on]


def _matryoshka(config: dict) -> dict:
    dims = config.get("matryoshka_dimensions")
    return {"is_matryoshka": bool(config.get("is_matryoshka")) or bool(dims),
            "matryoshka_dimensions": tuple(int(d) for d in dims) if dims else None}


def _read(path: str):
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
