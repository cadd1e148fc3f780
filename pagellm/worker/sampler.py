"""Next-token sampling for one engine step, vectorized over the batch.

Owns the path from a step's logits ``[B, V]`` (one row per sequence that
samples this step) to the chosen token ids: the logits rules of
``logits_processors`` (penalties, logit_bias, allowed_token_ids, the min_tokens
ban, a structured-output grammar's mask), greedy argmax, temperature, top-k /
top-p / min-p truncation, seeded and unseeded random draws, and the logprobs
reported for the chosen tokens.
Everything that depends only on the requests, not on the logits, is computed
once per step by ``SamplingMetadata.build``.

Rows are sampled by inverse-CDF: one uniform per row, searched in the
cumulative weights. That needs B random numbers per step instead of B * V
(exponential noise over [256, 49k] alone costs ~0.25 s on 2 cores). A seeded
request's uniform for its k-th token is a pure function of (seed, k), so its text
does not depend on the batch, on preemption, or on a step being run again.

A row whose logits leave nothing to pick (NaN or +inf from the model, or every
token ruled out) is reported in ``SamplerOutput.errors`` and fails its own request;
the other rows of the batch are sampled as usual.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagellm.kernels import cpu
from pagellm.sampling_params import SamplingParams
from pagellm.worker.logits_processors import LOGITS_PROCESSORS, LogitsProcessor, StepRequests

# top-p first looks for each row's nucleus among its best few tokens, and only
# sorts the whole vocabulary for rows whose nucleus is wider: sorting
# [256, 49k] takes ~0.4 s on 2 cores, a top-256 about a tenth of that.
_CANDIDATE_WIDTHS = (256, 4096)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a bijective 64-bit mixer with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) that a request seeded with ``seed`` uses for its ``index``-th
    generated token: 24 random bits, exactly a float32."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 40) / float(1 << 24)


@dataclass
class _SampleGroup:
    """Rows that share one source of randomness and are sampled together.

    Unseeded rows form one group drawing from the sampler's generator; each
    seeded row is a group of its own, with its uniform fixed by (seed, token
    index), so its arithmetic runs on a [1, V] tensor whatever the batch is, and
    its tokens do not depend on its neighbours.
    """

    rows: torch.Tensor                # [n] rows of the logits
    uniform: torch.Tensor | None      # [1] for a seeded row; None: draw from the sampler's generator
    temperature: torch.Tensor | None  # [n, 1]; None when all are 1.0
    top_k: torch.Tensor               # [n] long, V when off
    top_p: torch.Tensor               # [n] float, 1.0 when off
    min_p: torch.Tensor | None        # [n]; None when no row uses it
    truncated: torch.Tensor           # positions in the group with top-k or top-p
    untruncated: torch.Tensor         # the other positions


@dataclass
class SamplingMetadata:
    """Per-step batch tensors derived from the requests, built once per step."""

    batch_size: int
    vocab_size: int
    device: torch.device
    greedy_rows: torch.Tensor           # [G] rows that take argmax
    groups: list[_SampleGroup]          # the rows that sample, by source of randomness
    # The logits rules this step's rows use, each with its state (worker/logits_processors.py).
    adjustments: list[tuple[LogitsProcessor, Any]]
    logprob_rows: list[int]               # rows whose params.logprobs is set
    logprob_ks: list[int]                 # their params.logprobs

    @property
    def all_greedy(self) -> bool:
        return not self.groups

    @property
    def needs_adjustment(self) -> bool:
        """Whether any logit must change before picking (a rule of LOGITS_PROCESSORS applies)."""
        return bool(self.adjustments)

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], eos_token_ids: list[int] | set[int], vocab_size: int,
              device: torch.device | str = "cpu",
              token_bitmasks: list[torch.Tensor | None] | None = None) -> SamplingMetadata:
        """Precompute the step's tensors; row i of every list is row i of the logits."""
        batch = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == batch:
            raise ValueError("params, prompt_token_ids and output_token_ids must have one entry per row")
        device = torch.device(device)
        eos = set(eos_token_ids)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]

        groups = []
        unseeded = [i for i in sampled if params[i].seed is None]
        if unseeded:
            groups.append(_build_group(unseeded, params, None, vocab_size, device))
        for i in sampled:
            if params[i].seed is not None:
                u = seeded_uniform(params[i].seed, len(output_token_ids[i]))
                groups.append(_build_group([i], params, torch.tensor([u], device=device), vocab_size, device))

        step = StepRequests(params, prompt_token_ids, output_token_ids, eos, vocab_size, device, token_bitmasks)
        adjustments = [(rule, state) for rule in LOGITS_PROCESSORS if (state := rule.prepare(step)) is not None]

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            batch_size=batch, vocab_size=vocab_size, device=device,
            greedy_rows=torch.tensor(greedy, dtype=torch.long, device=device),
            groups=groups,
            adjustments=adjustments,
            logprob_rows=logprob_rows,
            logprob_ks=[params[i].logprobs for i in logprob_rows],
        )


