"""The one list of supported model families. Both loaders, the error for an unknown
architecture and the README's models table read it. Beside it, the image-text checkpoints
whose text model is served as one of these families."""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str                             # ModelArchConfig.architecture
    module: str                           # pagellm.models.<module>
    cls: str                              # the class in it
    hf_architectures: tuple[str, ...]     # config.json "architectures"
    # GGUF general.architecture values whose files load (tested against the HF load).
    gguf_architectures: tuple[str, ...] = ()
    # Hugging Face model_type, for a config.json that lists no architectures.
    model_types: tuple[str, ...] = ()
    # A mixture of experts: told apart from a dense family of the same GGUF architecture by
    # the file's expert count (llama.cpp writes Mixtral as "llama").
    moe: bool = False
    # Takes the files of its GGUF architectures that have sliding-window layers, which another
    # family's files of that architecture lack (llama.cpp writes OLMo 3 as "olmo2").
    gguf_sliding: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", "LlamaForCausalLM", ("LlamaForCausalLM",), ("llama",), ("llama",)),
    # llama.cpp writes Mistral as "llama" (without its window): such files load as the llama family.
    Family("mistral", "llama", "LlamaForCausalLM", ("MistralForCausalLM",), (), ("mistral",)),
    Family("qwen2", "llama", "LlamaForCausalLM", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",)),
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)),
    Family("smollm3", "smollm3", "SmolLM3ForCausalLM", ("SmolLM3ForCausalLM",), ("smollm3",), ("smollm3",)),
    Family("olmo2", "olmo2", "Olmo2ForCausalLM", ("Olmo2ForCausalLM",), ("olmo2",), ("olmo2",)),
    Family("olmo3", "olmo3", "Olmo3ForCausalLM", ("Olmo3ForCausalLM",), ("olmo2",), ("olmo3",), gguf_sliding=True),
    Family("granite", "granite", "GraniteForCausalLM", ("GraniteForCausalLM",), ("granite",), ("granite",)),
    Family("phi3", "phi3", "Phi3ForCausalLM", ("Phi3ForCausalLM",), ("phi3",), ("phi3",)),
    Family("gemma2", "gemma2", "Gemma2ForCausalLM", ("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",)),
    Family("gemma3", "gemma3", "Gemma3ForCausalLM", ("Gemma3ForCausalLM",), ("gemma3",), ("gemma3_text",)),
    # moe: its dense files and those with experts (26B-A4B) are one family.
    Family("gemma4", "gemma4", "Gemma4ForCausalLM", ("Gemma4ForCausalLM",), ("gemma4",), ("gemma4_text",), moe=True),
    Family("ministral3", "ministral3", "Ministral3ForCausalLM", ("Ministral3ForCausalLM",), ("mistral3",),
           ("ministral3",)),
    Family("qwen3_5", "qwen3_5", "Qwen3_5ForCausalLM", ("Qwen3_5ForCausalLM",), ("qwen35",), ("qwen3_5_text",)),
    Family("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeForCausalLM", ("Qwen3_5MoeForCausalLM",), ("qwen35moe",),
           ("qwen3_5_moe_text",), moe=True),
    Family("granite_moe_hybrid", "granite_moe_hybrid", "GraniteMoeHybridForCausalLM",
           ("GraniteMoeHybridForCausalLM",), ("granitehybrid",), ("granitemoehybrid",), moe=True),
    Family("lfm2", "lfm2", "Lfm2ForCausalLM", ("Lfm2ForCausalLM",), ("lfm2",), ("lfm2",)),
    Family("mixtral", "mixtral", "MixtralForCausalLM", ("MixtralForCausalLM",), ("llama",), ("mixtral",), moe=True),
    Family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",), ("qwen3moe",),
           ("qwen3_moe",), moe=True),
    Family("gpt_oss", "gpt_oss", "GptOssForCausalLM", ("GptOssForCausalLM",), ("gpt-oss",), ("gpt_oss",), moe=True),
    Family("llama4", "llama4", "Llama4ForCausalLM", ("Llama4ForCausalLM",), ("llama4",), ("llama4_text",), moe=True),
    Family("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM", ("DeepseekV3ForCausalLM",), ("deepseek2",),
           ("deepseek_v3",), moe=True),
)


@dataclass(frozen=True)
class Multimodal:
    """An image-text checkpoint served as its text model alone (the family its text_config's
    model_type names): its image inputs are not served and its vision weights are never read."""
    # (checkpoint prefix, the text family's): a weight under none of them is not the text model's.
    text_prefixes: tuple[tuple[str, str], ...]
    # Whose tie_word_embeddings transformers obeys: the outer config's, or (Llama 4, whose text
    # model is a model of its own) the text config's.
    tie_from_text: bool = False

    def text_name(self, name: str) -> str | None:
        """The text family's name of checkpoint tensor `name`; None for another modality's."""
        for prefix, text in self.text_prefixes:
            if name.startswith(prefix):
                return text + name[len(prefix):]
        return None


# transformers saves Gemma 3, Mistral 3 and Llama 4 in the layout their original checkpoints
# have (language_model.model.*, language_model.lm_head) and reads the newer one too.
_SAVED = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
_NEWER = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
MULTIMODAL: dict[str, Multimodal] = {
    "Qwen3_5ForConditionalGeneration": Multimodal(_NEWER),
    "Gemma3ForConditionalGeneration": Multimodal(_SAVED + _NEWER),
    "Gemma4ForConditionalGeneration": Multimodal(_NEWER),  # its audio and vision towers are not read
    "Mistral3ForConditionalGeneration": Multimodal(_SAVED + _NEWER),  # a ministral3 or a mistral text model
    "Llama4ForConditionalGeneration": Multimodal(_SAVED, tie_from_text=True),
}

