"""Engine options, each declared once: its type, default, help and check.

`LLM(...)`'s keyword arguments, the flags of `pagellm generate / chat / serve`
(`--block-size`, `--enable-prefix-caching/--no-enable-prefix-caching`, ...) and the
validation all come from the fields of `EngineConfig`: a new option is one field here.
Names follow vLLM's.
"""
from __future__ import annotations

import argparse
import inspect
import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

from pagellm.pooling_params import check_pooler_overrides

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
# How weights are stored and multiplied; see pagellm.layers.quant.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8", "int8x2")
# What preemption does with a victim's KV blocks (pagellm.core.scheduler).
PREEMPTION_MODES = ("recompute", "swap", "auto")
# How K/V are stored (pagellm.kv_format): "auto" as --dtype; "fp8" is fp8_e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# How KV memory is handed out: in blocks (PagedAttention), or one contiguous region per
# request as before paging (the baselines of `pagellm bench`; see pagellm.core.kv.contiguous).
KV_POLICIES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
# Which engine replica serves a request under --data-parallel-size (pagellm.serving.router).
ROUTER_POLICIES = ("cache_aware", "round_robin", "least_loaded")


def bytes_or_fraction(text: str) -> float | int:
    """`2G`, `512M`, `1048576` (bytes) or `0.5` (a fraction of free memory), as the CLI reads them."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")  # 2G, 2GB, 2GiB
    forms = "a byte count (e.g. 512M, 4G, 1073741824) or a fraction of free memory in (0, 1] (e.g. 0.5)"
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        value = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither {forms}") from None
    if value <= 1:
        return value
    if not value.is_integer():  # 2.5 is no fraction and no whole number of bytes
        raise argparse.ArgumentTypeError(f"{text!r} is neither {forms}")
    return int(value)


def _json_flag(text: str, kind: type, what: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, kind):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def json_object(text: str) -> dict:
    """A CLI flag's JSON object (`--pooler-config '{"pooling_type": "MEAN"}'`)."""
    return _json_flag(text, dict, "a JSON object")


def json_list(text: str) -> list:
    """A CLI flag's JSON list (`--classifier-from-token '["no", "yes"]'`)."""
    return _json_flag(text, list, "a JSON list")


# Speculative decoding (docs/speculative-decoding.md): the proposers built so far, and vLLM's other
# methods, named so that asking for one says it is not implemented yet rather than unknown.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
SPECULATIVE_METHODS_NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
# vLLM's model-specific names of its "mtp" method.
SPECULATIVE_METHOD_ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}
# vLLM's keys for a draft model that pagellm does not take (yet): named as such, not as unknown.
SPECULATIVE_KEYS_NOT_YET = ("quantization", "max_model_len", "revision", "code_revision", "tokenizer",
                            "speculative_token_tree", "parallel_drafting", "disable_padded_drafter_batch")
