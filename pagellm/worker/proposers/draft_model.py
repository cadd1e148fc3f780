"""Draft-model proposals: a smaller model with the target's vocabulary runs k steps ahead.

The draft has its own model runner and its own paged KV cache (a pool and a KV coordinator of its
own, sized from the target's memory budget by the engine builder), in which each speculating
sequence keeps the K/V of the tokens the draft has read. A proposal first rolls that cache back to
the longest prefix it shares with the sequence's tokens now (the rejected drafts' blocks go back
to the pool), reads what the draft has not (the accepted tokens and the token after them; at the
first proposal, the whole prompt), then decodes the rest: k forward passes, each batched over the
sequences still proposing. A greedy request's drafts are the draft's argmax; a sampled one's are
drawn from the draft's distribution under the request's own rules (logits processors,
temperature, truncation), which is recorded for rejection sampling (rejection_sampler.py).

A sequence whose draft blocks cannot be had (its pool is short) proposes nothing this step and
keeps none; the target decodes it plainly.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from pagellm.core.kv import KVManager, make_kv_manager
from pagellm.core.step_plan import PlannedSeq, SampleSpec
from pagellm.worker.proposers.base import Proposal, ProposalQuery, Proposer
from pagellm.worker.rejection_sampler import DRAFT_STREAM, stream_uniforms
from pagellm.worker.sampler import SamplingMetadata, sampling_probs

if TYPE_CHECKING:
    from pagellm.worker.model_runner import ModelRunner


@dataclass
class DraftSequence:
    """A sequence as the draft's KV coordinator sees it: its id and how many of its tokens have
    K/V in the draft's cache (`tokens`, the tokens read, drafts included). A draft with recurrent
    layers also keeps, from its last proposal, its states after each forward pass (`states`, by
    tokens read then): the next proposal starts from the one after the accepted drafts."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def num_computed_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class _Run:
    """One sequence's proposal in progress."""

    seq: DraftSequence
    query: ProposalQuery
    k: int
    pending: list[int]  # tokens to read in the next forward pass
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class ModelProposer(Proposer):
    """A proposer that runs a model of its own (a draft model, an MTP layer) over its own paged cache."""

    # What it is called in messages about it (the engine's KV split among them).
    label = "proposer model"

    def __init__(self, runner: ModelRunner, eos_token_ids: set[int], seed: int = 0) -> None:
        """`runner`: the proposing model's, weights loaded (its cache comes with allocate_cache, once
        the engine has split its KV budget). `seed` seeds the draws of unseeded sampled requests."""
        self.runner = runner
        self.kv: KVManager | None = None
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = runner.arch.vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.seqs: dict = {}

    def allocate_cache(self, num_blocks: int, block_size: int, max_chunk_tokens: int, asked_by: str) -> None:
        """The proposer's pool of `num_blocks` blocks and the KV coordinator of its blocks (no prefix
        cache: its blocks are never shared)."""
        self.runner.allocate_kv_cache(num_blocks, block_size, asked_by)
        self.kv = make_kv_manager("paged", num_blocks, block_size, self.runner.max_model_len,
                                  enable_prefix_caching=False, windows=self.runner.kv_groups.windows,
                                  max_chunk_tokens=max_chunk_tokens, state_blocks=self.runner.state_blocks(block_size))