HF_ARCHITECTURES = {a: f for f in FAMILIES for a in f.hf_architectures}
# Cross-encoders served with their score head (loader/score_head.py), by the causal LM whose
# decoder they are: their weights are that decoder's (`model.*`) and `score.weight`.
SEQUENCE_CLASSIFIERS = {"Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
                        "LlamaForSequenceClassification": "LlamaForCausalLM"}
GGUF_ARCHITECTURES = {(a, f.moe, f.gguf_sliding): f for f in FAMILIES for a in f.gguf_architectures}
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def multimodal_for_hf(config: dict) -> Multimodal | None:
    """The image-text checkpoint a config.json's contents describe; None for a text model."""
    names = config.get("architectures") or []
    return MULTIMODAL.get(names[0]) if names else None


def family_for_hf(config: dict, where: str) -> Family:
    """The family of a config.json's contents (of its text model, for an image-text
    checkpoint); ValueError naming what is supported."""
    names = config.get("architectures") or []
    if names and names[0] in MULTIMODAL:
        text_type = (config.get("text_config") or {}).get("model_type")
        family = _BY_MODEL_TYPE.get(text_type)
        if family is None:
            raise ValueError(f"{where}: {names[0]} is served as its text model, but its text_config's model_type "
                             f"{text_type!r} is not a supported family (supported: {', '.join(_BY_MODEL_TYPE)})")
        return family
    if names and names[0] in SEQUENCE_CLASSIFIERS:
        return HF_ARCHITECTURES[SEQUENCE_CLASSIFIERS[names[0]]]
    if names and names[0].endswith("ForSequenceClassification"):
        raise ValueError(classification_head_refusal(names[0], config, where))
    # A config saved from a config object alone lists no architectures; model_type still says which.
    if names:
        family = HF_ARCHITECTURES.get(names[0]) or HF_ARCHITECTURES.get(causal_lm_of_base(names[0]))
    else:
        family = _BY_MODEL_TYPE.get(config.get("model_type"))
    if family is None:
        shown = names[0] if names else config.get("model_type")
        raise ValueError(f"{where}: architecture {shown!r} is not supported "
                         f"(supported: {', '.join([*HF_ARCHITECTURES, *MULTIMODAL])})")
    return family


def classification_head_refusal(architecture: str, config: dict, where: str) -> str:
    """Why a sequence-classification checkpoint (a cross-encoder reranker: the decoder, then a
    `score` head of num_labels outputs on the last token) of a family not in SEQUENCE_CLASSIFIERS
    is refused: serving its decoder as a language model or an embedding model would give scores
    that are not the model's. What to serve instead for /v1/rerank and /score."""
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    return (f"{where}: {architecture} is a sequence-classification model (a cross-encoder, {labels} label"
            f"{'s' if labels != 1 else ''} from a score head on the last token); pagellm loads classification "
            f"heads only for {', '.join(SEQUENCE_CLASSIFIERS)}, so it cannot serve its scores. For /v1/rerank and "
            f"/score serve one of those, a causal LM used as a yes/no reranker (Qwen3-Reranker, with "
            f"classifier_from_token) or an embedding model (cosine scores); see docs/embeddings.md")


def causal_lm_of_base(architecture: str) -> str | None:
    """`Qwen3Model` -> `Qwen3ForCausalLM`: the language model whose bare decoder (no head) a checkpoint
    of `architecture` is, as sentence-transformers saves an embedding model; None for any other name."""
    if architecture.endswith("Model") and architecture not in HF_ARCHITECTURES:
        return architecture.removesuffix("Model") + "ForCausalLM"
    return None


def family_for_gguf(arch: str | None, where: str, experts: bool = False, sliding: bool = False) -> Family:
    """The family of a GGUF file's `general.architecture` (`experts`: the file has an expert count;
    `sliding`: it has sliding-window layers, which most families take as they come)."""
    family = GGUF_ARCHITECTURES.get((arch, experts, sliding))  # type: ignore[arg-type]
    if family is None and sliding:
        family = GGUF_ARCHITECTURES.get((arch, experts, False))  # type: ignore[arg-type]
    if family is None and not experts:  # a family with experts that also has dense models (Granite 4, Gemma 4)
        family = (GGUF_ARCHITECTURES.get((arch, True, sliding))  # type: ignore[arg-type]
                  or GGUF_ARCHITECTURES.get((arch, True, False)))  # type: ignore[arg-type]
    if family is None:
        supported = ", ".join(sorted({a for a, _, _ in GGUF_ARCHITECTURES}))
        kind = " with experts" if experts and any(a == arch for a, _, _ in GGUF_ARCHITECTURES) else ""
        raise ValueError(f"{where}: architecture {arch!r}{kind} is not supported (supported: {supported})")
    return family


def model_class(name: str) -> type:
    """The class that builds a model of family `name` (ModelArchConfig.architecture)."""
    family = _BY_NAME[name]
    return getattr(importlib.import_module(f"pagellm.models.{family.module}"), family.cls)


def build_model(arch, backend, max_positions: int, tp=None):
    """The model of `arch`'s family (this rank's shard of it under tensor parallelism)."""
    return model_class(arch.architecture)(arch, backend, max_positions, tp)


def check_tensor_parallel(arch, size: int) -> None:
    """Raise ValueError, before any rank starts, when the model cannot be split `size` ways:
    the model is built on the meta device (no memory) as rank 0 of `size`, so every layer's
    own rule for dividing its heads, features or experts runs."""
    import torch

    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.layers.parallel import TensorParallelGroup

    with torch.device("meta"):
        build_model(arch, TorchAttentionBackend(), 1, TensorParallelGroup(0, size))