def _build_group(rows: list[int], params: list[SamplingParams],
                 uniform: torch.Tensor | None, vocab_size: int,
                 device: torch.device) -> _SampleGroup:
    ps = [params[i] for i in rows]
    temps = [p.temperature for p in ps]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
    top_p = [p.top_p for p in ps]
    min_p = [p.min_p for p in ps]
    truncated = [j for j in range(len(ps)) if top_k[j] < vocab_size or top_p[j] < 1.0]
    untruncated = [j for j in range(len(ps)) if not (top_k[j] < vocab_size or top_p[j] < 1.0)]

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return _SampleGroup(
        rows=t(rows, torch.long),
        uniform=uniform,
        temperature=None if all(x == 1.0 for x in temps) else t(temps, torch.float32)[:, None],
        top_k=t(top_k, torch.long),
        top_p=t(top_p, torch.float32),
        min_p=t(min_p, torch.float32) if any(x > 0 for x in min_p) else None,
        truncated=t(truncated, torch.long),
        untruncated=t(untruncated, torch.long),
    )


def apply_logits_processors_(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place, each rule the step uses, in LOGITS_PROCESSORS' order (penalties, logit_bias,
    allowed_token_ids, the min_tokens ban, the grammar's mask).

    ``logits`` must be a contiguous [B, V] float tensor that the caller owns.
    """
    for rule, state in meta.adjustments:
        rule.apply(logits, state)
    return logits


# exp of anything below this is not a normal float32 (exp(-87.0) = 1.6e-38 still is).
_EXP_FLOOR = -87.0
_EXP_AT_FLOOR = float(torch.tensor(_EXP_FLOOR).exp())


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """``x.exp_()`` with every result below exp(-87) set to 0.0 (instead of a denormal or 0.0).

    torch's CPU exp takes a slow path for inputs whose result underflows (-inf included): with
    half of [32, 49k] masked to -inf, as a grammar does, exp_ takes ~7 ms instead of ~0.3 ms.
    Clamping first keeps it on the fast path; a weight under 1.6e-38 (for logits already
    shifted to max 0) is no weight at all in float32 sums.
    """
    x.clamp_(min=_EXP_FLOOR).exp_()
    return torch.nn.functional.threshold_(x, _EXP_AT_FLOOR, 0.0)


def _inverse_cdf_(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column drawn with probability proportional to ``weights`` [n, W] (overwritten)."""
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    pos = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # Rounding can put u * total on the final plateau; never land on a zero-weight tail.
    last = torch.searchsorted(cdf, total, right=False)
    # A NaN total sorts past the end: stay in range (the caller reports such a row as failed).
    return torch.minimum(pos, last).clamp_(max=weights.shape[-1] - 1).squeeze(1)


def _sample_truncated(s: torch.Tensor, m: torch.Tensor, floor: torch.Tensor | None,
                      top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample rows of scaled logits ``s`` [n, V] (row maxima ``m``) under top-k/top-p/min-p.

    Works on each row's best tokens in descending order, widening the window
    for rows whose nucleus does not fit yet. Candidates are chosen on the
    logits rather than on exp(logit - max), where near-ties round together.
    """
    n, vocab = s.shape
    tokens = torch.empty(n, dtype=torch.long, device=s.device)
    todo = torch.arange(n, device=s.device)
    totals: torch.Tensor | None = None  # whole-row mass, for top-p rows without top-k
    widths = [c for c in _CANDIDATE_WIDTHS if c < vocab] + [vocab]
    for stage, width in enumerate(widths):
        final = stage == len(widths) - 1
        sub = s if todo.numel() == n else s[todo]
        kk, pp = top_k[todo], top_p[todo]
        width = min(width, int(kk.max()))  # top-k alone may bound every row below the window
        if width >= vocab:
            vals, idx = sub.sort(-1, descending=True)
        else:
            vals, idx = sub.topk(width, -1)
        weights = _exp_(vals - m[todo])
        weights.masked_fill_(torch.arange(width, device=s.device) >= kk[:, None], 0.0)
        csum = weights.cumsum(-1)
        mass = csum[:, -1]
        bounded = kk <= width  # the window holds the row's whole top-k set
        if bounded.all():
            total, done = mass, bounded
        else:
            # Without top-k, p is taken of the whole row's mass; with a top-k
            # wider than the window that mass is unknown here, so widen.
            if totals is None:
                totals = _exp_(s - m).sum(-1)
            known = bounded | (kk >= vocab)
            total = torch.where(bounded, mass, totals[todo])
            done = bounded | (known & (mass >= pp * total)) | final
        keep = ((csum - weights) < (pp * total)[:, None]) | (pp >= 1.0)[:, None]
        weights.masked_fill_(~keep, 0.0)
        if floor is not None:
            weights.masked_fill_(vals < floor[todo], 0.0)
        rows = todo
        if not done.all():
            weights, idx, rows = weights[done], idx[done], todo[done]
        picked = _inverse_cdf_(weights, u[rows])
        tokens[rows] = idx.gather(1, picked[:, None]).squeeze(1)
        todo = todo[~done]
        if todo.numel() == 0:
            break
    return tokens


def _sample_logits(s: torch.Tensor, group: _SampleGroup, u: torch.Tensor) -> torch.Tensor:
    """Sample each row of temperature-scaled logits ``s`` [n, V], which is overwritten."""
    n = s.shape[0]
    m = s.amax(-1, keepdim=True)
    # min-p keeps p >= min_p * p_max, i.e. logit >= max + log(min_p); on the
    # logits, min_p = 1 keeps exactly the argmax (log(0) = -inf keeps all).
    floor = None if group.min_p is None else m + torch.log(group.min_p)[:, None]
    tokens = torch.empty(n, dtype=torch.long, device=s.device)
    t = group.truncated
    if t.numel():
        every = t.numel() == n
        sub = s if every else s[t]
        tokens[t] = _sample_truncated(sub, m if every else m[t],
                                      None if floor is None else floor[t],
                                      group.top_k[t], group.top_p[t], u[t])
    f = group.untruncated
    if f.numel():
        every = f.numel() == n
        sub = s if every else s[f]
        mf = m if every else m[f]
        if floor is not None:
            sub.masked_fill_(sub < (floor if every else floor[f]), float("-inf"))
        tokens[f] = _inverse_cdf_(_exp_(sub.sub_(mf)), u[f])
    return tokens


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] float32: the distribution each row of `logits` is sampled from, by the same rules as
    Sampler: the logits processors, temperature, then top-k, top-p and min-p, renormalized (a greedy
    row: one-hot at its argmax). Speculative decoding's rejection sampling compares these."""
    x = logits.float().clone()
    apply_logits_processors_(x, meta)
    probs = torch.zeros_like(x)
    g = meta.greedy_rows
    if g.numel():
        probs[g, x[g].argmax(-1)] = 1.0
    for group in meta.groups:
        s = x[group.rows]
        if group.temperature is not None:
            s.div_(group.temperature)
        probs[group.rows] = _group_probs(s, group)
    return probs


def _group_probs(s: torch.Tensor, group: _SampleGroup) -> torch.Tensor:
    """The normalized weights `_sample_logits` draws each row of scaled logits `s` [n, V] from."""
    m = s.amax(-1, keepdim=True)
    floor = None if group.min_p is None else m + torch.log(group.min_p)[:, None]
    out = _exp_(s - m)
    if floor is not None:
        out.masked_fill_(s < floor, 0.0)
    t = group.truncated
    if t.numel():
        vals, idx = s[t].sort(-1, descending=True)
        weights = _exp_(vals - m[t])
        weights.masked_fill_(torch.arange(s.shape[1], device=s.device) >= group.top_k[t][:, None], 0.0)
        csum = weights.cumsum(-1)
        top_p = group.top_p[t]
        keep = ((csum - weights) < (top_p * csum[:, -1])[:, None]) | (top_p >= 1.0)[:, None]
        weights.masked_fill_(~keep, 0.0)
        if floor is not None:
            weights.masked_fill_(vals < floor[t], 0.0)
        out[t] = torch.zeros_like(weights).scatter_(1, idx, weights)
    return out / out.sum(-1, keepdim=True)


@dataclass
class SamplerOutput:
    """One entry per row of the step's logits."""

    token_ids: list[int]
    # Log-probability of each chosen token under the model's raw distribution
    # (before penalties, temperature and truncation), as vLLM reports by default.
    logprobs: list[float]
    # Only when some row set params.logprobs; rows that did not get [] and rank 0.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None
    # Rows that could not be sampled -> why (a key of ROW_ERRORS); their token ids mean nothing.
    errors: dict[int, str] | None = None

    def select(self, rows: list[int]) -> SamplerOutput:
        """These rows only, in this order (a speculating sequence keeps the rows of the tokens it accepts)."""
        if rows == list(range(len(self.token_ids))):
            return self
        position = {row: i for i, row in enumerate(rows)}
        errors = {position[r]: e for r, e in (self.errors or {}).items() if r in position}
        return SamplerOutput([self.token_ids[r] for r in rows], [self.logprobs[r] for r in rows],
                             None if self.top_logprobs is None else [self.top_logprobs[r] for r in rows],
                             None if self.ranks is None else [self.ranks[r] for r in rows], errors or None)

    @classmethod
    def concat(cls, parts: list[SamplerOutput]) -> SamplerOutput:
        """The outputs of several batches as one, rows in order."""
        out = cls([], [], None, None, None)
        with_top = any(p.top_logprobs is not None for p in parts)
        for p in parts:
            offset = len(out.token_ids)
            if p.errors:
                out.errors = {**(out.errors or {}), **{offset + row: e for row, e in p.errors.items()}}
            if with_top:
                out.top_logprobs = (out.top_logprobs or []) + (p.top_logprobs or [[] for _ in p.token_ids])
                out.ranks = (out.ranks or []) + (p.ranks or [0] * len(p.token_ids))
            out.token_ids += p.token_ids
            out.logprobs += p.logprobs
        return out


# Why a row could not be sampled: the cause (a metric label) -> what the request is told.
ROW_ERRORS = {
    "non_finite_logits": "the model's logits for this sequence are not finite (NaN or inf)",
    "no_token_allowed": "no token can be picked: penalties, logit_bias, allowed_token_ids, min_tokens and "
                        "the structured-output grammar rule out every one",
}


class Sampler:
    """Picks one token per row. Keeps scratch buffers between steps, so one
    instance serves one engine loop at a time."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        # Unseeded rows draw from here; seeded rows only from their own generator.
        self.generator = torch.Generator(torch.device(device))
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Fresh [B, V] allocations cost more than the arithmetic on them on CPU.
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        need = rows * cols
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need or buf.device != like.device:
            buf = torch.empty(need, dtype=torch.float32, device=like.device)
            self._buffers[name] = buf
        return buf[:need].view(rows, cols)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (meta.batch_size, meta.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} do not match the metadata "
                             f"({meta.batch_size}, {meta.vocab_size})")
        if meta.batch_size == 0:
            return SamplerOutput([], [], None, None)
        raw = logits if logits.dtype == torch.float32 else logits.float()

        # The logsumexp and the maximum's index in one kernel: a row whose logsumexp is not finite
        # holds a NaN or +inf (from the model), or is all -inf; it cannot be sampled, nor its
        # logprobs computed.
        lse, argmax = _row_logsumexp(raw)
        errors = _unusable_rows(lse, "non_finite_logits")
        if errors:
            raw = raw.clone()
            raw[list(errors)] = 0.0
            lse = _row_logsumexp(raw)[0]
        if meta.all_greedy and not meta.needs_adjustment:
            return self._output(raw, argmax, lse, meta, errors)

        x = raw
        if meta.needs_adjustment:
            x = self._buffer("work", *raw.shape, like=raw)
            x.copy_(raw)
            apply_logits_processors_(x, meta)
            for row, cause in _unusable_rows(x.amax(-1), "no_token_allowed").items():
                errors.setdefault(row, cause)
                x[row] = 0.0
        tokens = torch.empty(meta.batch_size, dtype=torch.long, device=raw.device)
        g = meta.greedy_rows
        if g.numel() == meta.batch_size:
            tokens = x.max(-1).indices
        elif g.numel():
            rows = self._buffer("rows", g.numel(), x.shape[1], like=x)
            tokens[g] = torch.index_select(x, 0, g, out=rows).max(-1).indices
        for group in meta.groups:
            tokens[group.rows] = self._sample_group(x, group, owned=x is not raw)
        return self._output(raw, tokens, lse, meta, errors)

    def _sample_group(self, x: torch.Tensor, group: _SampleGroup, owned: bool) -> torch.Tensor:
        n = group.rows.numel()
        if owned and n == x.shape[0]:
            w = x  # every row samples and x is our copy: work on it in place
        else:
            w = self._buffer("rows", n, x.shape[1], like=x)
            torch.index_select(x, 0, group.rows, out=w)
        if group.temperature is not None:
            w.div_(group.temperature)
        u = group.uniform if group.uniform is not None else torch.rand(n, generator=self.generator,
                                                                        device=w.device)
        return _sample_logits(w, group, u)

    def _output(self, raw: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, meta: SamplingMetadata,
                errors: dict[int, str]) -> SamplerOutput:
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        out = SamplerOutput(token_ids=tokens.tolist(), logprobs=(chosen - lse).tolist(), errors=errors or None)
        if meta.logprob_rows:
            self._add_top_logprobs(out, raw, chosen, lse, meta)
        return out

    def _add_top_logprobs(self, out: SamplerOutput, raw: torch.Tensor, chosen: torch.Tensor,
                          lse: torch.Tensor, meta: SamplingMetadata) -> None:
        b = meta.batch_size
        rows = torch.tensor(meta.logprob_rows, dtype=torch.long, device=raw.device)
        sub = raw if len(meta.logprob_rows) == b else raw[rows]
        ranks = ((sub > chosen[rows][:, None]).sum(-1) + 1).tolist()
        out.ranks = [0] * b
        out.top_logprobs = [[] for _ in range(b)]
        kmax = max(meta.logprob_ks)
        if kmax > 0:
            vals, ids = sub.topk(min(kmax, sub.shape[1]), -1)
            top_lp = (vals - lse[rows][:, None]).tolist()
            top_ids = ids.tolist()
        for j, row in enumerate(meta.logprob_rows):
            out.ranks[row] = ranks[j]
            k = meta.logprob_ks[j]
            if k > 0:
                out.top_logprobs[row] = list(zip(top_ids[j][:k], top_lp[j][:k]))


def _row_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp, index of the maximum) of each row of x [B, V]: the same bits for a row whatever
    B is, and torch.max's index (the first maximal value; NaN counts as the maximum).

    torch reduces a single row as a whole tensor (split over threads, then combined) and several
    rows dimension-wise, which sums a row in another order; a lone row is therefore reduced as one
    of two, so that a token's logprob does not depend on how many rows share the step. On the
    CPU a compiled kernel sums each row in one order (kernels/cpu.py), without the copy, and finds
    the maximum's index in the same call."""
    if x.dtype == torch.float32 and cpu.usable(x):
        return cpu.row_logsumexp(x)
    index = x.max(-1).indices
    if x.shape[0] == 1:
        return torch.logsumexp(x.expand(2, -1).contiguous(), -1)[:1], index
    return torch.logsumexp(x, -1), index


def _unusable_rows(row_max: torch.Tensor, cause: str) -> dict[int, str]:
    """Rows whose maximum is NaN or infinite, each with ``cause``; empty in the common case."""
    bad = ~torch.isfinite(row_max)
    if not bool(bad.any()):
        return {}
    return {row: cause for row in bad.nonzero().flatten().tolist()}
