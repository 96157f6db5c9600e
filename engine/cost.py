"""The step cost model: seconds per engine step as a function of its work. Torch-free.

The sim backend (``engine.sim``) paces its steps with it, every worker announces one in
``Welcome.cost``, and the router (``gateway.routing``) predicts time to first token with it, so
the three agree by construction. Step time is

    t = step_overhead_s + prefill_s_per_token * prefill tokens
        + decode_s_per_token * decode tokens + attn_s_per_qk * (query, key) pairs attended
        + mtp_draft_s_per_token * tokens drafted

With MTP (``EngineConfig.speculative_tokens`` = K) a decode step verifies its K drafts as K + 1
decode tokens, and the sim accepts each draft with probability ``mtp_acceptance`` (the first
rejection ends the step's run), so a replay can model MTP: the acceptance length is
(1 - a^(K+1)) / (1 - a).
"""

from __future__ import annotations

import msgspec


class CostModel(msgspec.Struct, frozen=True):
    """Seconds per step. Defaults: fitted to the native backend on the demo model, CPU, one thread
    (``python loadtest/calibrate_sim.py``: 148 steps, 11% total error, 6% median per step)."""

    step_overhead_s: float = 4.4e-3
    prefill_s_per_token: float = 3.6e-5
    decode_s_per_token: float = 1.31e-4
    attn_s_per_qk: float = 3.0e-7
    # MTP (issue 14): one MTP layer's row per drafted token; P(a draft is accepted)
    mtp_draft_s_per_token: float = 0.0
    mtp_acceptance: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mtp_acceptance < 1.0:
            raise ValueError(f"mtp_acceptance={self.mtp_acceptance}: must be in [0, 1)")

    def step_time(self, prefill_tokens: int, decode_tokens: int, qk_pairs: int,
                  drafted_tokens: int = 0) -> float:
        return (self.step_overhead_s + self.prefill_s_per_token * prefill_tokens
                + self.decode_s_per_token * decode_tokens
                + self.attn_s_per_qk * qk_pairs
                + self.mtp_draft_s_per_token * drafted_tokens)


# An H200-class node serving MiMo-V2-Flash (DP 2 x TP 4). Decode: SGLang's day-0 blog reports
# ~150 tok/s per request at 16 requests per DP rank with MTP accept length 3.6 (16k-64k inputs),
# i.e. ~24 ms per step: 20 ms fixed + 0.25 ms per request. Prefill: 20k tok/s per rank is an
# assumption (the blog's prefill figures are only in a chart). SWA keeps attention nearly flat.
H200_COST = CostModel(step_overhead_s=2.0e-2, prefill_s_per_token=5e-5, decode_s_per_token=2.5e-4,
                      attn_s_per_qk=2e-11)
ZERO_COST = CostModel(0.0, 0.0, 0.0, 0.0)
COST_PRESETS = {"cpu": CostModel(), "h200": H200_COST, "zero": ZERO_COST}
