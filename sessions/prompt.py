"""Incremental prompts: a session keeps the token ids of its rendered conversation, so a turn
renders and tokenizes only what it appended. With k messages covered by ``Session.prompt_ids``
and the turn's messages appended after them:

    | piece      | text                                                  | token ids           |
    |------------|-------------------------------------------------------|---------------------|
    | prefix     | render(messages[:k], gen=False)                       | stored, reused      |
    | body       | render(anchor + messages[k:], gen=False)[len(a0):]    | encode(body)        |
    | gen prompt | render(anchor + messages[k:], gen=True)[len(a1):]     | encode(gen)         |

anchor = [messages[0], messages[k-1]] (one of them when k == 1, none when k == 0) gives the
template the context it reads (the system message and tool list, the previous message's role);
a0 = render(anchor, gen=False), a1 = the body's render. prefix + body becomes the session's next
``prompt_ids``, covering every message sent so far.

Exact only if the template is prefix-stable and the pieces tokenize as their concatenation
would; both are checked, never assumed (the same checks as ``gateway.prompt_cache``):
- each request: render(anchor) must be a prefix of render(anchor + new), and that of the render
  with the generation prompt; each cut between pieces must touch an added token that strips no
  whitespace (``<|im_start|>``, ``<|im_end|>``, ``</tool_response>``): added tokens are split
  out before BPE, so no merge crosses them;
- the first ``verify_first`` requests of each kind (with or without tools, k == 0 or not) are
  compared with a full ``encode_chat``; a mismatch sends that kind to full renders for good.
A failed check falls back to a full render, which is always right.

Not thread-safe: call it from one event loop.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from sessions.model import Message

Tools = Sequence[Mapping[str, Any]] | None


class ChatTokenizer(Protocol):
    """What the prompter needs of ``gateway.tokenizer.Tokenizer``."""

    def apply_chat_template(
        self, messages: Sequence[Message], tools: Tools = None, add_generation_prompt: bool = True
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(
        self, messages: Sequence[Message], tools: Tools = None, add_generation_prompt: bool = True
    ) -> list[int]: ...


class TurnPrompt(NamedTuple):
    """Attributes:
    token_ids: the prompt (every message, then the generation prompt).
    prefix_ids: every message without the generation prompt: the session's next prompt_ids.
    num_messages: how many messages ``prefix_ids`` cover (0: nothing worth storing).
    reused_tokens: leading ids taken from the session's stored ids.
    is_incremental: rendered from the pieces (False: a full render).
    """

    token_ids: list[int]
    prefix_ids: list[int]
    num_messages: int
    reused_tokens: int
    is_incremental: bool


def cut_ids_of(tokenizer: Any) -> list[int]:
    """The cut ids of a ``gateway.tokenizer.Tokenizer``: its added tokens that strip nothing."""
    added = tokenizer.backend.get_added_tokens_decoder()
    return [i for i, t in added.items() if not (t.lstrip or t.rstrip)]


class Pieces(NamedTuple):
    body_ids: list[int]  # messages[k:] without the generation prompt
    gen_ids: list[int]  # the generation prompt
    rendered_chars: int  # characters the chat template rendered for them


class PieceRenderer:
    """Renders and tokenizes only ``messages[k:]``, given the stored ids of ``messages[:k]``
    (the table above); shared by ``SessionPrompter`` and ``gateway.prompt_cache.PromptCache``.

    Args:
        cut_ids: added tokens that strip no whitespace; a cut between pieces must touch one.
    """

    def __init__(self, tokenizer: ChatTokenizer, cut_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._cut_ids = frozenset(cut_ids)
        # (has_tools, last role) -> the generation prompt's text and ids
        self._suffixes: dict[tuple[bool, Any], tuple[str, tuple[int, ...]]] = {}
        self._unsafe_suffixes: set[tuple[bool, Any]] = set()

    def pieces(
        self, messages: Sequence[Message], tools: Tools, k: int, prefix_ids: Sequence[int]
    ) -> Pieces | None:
        """The ids of ``messages[k:]`` and of the generation prompt, or None where a prefix or
        cut check fails (the caller renders in full)."""
        render = self._tokenizer.apply_chat_template
        anchor = _anchor(messages, k)
        anchor_text = render(anchor, tools, add_generation_prompt=False) if anchor else ""
        new = [*anchor, *messages[k:]]
        has_new = k < len(messages)
        body_text = render(new, tools, add_generation_prompt=False) if has_new else anchor_text
        suffix, suffix_ids = self._generation_suffix(new, tools)
        if not body_text.startswith(anchor_text):
            return None
        rendered_chars = len(body_text) + len(suffix) + len(body_text) * has_new + len(anchor_text)
        body_ids = self._tokenizer.encode(body_text[len(anchor_text):])
        gen_ids = self._tokenizer.encode(suffix) if suffix_ids is None else list(suffix_ids)
        if not self._are_safe_cuts([list(prefix_ids[-1:]), body_ids, gen_ids]):
            return None
        return Pieces(body_ids, gen_ids, rendered_chars)

    def _generation_suffix(
        self, messages: Sequence[Message], tools: Tools
    ) -> tuple[str, tuple[int, ...] | None]:
        """What ``add_generation_prompt=True`` appends to ``messages``' rendering, and its ids
        (None: tokenize it).

        NOTE: it depends on the template, the tools' presence and the last message's role only
        (so it is rendered and tokenized once per such key, saving a render and an encode per
        request); checked by rendering both ways the first time, and a key where the check fails
        always renders both ways.
        """
        last = messages[-1] if messages else None
        role = last.get("role") if isinstance(last, Mapping) else None
        key = (bool(tools), role)
        if (known := self._suffixes.get(key)) is not None:
            return known
        render = self._tokenizer.apply_chat_template
        body = render(messages, tools, add_generation_prompt=False)
        full = render(messages, tools, add_generation_prompt=True)
        suffix = full[len(body):]
        if full.startswith(body) and key not in self._unsafe_suffixes:
            self._suffixes[key] = (suffix, tuple(self._tokenizer.encode(suffix)))
        else:
            self._unsafe_suffixes.add(key)
        return suffix, None

    def _are_safe_cuts(self, pieces: list[list[int]]) -> bool:
        nonempty = [p for p in pieces if p]
        pairs = zip(nonempty, nonempty[1:], strict=False)
        return all(left[-1] in self._cut_ids or right[0] in self._cut_ids for left, right in pairs)


class SessionPrompter:
    def __init__(
        self, tokenizer: ChatTokenizer, cut_ids: Collection[int], verify_first: int = 1
    ) -> None:
        self._tokenizer = tokenizer
        self._pieces = PieceRenderer(tokenizer, cut_ids)
        self.verify_first = verify_first
        self._verified: dict[tuple[bool, bool], int] = {}
        self._unstable: set[bool] = set()  # has_tools values that always render in full
        self.num_incremental = 0
        self.num_full = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, verify_first: int = 1) -> SessionPrompter:
        return cls(tokenizer, cut_ids_of(tokenizer), verify_first)

    def render(
        self,
        messages: Sequence[Message],
        tools: Tools,
        prefix_ids: Sequence[int] = (),
        num_covered: int = 0,
    ) -> TurnPrompt:
        """The prompt of ``messages`` (all of them, system first), exactly
        ``tokenizer.encode_chat(messages, tools, add_generation_prompt=True)``, reusing
        ``prefix_ids`` (the stored render of ``messages[:num_covered]``).

        Raises what the template raises (jinja2.TemplateError, ValueError, TypeError).
        """
        has_tools = bool(tools)
        if not 0 <= num_covered <= len(messages) or (num_covered > 0 and not prefix_ids):
            num_covered, prefix_ids = 0, ()
        if has_tools in self._unstable or not messages:
            return self._full(messages, tools)
        pieces = self._pieces.pieces(messages, tools, num_covered, prefix_ids)
        if pieces is None:
            return self._full(messages, tools)
        body_ids, gen_ids, _ = pieces
        prefix = [*prefix_ids, *body_ids]
        token_ids = [*prefix, *gen_ids]
        if not self._check(has_tools, num_covered > 0, messages, tools, token_ids):
            return self._full(messages, tools)
        self.num_incremental += 1
        return TurnPrompt(token_ids, prefix, len(messages), len(prefix_ids), True)

    def _check(
        self,
        has_tools: bool,
        is_extension: bool,
        messages: Sequence[Message],
        tools: Tools,
        token_ids: list[int],
    ) -> bool:
        kind = (has_tools, is_extension)
        if self._verified.get(kind, 0) >= self.verify_first:
            return True
        if self._tokenizer.encode_chat(messages, tools, add_generation_prompt=True) != token_ids:
            self._unstable.add(has_tools)
            return False
        self._verified[kind] = self._verified.get(kind, 0) + 1
        return True

    def _full(self, messages: Sequence[Message], tools: Tools) -> TurnPrompt:
        self.num_full += 1
        render = self._tokenizer.apply_chat_template
        gen_text = render(messages, tools, add_generation_prompt=True)
        token_ids = self._tokenizer.encode(gen_text)
        body_text = render(messages, tools, add_generation_prompt=False) if messages else ""
        body_ids = self._tokenizer.encode(body_text) if gen_text.startswith(body_text) else None
        if body_ids and token_ids[: len(body_ids)] == body_ids:
            return TurnPrompt(token_ids, body_ids, len(messages), 0, False)
        return TurnPrompt(token_ids, [], 0, 0, False)


def _anchor(messages: Sequence[Message], k: int) -> list[Message]:
    if k == 0:
        return []
    if k == 1:
        return [messages[0]]
    return [messages[0], messages[k - 1]]
