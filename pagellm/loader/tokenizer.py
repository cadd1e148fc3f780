"""Text <-> token ids, and chat-template rendering, for GGUF files and Hugging Face directories.

This module owns two promises: token ids are exactly those transformers would produce for the same
model (so the backend pipeline is built the way transformers builds it), and a model's chat template,
which is untrusted code, only ever runs inside Jinja's immutable sandbox.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template that come with a model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        cleanup: Callable[[str], str] | None = None,
    ) -> None:
        self._backend = backend
        # Padding or truncation baked into a tokenizer.json would silently change encode() results.
        backend.no_padding()
        backend.no_truncation()
        self._named = {name: tok for name, tok in (special_tokens or {}).items() if tok is not None}
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        self._cleanup = cleanup

    # Construction

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """The tokenizer stored in a GGUF's metadata, built by transformers' own GGUF converter."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        try:
            arch, tok_dict, tok_config = get_gguf_tokenizer(path)
            backend, extra = convert_gguf_tokenizer(arch, tok_dict)
        except Exception as exc:  # a damaged file fails anywhere inside the converter
            raise ValueError(f"cannot build a tokenizer from {path}: {exc}") from exc
        config = {**tok_config, **extra}
        named = {name: config.get(name) for name in _NAMED_SPECIAL}
        # What transformers' TokenizersBackend.__init__ then does to the converted backend:
        # named special tokens become added tokens, matched whole in text...
        added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
        missing = [AddedToken(tok, special=True) for tok in named.values() if tok is not None and tok not in added]
        if missing:
            backend.add_tokens(missing)
        # ...and an explicit add_bos_token/add_eos_token in the metadata rewrites the post-processor.
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_bos_eos_template(
                backend,
                named["bos_token"] if config.get("add_bos_token") else None,
                named["eos_token"] if config.get("add_eos_token") else None,
            )
        return cls(backend, special_tokens=named, chat_template=_pick_template(config.get("chat_template")))

    @classmethod
    def from_hf_dir(cls, model_dir: str) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory: tokenizer.json + tokenizer_config.json,
        or a SentencePiece tokenizer.model alone (many Llama 2 and Mistral releases), which
        transformers' own converter turns into the same fast pipeline (sentencepiece, protobuf).

        transformers 5 rebuilds the pipeline of model-specific classes instead of using tokenizer.json
        as written (LlamaTokenizer swaps in its own Metaspace pre-tokenizer, for instance), so to get
        the same ids the backend is taken from AutoTokenizer, strictly offline and without remote code.
        """
        if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")):
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (or SentencePiece tokenizer.model)")
        from transformers import AutoTokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        try:
            hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
        if not isinstance(hf, TokenizersBackend):
            raise ValueError(f"{model_dir}: tokenizer class {type(hf).__name__} is not backed by tokenizer.json")
        backend = hf.backend_tokenizer
        cleanup = None
        if hf.clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE":
            # transformers applies this after decoding, except for BPE models.
            cleanup = hf.clean_up_tokenization
        named = {name: getattr(hf, name, None) for name in _NAMED_SPECIAL}
        return cls(backend, special_tokens=named, chat_template=_pick_template(hf.chat_template), cleanup=cleanup)

    # Tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS are added exactly when transformers would add them."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Token ids of two texts joined as one input, with the special tokens the tokenizer puts
        around and between them (transformers' `tokenizer(text, pair)`, what cross-encoders read)."""
        return self._backend.encode(text, pair, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._cleanup(text) if self._cleanup else text

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(i)
        if token is None:
            raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` pipeline itself (for libraries that read the vocabulary, as xgrammar)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def all_special_ids(self) -> set[int]:
        """The named special tokens plus every added token flagged special (what decode may skip)."""
        ids = {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self._token_id(name) for name in self._named) if i is not None)
        return ids

    def _token_id(self, name: str) -> int | None:
        token = self._named.get(name)
        return None if token is None else self._backend.token_to_id(token)

    # Chat

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def reserved_template_variables(self) -> frozenset[str]:
        """Template variables the caller's extra keyword arguments may not set: the conversation,
        the generation prompt switch, tools and documents, and the model's special tokens."""
        return frozenset({"messages", "add_generation_prompt", "tools", "documents", *self._named})

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, in a sandbox. `continue_final_message`:
        the text ends inside the last message (its end-of-turn cut off), so a reply continues it,
        as transformers does."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be set: one "
                                 "continues the last message, the other starts a new one")
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise ValueError("continue_final_message needs a last message with text content")
            text = self.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
            where = text.rfind(final.strip())
            if where < 0:
                raise ValueError("continue_final_message: the chat template does not show the last message's "
                                 "text as it is")
            # Keep the message's own trailing spaces when the template kept them.
            kept = final.lstrip()
            end = where + (len(kept) if text[where:where + len(kept)] == kept else len(final.strip()))
            return text[:end]
        # Keys set to None are dropped, as transformers does: templates test for presence, not for None.
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        context = {
            **self._named,
            "tools": None,
            "documents": None,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            if self._compiled is None:
                self._compiled = _sandbox().from_string(self._chat_template)
            return self._compiled.render(**_plain(context))
        except Exception as exc:  # the template is untrusted code: any failure is its failure
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def _set_bos_eos_template(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Post-processor adding `bos` before and `eos` after each sequence (either may be None)."""
    single = " ".join(x for x in (f"{bos}:0" if bos else "", "$A:0", f"{eos}:0" if eos else "") if x)
    pair = " ".join(x for x in (single, f"{bos}:1" if bos else "", "$B:1", f"{eos}:1" if eos else "") if x)
    specials = [(tok, backend.token_to_id(tok)) for tok in (bos, eos) if tok]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _pick_template(template: Any) -> str | None:
    """A template string from any of transformers' spellings (str, {name: str}, [{name, template}])."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _plain(value: Any) -> Any:
    """Copy template inputs into plain JSON-like types, so the sandbox never meets rich objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes, a way towards Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Same self-less signature as Jinja's Namespace, so `namespace(self=...)` keeps working.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike Jinja's own tojson, no HTML escaping: chat templates emit JSON for the model, not a browser.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it just renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _sandbox() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, so templates see the same helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    # A plain function instead of the `dict` type itself, whose class attributes reach further.
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    return env