class DraftModelProposer(ModelProposer):
    label = "draft model"
    seqs: dict[str, DraftSequence]

    def propose_for(self, queries: Sequence[ProposalQuery]) -> list[Proposal]:
        runs = {q.request_id: run for q in queries if (run := self._start(q)) is not None}
        active = list(runs.values())
        while active:
            self._step(active)
            active = [r for r in active if len(r.drafts) < r.k]
        out = []
        for q in queries:
            run = runs.get(q.request_id)
            if run is None:
                out.append(Proposal([]))
                continue
            # The last draft is proposed but not read: its K/V would be the next proposal's first write.
            greedy = q.sampler.params.greedy
            out.append(Proposal(run.drafts, None if greedy else torch.stack(run.probs)))
        return out

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.kv.free(seq)

    # ---- one sequence ------------------------------------------------------------------------
    def _start(self, query: ProposalQuery) -> _Run | None:
        """Roll the sequence's draft cache back to what it shares with `query.context`, and take the
        blocks for the tokens to read and the k - 1 drafts to read after them; None: no proposal."""
        context = list(query.context)
        k = min(query.num_tokens, self.runner.max_model_len - len(context))
        if k < 1 or not context:
            self.release([query.request_id])
            return None
        seq = self.seqs.setdefault(query.request_id, DraftSequence(query.request_id))
        common = 0
        for a, b in zip(seq.tokens, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # the last token is always read: its logits propose
        if common < len(seq.tokens) and self.runner.recurrent and common not in seq.states:
            # No state kept at that point (a proposal's first pass starts after it): read the
            # sequence again from its start.
            self.release([query.request_id])
            seq = self.seqs.setdefault(query.request_id, DraftSequence(query.request_id))
            common = 0
        if common < len(seq.tokens):
            self.kv.truncate(seq, common)
            del seq.tokens[common:]
            if self.runner.recurrent:  # the recurrent layers' states back to the accepted tokens'
                self.runner.write_states(self.kv.group_tables(query.request_id), seq.states[common])
        seq.states.clear()
        if not self.kv.allocate_slots(seq, len(context) - common + k - 1):
            self.release([query.request_id])
            return None
        return _Run(seq, query, k, context[common:])

    # ---- one forward pass of the draft over every run still proposing -----------------------------
    def _step(self, runs: list[_Run]) -> None:
        specs = [replace(r.query.sampler, output_token_ids=[*r.query.sampler.output_token_ids, *r.drafts])
                 for r in runs]
        plan = [PlannedSeq(r.seq.request_id, r.pending, r.seq.num_computed_tokens,
                           self.kv.group_tables(r.seq.request_id), [spec])
                for r, spec in zip(runs, specs)]
        logits = self.runner.last_logits(plan)
        tokens, probs = draw_proposals(logits, specs, self.eos_token_ids, self.vocab_size, self.generator)
        for i, r in enumerate(runs):
            r.seq.tokens.extend(r.pending)
            if self.runner.recurrent and len(r.drafts) < r.k - 1:  # a state the next proposal may start from
                r.seq.states[len(r.seq.tokens)] = self.runner.read_states(self.kv.group_tables(r.seq.request_id))
            if not specs[i].params.greedy:
                r.probs.append(probs[i])
            r.drafts.append(tokens[i])
            r.pending = [tokens[i]]


def draw_proposals(logits: torch.Tensor, specs: list[SampleSpec], eos_token_ids: set[int], vocab_size: int,
                   generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """One proposed token per row of `logits` under its sequence's own rules (`specs[i]`, its output
    so far ending in the drafts before this one): a greedy request's argmax; a sampled one's draw
    from the distribution its logits processors, temperature and truncation make, with the
    request's seed (rejection_sampler.DRAFT_STREAM). Returns the tokens and those distributions,
    [rows, vocab] float32 on the CPU, which a sampled request's verification needs."""
    meta = SamplingMetadata.build([s.params for s in specs], [s.prompt_token_ids for s in specs],
                                  [s.output_token_ids for s in specs], eos_token_ids, vocab_size,
                                  logits.device, [s.token_bitmask for s in specs])
    probs = sampling_probs(logits, meta).cpu()
    tokens = []
    for i, spec in enumerate(specs):
        params = spec.params
        if params.greedy:
            tokens.append(int(probs[i].argmax()))
            continue
        u = stream_uniforms(params.seed, DRAFT_STREAM, len(spec.output_token_ids), 1, generator)
        cdf = probs[i].cumsum(0)
        token = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=len(cdf) - 1))
        while probs[i, token] <= 0 and token > 0:  # rounding past the last token with mass
            token -= 1
        tokens.append(token)
    return tokens, probs
