"""StreamDecoder: incremental detokenization that only ever emits whole characters."""

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class StreamDecoder:
    """Turn a stream of token ids into text deltas, one `feed` per generated token.

    A character whose UTF-8 bytes span several tokens comes out with the token that completes
    it. Bytes that can never form a character come out as U+FFFD once a later token completes
    the text after them, or at `flush()`. Works with any tokenizer whose `decode` is
    deterministic (byte-level BPE, SentencePiece with byte fallback, ...), the same
    prefix-window method as vLLM and TGI:

        | window ids        | meaning                                         |
        |-------------------|-------------------------------------------------|
        | [0, num_emitted)  | already emitted; decoded again only as context  |
        | [num_emitted, :)  | pending: their text ends in an unfinished char  |

    Decoding the emitted ids again (instead of one token alone) keeps tokenizers that strip a
    leading space at the start of a decode (SentencePiece) correct. Not thread-safe.
    """

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._num_emitted = 0

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self._window.append(token_id)
        emitted_text = self._decode(self._window[: self._num_emitted])
        text = self._decode(self._window)
        # NOTE: a trailing U+FFFD is either an unfinished character or invalid bytes; the next
        # token tells which, so hold it back until then.
        if len(text) <= len(emitted_text) or text.endswith(_REPLACEMENT):
            return ""
        # The emitted ids of this step become the context of the next one.
        self._window = self._window[self._num_emitted :]
        self._num_emitted = len(self._window)
        return text[len(emitted_text) :]

    def feed_many(self, token_ids: Sequence[int]) -> str:
        """Add several tokens at once: the same text as joining ``feed`` of each, with one
        decode instead of two per token when the chunk ends on a whole character."""
        if len(token_ids) <= 1:
            return "".join(map(self.feed, token_ids))
        emitted_text = self._decode(self._window[: self._num_emitted])
        window = [*self._window, *token_ids]
        text = self._decode(window)
        if text.endswith(_REPLACEMENT) or len(text) < len(emitted_text):
            return "".join(map(self.feed, token_ids))  # NOTE: rare: hold back per token
        # The ids emitted by this call become the context of the next one (as in ``feed``).
        self._window = window[self._num_emitted :]
        self._num_emitted = len(self._window)
        return text[len(emitted_text) :]

    def flush(self) -> str:
        """Return whatever is pending (unfinished bytes as U+FFFD) and start over."""
        emitted_text = self._decode(self._window[: self._num_emitted])
        text = self._decode(self._window)
        self._window = []
        self._num_emitted = 0
        return text[len(emitted_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
