"""The agent workload's knobs (``replay.workloads.agent_workload``), each with its source.

Sources (../shared/reference/routers.md §6 and §10):
- Claude Code traces (Weka): median main-agent input 195K tokens, output 317; 96 % of turns reuse
  >= 90 % of their input; inter-call gaps median 2 s, p99 11 min; 52 % of requests arrive in
  sub-agent groups (median 7, p90 51).
- vLLM AgentX: median 43 turns per session, 142K input, 444 output, sub-agents in 44 % of
  sessions. Codex / SWE-bench Pro: ~80K context by turn 30.
- llm-d GLM blog: median gap 2 s, p99 11.4 min between turns of coding agents.
Scaled down where noted so that a default run (64 sessions) replays in a minute or two: sessions
of 5-40 turns (median 10) reach ~30-100K tokens instead of 142-195K.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal draw ``exp(N(ln median, sigma))``, rounded and clipped to
    [min_value, max_value]."""

    median: float
    sigma: float
    min_value: int
    max_value: int

    def __post_init__(self) -> None:
        assert self.median > 0 and self.sigma >= 0, f"{self}: median > 0, sigma >= 0"
        assert 1 <= self.min_value <= self.max_value, f"{self}: 1 <= min <= max"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool: its share of tool calls, its pause median (the log-normal's sigma is shared,
    ``AgentParams.pause_sigma``) and the size of its result in tokens."""

    weight: float
    pause_median_s: float
    result_tokens: LogNormal

    def pause_s(self, rng: random.Random, sigma: float) -> float:
        return rng.lognormvariate(math.log(self.pause_median_s), sigma)


# NOTE: the medians and the shared sigma (2.22) were solved together so that the mixture over the
# tools other than "task" has median 2.0 s and p99 ~11 min (660 s), the published gap figures;
# tests/replay/test_workloads.py checks both on samples. The per-tool medians are assumptions
# (reads and searches are fast, shell commands such as builds and tests are slow).
TOOLS: dict[str, ToolSpec] = {
    "read_file": ToolSpec(0.30, 0.7, LogNormal(1500, 0.9, 32, 16384)),
    "grep": ToolSpec(0.20, 1.1, LogNormal(400, 0.9, 32, 8192)),
    "edit_file": ToolSpec(0.20, 2.0, LogNormal(300, 0.6, 32, 4096)),
    "bash": ToolSpec(0.22, 11.0, LogNormal(800, 1.0, 32, 16384)),
    "web_fetch": ToolSpec(0.08, 5.5, LogNormal(2500, 0.8, 64, 16384)),
    # Sub-agent fan-out (Claude Code's Task tool): never drawn as an ordinary call; the main
    # session resumes this long after spawning, with the sub-agents' summaries as its result.
    # NOTE: closed loop has one parent per turn, so the main session does not wait for its
    # sub-agents' last turns; the pause (median 60 s, an assumption) stands in for their run.
    "task": ToolSpec(0.0, 60.0, LogNormal(1200, 0.5, 128, 8192)),
}
TOOL_PAUSE_SIGMA = 2.22


@dataclass(frozen=True, slots=True)
class AgentParams:
    """Knobs of ``agent_workload``. Token counts are tokens, times seconds."""

    # Open-loop session starts (Poisson). An assumption: 64 sessions start over ~2 minutes.
    session_rate_per_s: float = 0.5
    # Tenants and their weights (an assumption: one big tenant, two small ones).
    tenants: tuple[tuple[str, float], ...] = (("t0", 0.6), ("t1", 0.3), ("t2", 0.1))
    # System prompt + tool definitions, shared by every session that uses that variant
    # (rounded up to whole blocks). Coding agents ship ~10-20K tokens of them.
    system_prompt_tokens: tuple[int, ...] = (10240, 14336)
    # Turns per main session: 5-40, median 10, a long tail (AgentX reports a median of 43:
    # scaled down); the longest histories pass 100K tokens.
    turns: LogNormal = LogNormal(10, 0.8, 5, 40)
    # The first user message, and a user's follow-up when a turn ends without tool calls.
    task_tokens: LogNormal = LogNormal(300, 0.8, 32, 4096)
    # Answers: agent turns are long prompts and short outputs (Weka: median 317; AgentX 444).
    output_tokens: LogNormal = LogNormal(250, 0.45, 64, 1024)
    # A non-final turn ends in tool calls with this probability (the last one never does).
    tool_call_prob: float = 0.92
    # Share of tool-calling turns with 2-3 parallel calls. NOTE: the pause is drawn from the
    # first call's tool, which stands for the slowest of them (keeps the gap distribution).
    parallel_tools_prob: float = 0.15
    # Shared sigma of the tool pauses' log-normals (see TOOLS).
    pause_sigma: float = TOOL_PAUSE_SIGMA
    # A user's think time before a follow-up message (an assumption: median 15 s).
    user_think_median_s: float = 15.0
    user_think_sigma: float = 1.0
    # A session ends early rather than outgrow this context.
    max_context_tokens: int = 131072
    # Sub-agents: a main turn spawns a group with this probability (~35 % of sessions get one;
    # AgentX: 44 %). Group size: median 7, p90 51 (Weka), capped at 12 to bound the run: each
    # sub-agent resends its parent's whole context.
    subagent_turn_prob: float = 0.05
    subagents: LogNormal = LogNormal(7, 1.55, 2, 12)
    subagent_turns: LogNormal = LogNormal(3, 0.5, 2, 8)
    subagent_task_tokens: LogNormal = LogNormal(200, 0.6, 32, 2048)
    # Siblings arrive this long after the spawning turn ends, spread over a window this wide.
    fanout_delay_s: float = 0.2
    sibling_jitter_s: float = 0.05

    def __post_init__(self) -> None:
        assert self.session_rate_per_s > 0, "session_rate_per_s > 0"
        assert self.tenants and all(w > 0 for _, w in self.tenants), "tenant weights > 0"
        assert self.system_prompt_tokens and min(self.system_prompt_tokens) >= 1
        for name in ("tool_call_prob", "parallel_tools_prob", "subagent_turn_prob"):
            assert 0 <= getattr(self, name) <= 1, f"{name}: a probability"
        assert self.fanout_delay_s >= 0 and self.sibling_jitter_s >= 0
