"""Speculative decoding's bookkeeping on the scheduler's side: how many tokens each sequence
proposes, and what was proposed and accepted (vLLM's spec_decode_* counters).

The runner proposes and verifies (worker/proposers, worker/rejection_sampler.py); the scheduler
gives each verified proposal its slots, and takes back the rejected ones' (KVManager.truncate).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def next_lookahead(lookahead: int, proposed: int, accepted: int, most: int) -> int:
    """How many tokens a sequence asks the proposer for next, after `accepted` of the `proposed`
    it was verifying were kept (it had asked for `lookahead`): twice as many after a full
    acceptance (up to `most`), else one more than were accepted. A sequence whose proposals keep
    failing so costs one extra token a step, and one that copies soon proposes `most`."""
    if accepted >= proposed:
        return min(most, max(lookahead, 2 * proposed))
    return max(1, accepted + 1)


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps of one sequence
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    # Entry j: proposals whose j-th token was accepted.
    accepted_per_position: list[int] = field(default_factory=list)
    # Steps that only decoded (each sequence its last token and the proposals it verifies), by their
    # rows: how many, and their seconds in all. What a verified row costs against a plain step on
    # this machine, which bounds what speculation can gain (docs/speculative-decoding.md).
    decode_steps_by_rows: dict[int, int] = field(default_factory=dict)
    decode_seconds_by_rows: dict[int, float] = field(default_factory=dict)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def record_step(self, rows: int, seconds: float) -> None:
        self.decode_steps_by_rows[rows] = self.decode_steps_by_rows.get(rows, 0) + 1
        self.decode_seconds_by_rows[rows] = self.decode_seconds_by_rows.get(rows, 0.0) + seconds

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
                "accepted_per_position": list(self.accepted_per_position),
                "decode_steps_by_rows": {rows: {"steps": n, "mean_ms": 1e3 * self.decode_seconds_by_rows[rows] / n}
                                         for rows, n in sorted(self.decode_steps_by_rows.items())}}