# Keys that only one method reads: given to another, they would be silently ignored.
_METHOD_KEYS = {"ngram": ("prompt_lookup_max", "prompt_lookup_min"),
                "draft_model": ("model", "draft_tensor_parallel_size")}


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config`, as vLLM spells it: propose tokens cheaply, verify them in one forward pass.
    method "ngram" is prompt lookup: the longest of the last prompt_lookup_max .. prompt_lookup_min
    tokens found earlier in the prompt or output proposes the tokens that followed it. method
    "draft_model" runs `model` (a smaller model with the target's vocabulary, an HF folder or a GGUF
    file) for num_speculative_tokens steps from the last accepted token. method "mtp" (vLLM's
    "deepseek_mtp" and "qwen3_next_mtp" too) runs the target's own multi-token-prediction layer,
    chained num_speculative_tokens times."""

    num_speculative_tokens: int  # the most tokens proposed for one step of one sequence
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Speculation is off for a step when more sequences than this are running or waiting: a large batch
    # is compute-bound, and verifying rejected tokens would cost more than the steps saved.
    disable_by_batch_size: int = 8
    model: str | None = None  # the draft model's path (method "draft_model")
    draft_tensor_parallel_size: int = 1  # vLLM's key; the draft runs on one rank (1 is all there is)

    @classmethod
    def from_dict(cls, options: dict) -> SpeculativeConfig:
        """Check the keys and values of a speculative_config; ValueError names the key, value and limit."""
        if not isinstance(options, dict):
            raise ValueError(f"must be a JSON object such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                             f"got {options!r}")
        # vLLM infers the method from a `model` given alone.
        method = options.get("method", "ngram" if "model" not in options else "draft_model")
        method = SPECULATIVE_METHOD_ALIASES.get(method, method) if isinstance(method, str) else method
        methods = ", ".join(map(repr, SPECULATIVE_METHODS))
        if method in SPECULATIVE_METHODS_NOT_YET:
            raise ValueError(f"method {method!r} is not implemented yet; the methods are {methods}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"method {method!r} is unknown; the methods are {methods}")
        not_yet = sorted(set(options) & set(SPECULATIVE_KEYS_NOT_YET))
        if not_yet:
            raise ValueError(f"key{'s' if len(not_yet) > 1 else ''} {', '.join(map(repr, not_yet))} "
                             f"{'are' if len(not_yet) > 1 else 'is'} not implemented (the draft model is read "
                             f"from its own files, at the target's max_model_len)")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; the keys "
                             f"are {', '.join(known)}")
        for other, keys in _METHOD_KEYS.items():
            stray = [k for k in keys if k in options and other != method]
            if stray:
                raise ValueError(f"{', '.join(map(repr, stray))} belong{'s' if len(stray) == 1 else ''} to method "
                                 f"{other!r}, not {method!r}")
        if "num_speculative_tokens" not in options:
            raise ValueError("num_speculative_tokens is required (the most tokens proposed a step, e.g. 4)")
        limits = {"num_speculative_tokens": 64, "prompt_lookup_max": 64, "prompt_lookup_min": 64,
                  "disable_by_batch_size": 1 << 20, "draft_tensor_parallel_size": 1}
        for key, top in limits.items():
            value = options.get(key, 1)
            if type(value) is not int or not 1 <= value <= top:
                why = " (the draft model runs on one rank)" if key == "draft_tensor_parallel_size" else ""
                raise ValueError(f"{key} must be an integer in [1, {top}]{why}, got {value!r}")
        if method == "draft_model" and (not isinstance(options.get("model"), str) or not options["model"]):
            raise ValueError(f"method 'draft_model' needs model: the draft model's path (an HF folder or a GGUF "
                             f"file), got {options.get('model')!r}")
        given = dict(options, method=method)
        # One bound given alone moves the other's default out of its way (as vLLM's do).
        if "prompt_lookup_min" in given and "prompt_lookup_max" not in given:
            given["prompt_lookup_max"] = max(given["prompt_lookup_min"], cls.prompt_lookup_max)
        if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:
            given["prompt_lookup_min"] = min(given["prompt_lookup_max"], cls.prompt_lookup_min)
        config = cls(**given)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({config.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({config.prompt_lookup_max})")
        return config


def structured_outputs_backend(options: dict | None) -> str:
    """The grammar backend a structured_outputs_config names ("auto" without one); ValueError names the key."""
    if options is None:
        return "auto"
    if not isinstance(options, dict) or set(options) - {"backend", "enable_in_reasoning"}:
        raise ValueError(f"takes only the keys 'backend' and 'enable_in_reasoning', got {options!r}")
    if not isinstance(options.get("enable_in_reasoning", False), bool):
        raise ValueError(f"enable_in_reasoning must be true or false, got {options['enable_in_reasoning']!r}")
    backend = options.get("backend", "auto")
    if backend not in ("auto", "xgrammar", "guidance"):
        raise ValueError(f"backend must be one of auto, xgrammar, guidance, got {backend!r}")
    return backend


def speculative_config_flag(text: str) -> dict:
    """`--speculative-config '{"method": "ngram", ...}'`: a JSON object, checked as the option is."""
    try:
        value = json.loads(text)
        SpeculativeConfig.from_dict(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def option(default: Any, help: str, *, check: Callable[[Any], bool] | None = None, limit: str = "",
           choices: tuple[str, ...] | None = None, parse: Callable[[str], Any] | None = None,
           alias: str | None = None) -> Any:
    """One engine option: `check(value)` must hold (`limit` says what it asks, for the error);
    `choices` lists the allowed strings; `parse` reads the CLI text; `alias` is a short flag."""
    return field(default=default, metadata={"help": help, "check": check, "limit": limit, "choices": choices,
                                            "parse": parse, "alias": alias})


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model files."""

    model: str | None = option(None, "GGUF file or Hugging Face model directory (default: the bundled "
                                     "SmolLM2-135M-Instruct)")
    dtype: str = option("auto", "weights, activations and KV cache (auto: float32 on the CPU, bfloat16 on a GPU)",
                        choices=DTYPES)
    device: str = option("auto", "where the model runs: auto, cpu or cuda[:N]",
                         check=lambda v: v in ("auto", "cpu") or v.startswith("cuda"),
                         limit="'auto', 'cpu' or 'cuda[:N]'")
    block_size: int = option(16, "tokens per KV block", check=lambda v: 1 <= v <= 1024,
                             limit="an integer in [1, 1024]")
    num_kv_blocks: int | None = option(None, "KV blocks in the pool, each block_size tokens of every layer "
                                       "(default: from --kv-cache-memory)",
                                       check=lambda v: v >= 1, limit="an integer >= 1")
    # Bytes (an int > 1) or a fraction of the memory free at start-up (a float in (0, 1]).
    kv_cache_memory: float | int | None = option(
        None, "KV cache budget: bytes (e.g. 2G, 512M) or a fraction of free memory (e.g. 0.5); default: 1 GiB "
              "on the CPU, or half the free memory if less",
        check=lambda v: (isinstance(v, float) and 0 < v <= 1) or (isinstance(v, int) and v > 1),
        limit="a byte count (int > 1) or a fraction of free memory in (0, 1]", parse=bytes_or_fraction)
    max_num_seqs: int = option(256, "sequences in one step at most", check=lambda v: v >= 1,
                               limit="an integer >= 1")
    max_num_batched_tokens: int = option(2048, "tokens computed in one step at most (longer prompts are "
                                               "prefilled in chunks)", check=lambda v: v >= 1,
                                         limit="an integer >= 1")
    max_model_len: int | None = option(None, "context length (default: the model's)", check=lambda v: v >= 2,
                                       limit="an integer >= 2")
    load_format: str = option("auto", "how to read --model", choices=LOAD_FORMATS)
    quantization: str = option("auto", "how weights are served: auto keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, "
                                       "Q5_K, Q6_K, MXFP4, IQ4_NL and IQ4_XS matrices in their blocks (CPU); none "
                                       "dequantizes every weight to --dtype at load; int8 (per channel) and int4 "
                                       "(groups of 128) quantize a safetensors model's linear layers at load (CPU)",
                               choices=QUANTIZATIONS)
    activation_quantization: str = option(
        "auto", "how a GGUF model's quantized products take their activations (CPU, AVX-512 VNNI or AVX2): "
                "auto takes int8x2 where this CPU has the integer kernels and none elsewhere (and for "
                "batch_invariant); none multiplies them in float32, the dequantized model's product; int8 rounds "
                "them to int8, one scale per 32 values (per 256 for K-quant weights), and multiplies by integer "
                "dot products, as llama.cpp does (fastest decode steps, logprobs move); int8x2 adds a second int8 "
                "code for what the first left (~15 bits, the same scales): most of int8's decode speed, 99.85-100% "
                "greedy agreement measured (the misses at near-ties). docs/quantization.md gives the measured "
                "agreement",
        choices=ACTIVATION_QUANTIZATIONS)
    kv_cache_dtype: str = option("auto", "how the KV cache stores K/V: auto (as --dtype), float32, bfloat16, "
                                         "float16, or 8 bits per value with a float16 scale per token and head: "
                                         "int8, fp8 (= fp8_e4m3), fp8_e5m2 (about half bfloat16's bytes)",
                                 choices=KV_CACHE_DTYPES)
    kv_offload_dir: str | None = option(None, "a directory on local disk for the prefix cache's second tier: "
                                              "blocks evicted from the pool are written there (checksummed) and "
                                              "read back on a later prefix hit instead of recomputed (paged "
                                              "policy, prefix caching on; recurrent layers' state checkpoints too; each "
                                              "tensor-parallel rank keeps its shard in its own file)")
    kv_offload_size: int = option(4 << 30, "bytes of --kv-offload-dir the tier may fill (e.g. 8G; all ranks "
                                           "together); past that it drops its least recently used blocks", check=lambda v: v > 1,
                                  limit="a byte count (e.g. 512M, 8G)", parse=bytes_or_fraction)
    kv_offload_persist: bool = option(False, "keep the tier's file at shutdown and reuse it at the next start "
                                             "(a restarted server keeps its warm prefixes)")
    preemption_mode: str = option("recompute", "what preempting a request does with its KV: recompute (free the "
                                               "blocks; a cached prefix may survive), swap (write them to the "
                                               "--kv-offload-dir tier and read them back when it resumes), auto "
                                               "(swap when moving the bytes is measured to cost less than "
                                               "recomputing the tokens)", choices=PREEMPTION_MODES)
    seed: int = option(0, "seed of unseeded sampling and of random (dummy) weights")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of earlier prompts' shared prefixes")
    kv_policy: str = option("paged", "paged KV blocks, or a contiguous region reserved per request (the "
                                     "pre-paging baselines, for comparison)", choices=KV_POLICIES)
    batch_invariant: bool = option(False, "a request's logits, and so its seeded samples, do not depend on what "
                                          "else runs beside it: alone, batched, chunked or after preemption (CPU; "
                                          "dense and GGUF weights; costs throughput, see docs/python.md)")
    enforce_eager: bool = option(False, "on a GPU, do not capture CUDA graphs for decode")
    pooler_config: dict | None = option(
        None, "how embeddings pool the final hidden states, over what the model's sentence-transformers files say "
              "(default without them: LAST, normalized): a JSON object with pooling_type (LAST, MEAN or CLS) "
              "and/or normalize (true or false), e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": true}'",
        check=check_pooler_overrides, parse=json_object,
        limit='an object with "pooling_type" (LAST, MEAN or CLS) and/or "normalize" (true or false)')
    classifier_from_token: list | None = option(
        None, "score and rerank with this causal LM as a yes/no reranker (as Qwen3-Reranker is used; the key of "
              "vLLM's --hf-overrides): two words of one token each, e.g. '[\"no\", \"yes\"]'; a pair's score is "
              "the probability of the second word against the first after the query's and the document's tokens "
              "(default: the cosine of their embeddings)",
        check=lambda v: len(v) == 2 and all(isinstance(w, str) and w for w in v), parse=json_list,
        limit='a list of two non-empty words, e.g. ["no", "yes"]')
    tensor_parallel_size: int = option(1, "split the model over this many ranks (processes; gloo on the CPU, "
                                          "NCCL on GPUs)", check=lambda v: v >= 1, limit="an integer >= 1",
                                       alias="-tp")
    structured_outputs_config: dict | None = option(
        None, "structured outputs, as vLLM's JSON: {\"backend\": \"auto\"} (default) picks the grammar backend "
              "per constraint, \"xgrammar\" or \"guidance\" (llguidance) pins one; with --reasoning-parser the grammar "
              "starts after the reasoning, unless \"enable_in_reasoning\": true (docs/client-apis.md)",
        check=lambda v: structured_outputs_backend(v) is not None, parse=json_object,
        limit='an object {"backend": "auto" | "xgrammar" | "guidance", "enable_in_reasoning": true | false}')
    speculative_config: dict | None = option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": 8}: prompt lookup "
              "proposes tokens that the model verifies in one step, greedy and sampled outputs unchanged; or "
              "{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}: a smaller model "
              "with the same vocabulary proposes them; or {\"method\": \"mtp\", \"num_speculative_tokens\": 2}: "
              "the model's own multi-token-prediction layer (DeepSeek-V3) does (docs/speculative-decoding.md)",
        check=lambda v: SpeculativeConfig.from_dict(v) is not None, parse=speculative_config_flag)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, checked, or None when off."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(EngineConfig)
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            allowed = _types(hints[f.name])
            if value is None and type(None) in allowed:
                continue
            ok = type(value) in allowed  # exact: a bool is not an int, an int is not a float here
            if ok and meta["choices"] is not None:
                ok = value in meta["choices"]
            if ok and meta["check"] is not None:
                try:
                    ok = meta["check"](value)
                except ValueError as e:  # a check that says itself what is wrong (a structured option)
                    raise ValueError(f"{f.name}: {e}") from None
            if not ok:
                limit = meta["limit"] or (f"one of {meta['choices']}" if meta["choices"] else
                                          "true or false" if allowed == (bool,) else
                                          " or ".join(t.__name__ for t in allowed))
                raise ValueError(f"{f.name} must be {limit}, got {value!r}")


def _types(hint: Any) -> tuple[type, ...]:
    """`int | None` -> (int, NoneType); `str` -> (str,)."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def engine_options() -> list:
    """The option fields, in declaration order."""
    return list(fields(EngineConfig))


def make_config(**options: Any) -> EngineConfig:
    """`EngineConfig(**options)`, with an error that lists the options when one is unknown."""
    known = {f.name for f in engine_options()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                        f"the options are {', '.join(sorted(known))}")
    return EngineConfig(**options)


def signature_with_options(fn: Callable) -> inspect.Signature:
    """`fn(..., **options)`'s signature with every engine option as a keyword-only parameter in
    place of `**options`, so that help() and inspect show the real keywords."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = typing.get_type_hints(EngineConfig)
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
               for f in engine_options() if f.name not in {p.name for p in params}]
    return sig.replace(parameters=params)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per option: `--block-size`, `--kv-cache-memory`, booleans as `--x / --no-x`."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_options():
        meta = f.metadata
        names = ["--" + f.name.replace("_", "-")] + ([meta["alias"]] if meta["alias"] else [])
        default = None if f.default is MISSING else f.default
        # argparse formats help with %: a literal one (">= 99.9%") must be doubled.
        help_text = (meta["help"] + ("" if default is None else f" (default: {default})")).replace("%", "%%")
        allowed = [t for t in _types(hints[f.name]) if t is not type(None)]
        if allowed == [bool]:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=meta["help"].replace("%", "%%"))
        else:
            group.add_argument(*names, dest=f.name, type=meta["parse"] or allowed[0], default=default,
                               choices=meta["choices"], help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options among parsed CLI arguments."""
    return {f.name: getattr(args, f.name) for f in engine_options()}
