"""From what a step sampled to what the caller sees: logprobs in vLLM's shape, incremental
text (stop strings included), and the RequestOutput of each request."""
from __future__ import annotations

import time

from pagellm.core.request import Request, RequestStatus
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.groups import SeqText, SequenceGroup
from pagellm.engine.pooling import embedding
from pagellm.loader.tokenizer import Tokenizer
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.worker.sampler import SamplerOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def track(self, group: SequenceGroup, req: Request) -> None:
        """Start following the text of a sampled sequence of `group` (the first, or a fork)."""
        params = req.sampling_params
        group.texts[req.index] = SeqText(req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params),
                                        logprobs=[] if params.logprobs is not None else None)

    def append(self, seq: SeqText, sampled: SamplerOutput, rows: list[int]) -> bool:
        """Take in the tokens the sequence just received (rows `rows` of the step's sample, one per
        token, the last tokens of its output), one at a time; True when a stop string now ends its
        text, so that it must stop. The tokens after the one that completed the stop string (a
        speculating sequence receives several at once) are dropped from its output."""
        req = seq.request
        tokens = req.output_token_ids[len(req.output_token_ids) - len(rows):]
        ends_on_stop_token = bool(tokens) and self.ends_on_stop_token(req)
        for i, (token, row) in enumerate(zip(tokens, rows)):
            req.cumulative_logprob += sampled.logprobs[row]
            if seq.logprobs is not None:
                seq.logprobs.append(self.logprob_entry(token, sampled, row))
            if ends_on_stop_token and i == len(tokens) - 1:
                break  # the token that stopped it is not text, as in vLLM, even with skip_special_tokens false
            if seq.detokenizer.update([token]) is not None:
                del req.output_token_ids[len(req.output_token_ids) - (len(rows) - i - 1):]
                return True
        return False

    def ends_on_stop_token(self, req: Request) -> bool:
        """Whether the request's last token is the EOS or stop token that finished it. Its text is
        left out (unless include_stop_str_in_output): kept special tokens (skip_special_tokens false,
        as a harmony reply needs for its channel markers) would put `</s>` at the end of the answer."""
        params = req.sampling_params
        if not req.is_finished or req.status != RequestStatus.FINISHED_STOPPED or params.include_stop_str_in_output:
            return False
        last = req.output_token_ids[-1]
        return (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids

    def release_text(self, seq: SeqText) -> None:
        """Move the text that can be shown now into `seq.text` (all of it once the sequence finished)."""
        req = seq.request
        seq.text += seq.detokenizer.get_delta(finished=req.is_finished)
        # A stop string that cut the text is why the sequence stopped: also when it was found on the
        # token that reached max_tokens, or only in the tail released at the finish (a partial
        # character decoded as U+FFFD).
        stop = seq.detokenizer.stop_str
        if stop is not None and req.stop_reason != stop:
            req.finish(RequestStatus.FINISHED_STOPPED, stop_reason=stop)

    def logprob_entry(self, token: int, sampled: SamplerOutput, row: int) -> dict[int, Logprob]:
        entry = {}
        for tid, lp in (sampled.top_logprobs[row] if sampled.top_logprobs else []):
            entry[tid] = Logprob(lp, None, self._piece(tid))
        for rank, tid in enumerate(entry, start=1):
            entry[tid].rank = rank
        if token not in entry:
            rank = sampled.ranks[row] if sampled.ranks else None
            entry[token] = Logprob(sampled.logprobs[row], rank, self._piece(token))
        return entry

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # ---- RequestOutputs ----------------------------------------------------------------------
    def output(self, group: SequenceGroup) -> RequestOutput | None:
        """The request's output now; None for best_of and beam search before they finish (only
        the best n are shown, and beams are only ranked at the end)."""
        if group.beams is not None:
            return self._beam_output(group) if group.finished else None
        seqs = [group.texts[i] for i in sorted(group.texts)]
        if group.num_seqs > group.params.n:
            if not group.finished:
                return None
            seqs = sorted(seqs, key=lambda s: -s.request.cumulative_logprob)[:group.params.n]
        completions = [
            CompletionOutput(
                index=i, text=s.text, token_ids=list(s.request.output_token_ids),
                cumulative_logprob=s.request.cumulative_logprob, logprobs=s.logprobs,
                finish_reason=s.request.status.value if s.request.is_finished else None,
                stop_reason=s.request.stop_reason,
            )
            for i, s in enumerate(seqs)
        ]
        first = group.root
        times = [s.request.first_token_time for s in group.texts.values() if s.request.first_token_time]
        finished_times = [s.request.finished_time for s in group.texts.values() if s.request.finished_time]
        metrics = RequestMetrics(first.arrival_time, min(times) if times else None,
                                 max(finished_times) if group.finished else None,
                                 sum(s.request.num_preemptions for s in group.texts.values()),
                                 first.first_scheduled_time)
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, group.finished,
                             metrics, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs(first))

    @staticmethod
    def embedding_output(group: SequenceGroup, pooled) -> RequestOutput:
        """The one output of an embedding request whose prompt is computed: what it pooled
        (PooledPrompts), made its embedding."""
        req = group.root
        vector = embedding(pooled, req.pooling_params, req.num_prompt_tokens)
        metrics = RequestMetrics(req.arrival_time, None, req.finished_time, req.num_preemptions,
                                 req.first_scheduled_time)
        return RequestOutput(group.request_id, req.prompt, req.prompt_token_ids, [], True, metrics,
                             num_cached_tokens=req.num_cached_tokens, embedding=vector)

    def prompt_logprobs(self, req: Request) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs in vLLM's shape, once all are computed."""
        if req.sampling_params.prompt_logprobs is None or req.prompt_logprobs_pending:
            return None
        out: list[dict[int, Logprob] | None] = [None]
        for token, logprob, rank, top in req.prompt_logprobs:
            entry = {tid: Logprob(lp, r, self._piece(tid)) for r, (tid, lp) in enumerate(top, start=1)}
            entry.setdefault(token, Logprob(logprob, rank, self._piece(token)))
            out.append(entry)
        return out

    def _beam_output(self, group: SequenceGroup) -> RequestOutput:
        state = group.beams.state
        results = state.results(self.tokenizer.decode)
        completions = [
            CompletionOutput(index=i, text=seq.text, token_ids=seq.token_ids,
                             cumulative_logprob=seq.cumulative_logprob, logprobs=None,
                             finish_reason="stop" if seq.token_ids and seq.token_ids[-1] in self.eos_token_ids
                             and not state.params.ignore_eos else "length")
            for i, seq in enumerate(results.sequences)
        ]
        first = group.root
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, True,
                             RequestMetrics(first.arrival_time, first.first_token_time, time.time(),
                                            first.num_preemptions, first.first_scheduled_time))

    @staticmethod
    def failure(group: SequenceGroup, error: Exception) -> RequestOutput:
        """The final output of a request that failed: no completions, and why."""
        first = group.root
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, [], True,
                             RequestMetrics(first.arrival_time, first.first_token_time, time.time(),
                                            first.num_preemptions),
                             error=f"{type(error).__name__}: {error}")
