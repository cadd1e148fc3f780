"""Incremental detokenization of one sequence's output, with stop strings.

Owns turning the stream of a sequence's output token ids into its output
text: decoding only a small window of ids per step (prefix/read offsets, as
text-generation-inference does), holding back bytes of a character that is not
complete yet, finding stop strings (also across token boundaries) and
truncating at them, and handing out the not-yet-streamed text as deltas.

The tokenizer's ``decode`` must be prefix-stable: decoding more ids only
appends to the text of fewer ids once those end on a character boundary
(true of byte-level BPE and SentencePiece decoders; not of
``clean_up_tokenization_spaces``, which rewrites text behind the cursor).
"""
from __future__ import annotations

from typing import Protocol

from pagellm.sampling_params import SamplingParams

# A decode ending in this may be a multi-byte character whose last bytes are
# still to come; such text is held until a later token completes it.
_REPLACEMENT = "\ufffd"
# A character is at most 4 bytes, so more ids than this that still decode to
# a trailing U+FFFD are invalid bytes, not a character in progress.
_MAX_PENDING = 8
# Bytes after a cut that settle every character before it (a 4-byte
# character has at most 3 continuation bytes).
_SETTLING_CHARS = 3


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one sequence's output ids, updated a few ids at a time.

    Each ``update`` decodes only the ids since the last committed boundary
    plus the one window before it, so its cost does not grow with the length
    of the sequence. The text is that of the output ids alone: once finished it
    equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``, cut at the
    first stop string; ``prompt_token_ids`` are accepted (vLLM's signature) but
    do not take part, since decoding them as left context could change the
    first output characters (SentencePiece drops a leading space only at the
    start of a decode).
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        # ids[:read] are in _text; ids[prefix:read] is decoded again with the
        # new ids so that the decoder sees their left context.
        self._prefix = 0
        self._read = 0
        self._prefix_text: str | None = ""  # decode(ids[prefix:read]); None = not computed
        self._text = ""
        self._sent = 0  # len of _text already returned by get_delta
        self._finished = False
        self.stop_str: str | None = None  # the stop string that ended the text, if any

    # -- public -------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All text so far, cut at a matched stop string.

        Unlike the deltas this includes ids still held back, so while a
        multi-byte character is incomplete it may end in U+FFFD.
        """
        if self._finished or self.stop_str is not None:
            return self._text
        return self._text + self._pending_text()

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append ids; return the stop string that now ends the text, else None.

        After a stop string matched or the text was finished, further ids are
        ignored (the engine stops the sequence there).
        """
        if self._finished or self.stop_str is not None or not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        start = len(self._text)
        held = self._advance()
        # Only a trailing U+FFFD can still change (to the character it
        # starts), so a stop string may already be found in the rest.
        if held.endswith(_REPLACEMENT):
            held = held[:-1]
        return self._find_stop(start, held)

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls.

        While not finished this stops before an incomplete character and
        before any tail that could begin a stop string. ``finished=True`` marks
        the end of the sequence: held-back ids are decoded as they are (a
        dangling partial character becomes U+FFFD, as in a full decode) and all
        remaining text is released.
        """
        if finished and not self._finished:
            if self.stop_str is None:
                pending = self._pending_text()
                if self._find_stop(len(self._text), pending) is None:
                    self._text += pending
            self._finished = True
        end = len(self._text)
        if not (self._finished or self.stop_str is not None):
            end -= self._stop_prefix_len()
        end = max(end, self._sent)
        delta = self._text[self._sent:end]
        self._sent = end
        return delta

    # -- decoding -----------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._prefix_text

    def _pending_text(self) -> str:
        """Text of the held-back ids, decoded as they stand."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._window_prefix_text()
        return self._decode(self._ids[self._prefix:])[len(prefix_text):]

    def _commit(self, text: str, upto: int) -> None:
        self._text += text
        self._prefix, self._read = self._read, upto
        self._prefix_text = None

    def _advance(self) -> str:
        """Move complete text from the held-back ids into ``_text``.

        Returns the text of the ids still held when nothing was committed
        (``""`` otherwise).
        """
        ids = self._ids
        prefix_text = self._window_prefix_text()
        full = self._decode(ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            self._commit(full[len(prefix_text):], len(ids))
            return ""
        if len(ids) - self._read > _MAX_PENDING and self._force_advance(prefix_text, full):
            return ""
        return full[len(prefix_text):]

    def _force_advance(self, prefix_text: str, full: str) -> bool:
        """Bound the window when ids keep decoding to no text or to invalid bytes."""
        ids = self._ids
        if not full.endswith(_REPLACEMENT):
            # Ends on a character boundary; the ids just added no text (e.g.
            # skipped special tokens).
            self._commit(full[len(prefix_text):], len(ids))
            return True
        for cut in range(len(ids) - 1, self._read, -1):
            if len(self._decode(ids[cut:])) < _SETTLING_CHARS:
                continue
            # Enough bytes follow the cut that the text before it is final,
            # provided it agrees with the decode that includes them.
            part = self._decode(ids[self._prefix:cut])
            if len(part) > len(prefix_text) and full.startswith(part):
                self._commit(part[len(prefix_text):], cut)
                return True
        return False

    # -- stop strings -------------------------------------------------------

    def _find_stop(self, start: int, held: str = "") -> str | None:
        """Look for a stop string ending after ``_text[start:]`` in ``_text + held``.

        On a match the text becomes everything before the stop string (or
        through it), and any ``held`` text after it is dropped.
        """
        text = self._text + held
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop, max(0, start - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self._text = text[:at + len(stop) if self._include_stop else at]
        self.stop_str = stop
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent tail of the text that begins some stop string."""
        longest = min(self._max_stop_len - 1, len(self._text) - self._sent)
        for n in range(longest, 0, -1):
            tail = self._text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
