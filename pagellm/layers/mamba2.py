"""The Mamba-2 mixer of Granite 4 hybrids (transformers' GraniteMoeHybridMambaLayer).

in_proj maps a token to a gate z, the SSM input x (heads of head_dim), B and C (groups of
d_state, each group shared by num_heads / n_groups consecutive heads) and dt (one per head);
x, B and C go through a short causal convolution with SiLU. Per head h, with the state
S [head_dim, d_state]:

    dt_t = softplus(dt_t + dt_bias) (clamped to time_step_limit),  A = -exp(A_log)
    S = exp(dt_t A) S + dt_t x_t B_t^T
    y_t = S C_t + D x_t

and the output is y * silu(z), RMS-normalised per group (norm.weight over all channels), then
out_proj.

State per sequence: "conv" [conv channels, K - 1] (the convolution's last inputs) and "ssm"
[heads, head_dim, d_state] (S), on this rank's heads. A step's decodes are advanced one token
together; each prefill (or prefill chunk) goes through the chunked scan (state space duality,
chunks of mamba_chunk_size as in transformers' torch path) starting from the state its
previous chunks left. The scan is computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.layers.linear import RowParallelLinear
from pagellm.layers.parallel import TensorParallelGroup, rank_and_size
from pagellm.layers.recurrent import RecurrentMixer, StateTrace
from pagellm.layers.sharded_parts import Part, PartsColumnParallelLinear, PartsConv1d, leading_decodes, sharded_vector


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., c] -> [..., c, c]: entry (l, s) is a[s+1] + ... + a[l] for s <= l, -inf above the
    diagonal. Summed along rows rather than as cumsum differences, which lose precision."""
    c = a.shape[-1]
    lower = torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
    sums = a[..., :, None].expand(*a.shape, c).masked_fill(~lower.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(~lower, float("-inf"))


def selective_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of N sequences: x [N, H, P], dt [N, H], A [H], B, C [N, H, d_state]; state
    [N, H, P, d_state] (updated in place) -> y [N, H, P] without the D skip."""
    state.mul_((dt * A).exp()[..., None, None]).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
    return torch.einsum("nhpd,nhd->nhp", state, C)


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 state: torch.Tensor, chunk: int) -> torch.Tensor:
    """L tokens of one sequence: x [L, H, P], dt [L, H], A [H], B, C [L, H, d_state]; state
    [H, P, d_state] (updated in place) -> y [L, H, P] without the D skip. Within a chunk the
    output is a masked attention-like product; the state is carried from chunk to chunk."""
    length, heads = dt.shape
    pad = -length % chunk
    n = (length + pad) // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [n, chunk, ...], zero-padded (dt = 0: no change)
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(n, chunk, *t.shape[1:])

    x, dt, B, C = (chunked(t) for t in (x, dt, B, C))
    xdt = x * dt[..., None]
    a = (dt * A).transpose(1, 2)  # [n, H, chunk]: log of each token's decay
    cum = a.cumsum(-1)
    # Inside a chunk: y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s.
    scores = torch.einsum("clhd,cshd->chls", C, B) * _segsum(a).exp()
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end, then the states at chunk starts.
    to_end = (cum[..., -1:] - cum).exp()  # [n, H, chunk]
    written = torch.einsum("clhd,chl,clhp->chpd", B, to_end, xdt)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [n, H, 1, 1]
    starts = [state.clone()]
    for i in range(n):
        starts.append(starts[-1] * chunk_decay[i] + written[i])
    state.copy_(starts.pop())
    # What the state at a chunk's start contributes to each of its tokens.
    y = y + torch.einsum("clhd,chpd,chl->clhp", C, torch.stack(starts), cum.exp())
    return y.reshape(n * chunk, heads, -1)[:length]


class Mamba2Mixer(RecurrentMixer):
    """Granite 4's Mamba-2 layer. `hf`: the config (hidden_size, mamba_n_heads, mamba_d_head,
    mamba_n_groups, mamba_d_state, mamba_d_conv, mamba_expand, mamba_chunk_size,
    mamba_conv_bias, mamba_proj_bias, time_step_limit, rms_norm_eps). Under tensor parallelism
    each rank holds mamba_n_heads / tp heads (which must divide) with their gate, x, dt, conv
    channels, A_log, D, dt_bias, norm weights and out_proj columns; groups are split likewise
    when tp divides mamba_n_groups, or else, when mamba_n_groups divides tp, each rank keeps the
    one group its heads read, whose norm then sums its squares over the ranks sharing it."""

    def __init__(self, hf, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        rank, size = rank_and_size(tp)
        total_heads, groups, self.d_state = hf.mamba_n_heads, hf.mamba_n_groups, hf.mamba_d_state
        self.head_dim = hf.mamba_d_head
        inner = int(hf.mamba_expand * hf.hidden_size)
        heads = Part.split(total_heads, rank, size, "mamba_n_heads")
        self.num_heads = heads.local
        channels = Part(inner, heads.local * self.head_dim, heads.first * self.head_dim)
        if groups % size == 0:
            group_rows = Part.split(groups * self.d_state, rank, size, "mamba_n_groups x d_state")
            self.shared_group = None
        elif size % groups == 0:  # several ranks read one group: each keeps it whole
            self.shared_group = rank // (size // groups)
            group_rows = Part(groups * self.d_state, self.d_state, self.shared_group * self.d_state)
        else:
            raise ValueError(f"tensor_parallel_size={size} does not fit this model: mamba_n_groups ({groups}) "
                             f"must be divisible by {size}, or divide it")
        self.num_groups = group_rows.local // self.d_state
        self.total_groups, self.group_size = groups, inner // groups  # the norm's groups, in channels
        self.chunk_size = hf.mamba_chunk_size
        self.dt_limit = tuple(hf.time_step_limit) if hf.time_step_limit is not None else (0.0, float("inf"))
        self.eps = hf.rms_norm_eps

        xbc = [channels, group_rows, group_rows]
        self.in_proj = PartsColumnParallelLinear(hf.hidden_size, {None: [channels, *xbc, heads]},
                                                 bias=hf.mamba_proj_bias, tp=tp)
        self.conv1d = PartsConv1d(xbc, hf.mamba_d_conv, bias=hf.mamba_conv_bias)
        self.dt_bias = sharded_vector(heads)
        self.A_log = sharded_vector(heads)
        self.D = sharded_vector(heads)
        self.norm = torch.nn.Module()
        self.norm.weight = sharded_vector(channels)
        self.out_proj = RowParallelLinear(inner, hf.hidden_size, bias=hf.mamba_proj_bias, tp=tp)
        conv_channels = channels.local + 2 * group_rows.local
        self.splits = [channels.local, conv_channels, heads.local]
        self.xbc_splits = [channels.local, group_rows.local, group_rows.local]
        self.state_shapes = {"conv": (conv_channels, hf.mamba_d_conv - 1),
                             "ssm": (self.num_heads, self.head_dim, self.d_state)}

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * silu(z), RMS-normalised over each group of channels, times the weight (float32)."""
        t = y.shape[0]
        width = self.group_size if self.shared_group is None else y.shape[1]  # a group, or this rank's part of one
        y = (y * F.silu(z.float())).view(t, -1, width)
        sq = y.pow(2).sum(-1, keepdim=True)
        if self.shared_group is not None and self.tp is not None:
            # This rank holds part of one group: sum the squares of every rank's part of it.
            every = sq.new_zeros(t, self.total_groups)
            every[:, self.shared_group] = sq[:, 0, 0]
            sq = self.tp.all_reduce(every)[:, self.shared_group, None, None]
        y = y * torch.rsqrt(sq / self.group_size + self.eps)
        return y.view(t, -1) * self.norm.weight.float()

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int],
                trace: StateTrace | None = None) -> torch.Tensor:
        t = x.shape[0]
        z, xbc, dt = self.in_proj(x).split(self.splits, dim=-1)
        xs, B, C = self.conv1d(xbc, state["conv"], query_lens, trace).split(self.xbc_splits, dim=-1)
        xs = xs.view(t, self.num_heads, self.head_dim)
        per_group = self.num_heads // self.num_groups
        B = B.view(t, self.num_groups, self.d_state).repeat_interleave(per_group, dim=1)
        C = C.view(t, self.num_groups, self.d_state).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        A = -self.A_log.float().exp()

        y = torch.empty_like(xs)
        ssm = state["ssm"]
        decodes = leading_decodes(query_lens)
        if decodes:
            y[:decodes] = selective_step(xs[:decodes], dt[:decodes], A, B[:decodes], C[:decodes], ssm[:decodes])
        start = decodes
        for i in range(decodes, len(query_lens)):
            end = start + query_lens[i]
            if trace is not None and i in trace.rows:  # a verification: a token at a time, as decodes step
                for j in range(start, end):
                    y[j:j + 1] = selective_step(xs[j:j + 1], dt[j:j + 1], A, B[j:j + 1], C[j:j + 1], ssm[i:i + 1])
                    trace.record("ssm", i, ssm[i])
            else:
                y[start:end] = chunked_scan(xs[start:end], dt[start:end], A, B[start:end], C[start:end], ssm[i],
                                            self.chunk_size)
            start = end
        y = y + self.D.float()[:, None] * xs
        return self.out_proj(self._gated_norm(y.view(t, -1), z).to(x.dtype))
