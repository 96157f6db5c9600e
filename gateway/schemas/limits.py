"""The request bounds checked before any expensive work (rendering, tokenizing, grammar
compiling), in one place. A request over a bound is a 400 naming the field.

    | bound                    | default      | why                                              |
    |--------------------------|--------------|--------------------------------------------------|
    | max_messages             | 4,096        | each message renders a few template tokens;      |
    |                          |              | 400k empty ones blocked the loop for 27 s        |
    | max_tools                | 256          | OpenAI allows 128; each tool renders its schema  |
    | max_schema_depth         | 64           | JSON nesting of one tool's parameters or a       |
    |                          |              | response_format schema; deeper is never a real   |
    |                          |              | schema and recursed to a 500 at ~1,000           |
    | max_schema_nodes         | 100,000      | JSON values over all tool schemas and the        |
    |                          |              | response_format schema                           |
    | max_stop_strings         | 16           | OpenAI allows 4                                  |
    | max_stop_chars           | 1,024        | characters per stop string                       |
    | large_input_chars        | 65,536       | above this the prompt is rendered and tokenized  |
    |                          |              | on a thread, not on the event loop               |

Characters against the context: a token covers at most ``max_token_chars`` characters (the
longest vocabulary entry, special tokens included), so a prompt whose messages hold more than
``max_context * max_token_chars * PROMPT_CHARS_SLACK`` characters cannot fit and is refused
before tokenizing (400 ``context_length_exceeded`` naming ``messages`` / ``prompt``). The slack
covers normalizers that fold several characters into one.
"""

from dataclasses import dataclass

PROMPT_CHARS_SLACK = 2
MAX_INT64 = 2**63 - 1


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds of the module docstring's table."""

    max_messages: int = 4096
    max_tools: int = 256
    max_schema_depth: int = 64
    max_schema_nodes: int = 100_000
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    large_input_chars: int = 64 * 1024

    def __post_init__(self) -> None:
        assert min(self.max_messages, self.max_tools, self.max_schema_depth,
                   self.max_schema_nodes, self.max_stop_strings, self.max_stop_chars,
                   self.large_input_chars) > 0, f"{self}: every bound > 0"


DEFAULT_LIMITS = RequestLimits()


def max_prompt_chars(max_context: int, max_token_chars: int) -> int:
    """Characters beyond which a prompt surely has more than ``max_context`` tokens."""
    return max_context * max(max_token_chars, 1) * PROMPT_CHARS_SLACK
