"""Multi-token-prediction proposals: the target's own MTP layer (DeepSeek-V3's
num_nextn_predict_layers, Qwen3.5's mtp.*) reads the target's hidden states and proposes k tokens
ahead.

An MTP layer's entry at position p reads the target's final hidden state at p and the token at
p + 1 (models/mtp.py, MultiTokenPredictor), and its output predicts the token at p + 2. Entries
are written into the layer's own paged KV cache, a pool and KV coordinator of its own sized beside
the target's as a draft model's is (engine/draft.py): every position the target computes becomes
an entry once the token after it is known. A chunk's rows are read in the step that computed them
(all but the last, whose next token is the next chunk's first or the sampled token); the rows of
drafts under verification wait for the verdict, and only the accepted ones are read. The entry of
the last position (the one that sampled) proposes the first token; each further token chains one
more entry of the layer on its own output and the token it just proposed. Those chained entries are
guesses: the next proposal truncates the cache back to the entries made of the target's states.

The layer must have seen every position of a sequence: one whose first positions the target did
not compute (a prefix-cache hit, a swapped-in or forked sequence) proposes nothing, and is decoded
plainly. The drafts of a sampled request are drawn as a draft model's are (draft_model.draw_proposals)
and verified by rejection sampling against that distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from pagellm.core.step_plan import PlannedSeq
from pagellm.worker.proposers.base import Proposal, ProposalQuery
from pagellm.worker.proposers.draft_model import DraftSequence, ModelProposer, draw_proposals

if TYPE_CHECKING:
    from pagellm.worker.model_runner import ModelRunner


@dataclass
class _MTPState:
    """One sequence as the MTP layer follows it. `entries.tokens[p]` is the token after position p
    that entry p read; the first `valid` entries read the target's hidden states, the rest are the
    last proposal's chain. `pending` holds the target's hidden rows of positions valid, valid + 1,
    ... whose next token was not known yet; `known` the sequence's tokens by position as the steps
    showed them (drafts under verification included); `lost`: the target computed positions this
    layer never saw, so it stays silent for this sequence."""

    entries: DraftSequence
    valid: int = 0
    pending: torch.Tensor | None = None
    known: list[int] = field(default_factory=list)
    lost: bool = False

    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else len(self.pending)


@dataclass
class _Read:
    """Entries to write for one sequence in a forward pass of the layer: the tokens after positions
    start .. start + len(tokens) - 1 and the hidden rows of those positions."""

    state: _MTPState
    tokens: list[int]
    hidden: torch.Tensor


class MTPProposer(ModelProposer):
    """Runs the MTP layer (a MultiTokenPredictor model) over its own paged cache."""

    label = "MTP layer"
    reads_hidden_states = True
    seqs: dict[str, _MTPState]

    # ---- the target's steps -----------------------------------------------------------------------
    def observe(self, seqs: Sequence[PlannedSeq], hidden: torch.Tensor) -> None:
        reads = []
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            rows, row = hidden[row:row + n], row + n
            if s.pool:
                continue  # an embedding request: nothing to propose for
            state = self.seqs.get(s.request_id)
            if state is None:
                state = self.seqs[s.request_id] = _MTPState(DraftSequence(s.request_id))
            if state.lost or not self._take_rows(state, s.start, rows):
                continue
            state.known[s.start:] = s.token_ids
            # The tokens known for sure: not the drafts this step verifies.
            settled = s.start + (1 if s.draft_token_ids else n)
            read = self._settle(state, settled)
            if read is not None:
                reads.append(read)
        if reads:
            self._forward(reads, extra_slots=0)

    def _take_rows(self, state: _MTPState, start: int, rows: torch.Tensor) -> bool:
        """Append a step's hidden rows of positions start ..; False (and the sequence is lost) when
        positions before `start` were computed without this layer seeing them."""
        have = state.valid + state.num_pending
        if start > have:
            self._lose(state)
            return False
        if start < state.valid:  # positions computed again (a step retried): forget what followed
            self._truncate(state, start)
            state.valid, state.pending = start, None
        keep = None if state.pending is None else state.pending[:start - state.valid]
        state.pending = rows if keep is None or not len(keep) else torch.cat([keep, rows])
        return True

    def _settle(self, state: _MTPState, settled: int) -> _Read | None:
        """The pending rows whose next token is known (positions p with p + 1 < settled) as entries
        to write; the others stay pending (copied: the step's hidden states are not kept)."""
        n = min(state.num_pending, max(0, settled - 1 - state.valid))
        if n == 0:
            if state.pending is not None:
                state.pending = state.pending.clone()
            return None
        rows, rest = state.pending[:n], state.pending[n:]
        state.pending = rest.clone() if len(rest) else None
        return _Read(state, state.known[state.valid + 1:state.valid + 1 + n], rows)

    # ---- proposals -------------------------------------------------------------------------------
    def propose_for(self, queries: Sequence[ProposalQuery]) -> list[Proposal]:
        reads, runs = [], []
        for q in queries:
            state = self.seqs.get(q.request_id)
            context = list(q.context)
            k = min(q.num_tokens, self.runner.max_model_len - len(context))
            if state is None or state.lost or k < 1:
                continue
            state.known = context
            if state.num_pending:  # rows past the last accepted token: rejected drafts' states
                kept = state.pending[:max(0, len(context) - 1 - state.valid)]
                state.pending = kept if len(kept) else None
            read = self._settle(state, len(context))
            if read is None or state.valid + len(read.tokens) != len(context) - 1:
                continue  # the last position's state never came (a step without this sequence)
            reads.append(read)
            runs.append((q, k))
        out = {}
        if reads:
            last = self._forward(reads, extra_slots=[k - 1 for _, k in runs])
            alive = [(q, k, r) for (q, k), r in zip(runs, reads) if r.state.entries.request_id in last]
            out = self._chain([(q, k) for q, k, _ in alive], [last[q.request_id] for q, _, _ in alive])
        return [out.get(q.request_id, Proposal([])) for q in queries]

    def _chain(self, runs: list[tuple[ProposalQuery, int]], hidden: list[torch.Tensor]) -> dict[str, Proposal]:
        """Propose from each run's last entry's output, then chain the layer on its own output and
        its proposal until each run has its k tokens (the last proposal is not read)."""
        drafts: dict[str, list[int]] = {q.request_id: [] for q, _ in runs}
        probs: dict[str, list[torch.Tensor]] = {q.request_id: [] for q, _ in runs}
        active = list(range(len(runs)))
        rows = torch.stack(hidden)
        while True:
            specs = [replace(runs[i][0].sampler, output_token_ids=[*runs[i][0].sampler.output_token_ids,
                                                                   *drafts[runs[i][0].request_id]])
                     for i in active]
            logits = self.runner.model.compute_logits(rows)
            tokens, p = draw_proposals(logits, specs, self.eos_token_ids, self.vocab_size, self.generator)
            for j, i in enumerate(active):
                rid = runs[i][0].request_id
                drafts[rid].append(tokens[j])
                if not specs[j].params.greedy:
                    probs[rid].append(p[j])
            keep = [j for j, i in enumerate(active) if len(drafts[runs[i][0].request_id]) < runs[i][1]]
            if not keep:
                break
            plan = []
            for j in keep:
                entries = self.seqs[runs[active[j]][0].request_id].entries
                plan.append(PlannedSeq(entries.request_id, [tokens[j]], entries.num_computed_tokens,
                                       self.kv.group_tables(entries.request_id)))
                entries.tokens.append(tokens[j])
            rows = self.runner.forward_hidden(plan, rows[keep])
            active = [active[j] for j in keep]
        return {q.request_id: Proposal(drafts[q.request_id],
                                       torch.stack(probs[q.request_id]) if probs[q.request_id] else None)
                for q, _ in runs}

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            state = self.seqs.pop(rid, None)
            if state is not None:
                self.kv.free(state.entries)

    # ---- the layer's cache -------------------------------------------------------------------------
    def _forward(self, reads: list[_Read], extra_slots: int | list[int]) -> dict[str, torch.Tensor]:
        """Write the entries of `reads` (dropping any chain after each sequence's valid entries), with
        `extra_slots` more slots taken for a chain to follow; each sequence's last output row, by id
        (a sequence whose slots cannot be had is lost instead)."""
        plan, hidden, done = [], [], []
        extras = extra_slots if isinstance(extra_slots, list) else [extra_slots] * len(reads)
        for read, extra in zip(reads, extras):
            state = read.state
            self._truncate(state, state.valid)
            if not self.kv.allocate_slots(state.entries, len(read.tokens) + extra):
                self._lose(state)
                continue
            plan.append(PlannedSeq(state.entries.request_id, read.tokens, state.valid,
                                   self.kv.group_tables(state.entries.request_id)))
            hidden.append(read.hidden)
            done.append(read)
        if not plan:
            return {}
        out = self.runner.forward_hidden(plan, torch.cat(hidden))
        last, end = {}, 0
        for read in done:
            end += len(read.tokens)
            last[read.state.entries.request_id] = out[end - 1]
            read.state.entries.tokens.extend(read.tokens)
            read.state.valid += len(read.tokens)
        return last

    def _truncate(self, state: _MTPState, num_tokens: int) -> None:
        if state.entries.num_computed_tokens > num_tokens:
            self.kv.truncate(state.entries, num_tokens)
            del state.entries.tokens[num_tokens:]

    def _lose(self, state: _MTPState) -> None:
        self.kv.free(state.entries)
        state.entries.tokens.clear()
        state.valid, state.pending, state.lost = 0, None, True
