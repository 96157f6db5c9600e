"""Token logprobs from the worker's ids into OpenAI's shapes: ``{token, logprob, bytes,
top_logprobs}`` for chat, ``tokens`` / ``token_logprobs`` / ``top_logprobs`` for completions.

A token's text is its own decode (U+FFFD where it holds part of a character); ``bytes`` are its raw
UTF-8 bytes, so a client can join the pieces of a character split across tokens, as OpenAI
documents it. Byte-level BPE vocabularies (GPT-2 style) map each byte to a printable character;
``TokenTexts`` inverts that map once per tokenizer and memoizes each token.
"""

from collections.abc import Sequence
from functools import cache

from gateway.schemas import TokenLogprob, TopLogprob
from gateway.tokenizer import Tokenizer
from gateway.tokenizer.demo import byte_to_unicode


class TokenTexts:
    """``text(id)`` and ``raw(id)`` of single tokens, memoized (a vocabulary is bounded)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._raw: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        if (text := self._text.get(token_id)) is None:
            text = self._text[token_id] = self._tokenizer.decode([token_id])
        return text

    def raw(self, token_id: int) -> bytes:
        if (raw := self._raw.get(token_id)) is None:
            raw = self._raw[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        text = self.text(token_id)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tokenizer.id_to_token(token_id) or ""
        table = _byte_decoder()
        if piece and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return text.encode()


def chat_logprobs(
    texts: TokenTexts,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per token (``top`` is None when no alternatives were asked for)."""
    out = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        alternatives = [
            TopLogprob(token=texts.text(t), logprob=lp, bytes=list(texts.raw(t)))
            for t, lp in (top[i] if top is not None else ())
        ]
        out.append(TokenLogprob(
            token=texts.text(token_id), logprob=logprob, bytes=list(texts.raw(token_id)),
            top_logprobs=alternatives,
        ))
    return out


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (character -> byte)."""
    return {char: byte for byte, char in byte_to_unicode().items()}
