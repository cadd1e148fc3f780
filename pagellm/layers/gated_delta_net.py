"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 (transformers' Qwen3_5GatedDeltaNet).

Per token t and value head h, with q, k l2-normalised (q also scaled by dk^-1/2) and the state
S [dk, dv]:

    S = exp(g_t) S                        g_t = -exp(A_log) softplus(a_t + dt_bias)  (decay)
    S = S + k_t (beta_t (v_t - k_t^T S))  beta_t = sigmoid(b_t)                       (delta rule)
    o_t = q_t^T S

where q, k, v come out of a short causal convolution (SiLU) over the projected q/k/v, key heads
serve num_v_heads / num_k_heads consecutive value heads, and the output is RMS-normalised per
head, gated by silu(z_t) and projected out. A GGUF file's out_proj takes the value heads tiled
across key heads instead ([v0 of every key head, v1 of every key head, ...], llama.cpp's order;
`linear_out_proj_tiled` in the config): its columns stay so, in their quantized blocks, and the
heads are handed to it in that order.

State per sequence: "conv" [conv channels, K - 1] (the convolution's last inputs) and "ssm"
[value heads, dk, dv] (S), both on this rank's heads. A step's decodes are advanced one token
together; each prefill (or prefill chunk) goes through the chunked form (chunks of 64 as in
transformers' torch_chunk_gated_delta_rule) starting from the state its previous chunks left.
The recurrence is computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup, rank_and_size
from pagellm.layers.recurrent import RecurrentMixer, StateTrace
from pagellm.layers.sharded_parts import (Part, PartsColumnParallelLinear, PartsConv1d, PartsRowParallelLinear,
                                          leading_decodes, sharded_vector)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # the eps of transformers' (and FLA's) l2norm


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of N sequences: q, k [N, H, dk], v [N, H, dv], g, beta [N, H]; state [N, H, dk, dv]
    (updated in place) -> [N, H, dv]. The state is the bulk of the memory traffic: it is read
    once for both products (k^T S and q^T S, before the step's decay and write, which the
    output then adds: q^T S' = e^g q^T S + (q.k) delta) and updated in two in-place passes."""
    decay = g.exp()[..., None]
    k_s, q_s = (torch.stack([k, q], dim=2) @ state).unbind(2)
    delta = (v - decay * k_s) * beta[..., None]
    out = decay * q_s + (q * k).sum(-1, keepdim=True) * delta
    state.mul_(decay[..., None]).addcmul_(k[..., None], delta[..., None, :])
    return out


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """L tokens of one sequence: q, k [L, H, dk], v [L, H, dv], g, beta [L, H]; state [H, dk, dv]
    (updated in place) -> [L, H, dv]. Within a chunk the delta rule's updates are one triangular
    solve (the UT transform, as in transformers' torch_chunk_gated_delta_rule); across chunks
    the state is carried one chunk at a time. Fewer than `chunk` tokens are one chunk of their
    own length: padded to a whole chunk, a short prefill (a prompt's tail after a cached prefix)
    would cost as much as 64 tokens."""
    length, heads = g.shape
    chunk = min(chunk, length)
    pad = -length % chunk
    n = (length + pad) // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, chunk, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad)).transpose(0, 1)
        return t.reshape(heads, n, chunk, *t.shape[2:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    # Padding adds tokens with g = 0, beta = 0 and k = 0: no decay, no write, so the state is the last real token's.
    cum = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # token j to token i
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # solve_triangular reads its strict lower part as I + that
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    s = state
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s  # what the state does not already predict
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)


class GatedDeltaNet(RecurrentMixer):
    """Qwen3.5's linear-attention layer. `hf`: the text config (linear_num_key_heads,
    linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim,
    hidden_size, rms_norm_eps). Under tensor parallelism each rank holds num_k_heads / tp key
    heads and num_v_heads / tp value heads (both must divide), with their conv channels, A_log,
    dt_bias and output columns; the per-head norm is whole on every rank."""

    # The checkpoint's four input projections fill one fused in_proj: a family adds these to its
    # `stacked_params` (checkpoint name fragment -> parameter fragment, part).
    stacked_params = ((".in_proj_qkv.", ".in_proj.", "qkv"), (".in_proj_z.", ".in_proj.", "z"),
                      (".in_proj_b.", ".in_proj.", "b"), (".in_proj_a.", ".in_proj.", "a"))
    chunk_size = 64

    def __init__(self, hf, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        rank, size = rank_and_size(tp)
        self.dk, self.dv = hf.linear_key_head_dim, hf.linear_value_head_dim
        self.num_k_heads = Part.split(hf.linear_num_key_heads, rank, size, "linear_num_key_heads").local
        heads = Part.split(hf.linear_num_value_heads, rank, size, "linear_num_value_heads")
        self.num_v_heads = heads.local
        key = Part.split(hf.linear_num_key_heads * self.dk, rank, size, "key rows")
        value = Part.split(hf.linear_num_value_heads * self.dv, rank, size, "value rows")
        kernel = hf.linear_conv_kernel_dim

        self.in_proj = PartsColumnParallelLinear(
            hf.hidden_size, {"qkv": [key, key, value], "z": [value], "b": [heads], "a": [heads]}, tp=tp)
        self.conv1d = PartsConv1d([key, key, value], kernel, bias=False)
        self.dt_bias = sharded_vector(heads)
        self.A_log = sharded_vector(heads)
        self.norm = RMSNorm(self.dv, hf.rms_norm_eps)
        group = self.num_v_heads // self.num_k_heads
        self.tiled = bool(getattr(hf, "linear_out_proj_tiled", False)) and group > 1
        # Tiled: one part of out_proj's columns per value head of a key head, each over every key head.
        columns = ([Part.split(hf.linear_num_key_heads * self.dv, rank, size, "value rows")] * group if self.tiled
                   else [value])
        self.out_proj = PartsRowParallelLinear(columns, hf.hidden_size, tp=tp)
        conv_channels = 2 * key.local + value.local
        self.splits = [conv_channels, value.local, heads.local, heads.local]
        self.qkv_splits = [key.local, key.local, value.local]
        self.state_shapes = {"conv": (conv_channels, kernel - 1),
                             "ssm": (self.num_v_heads, self.dk, self.dv)}

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int],
                trace: StateTrace | None = None) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        q, k, v = self.conv1d(qkv, state["conv"], query_lens, trace).split(self.qkv_splits, dim=-1)
        group = self.num_v_heads // self.num_k_heads  # value heads per key head
        q = (_l2norm(q.view(t, -1, self.dk)) * self.dk ** -0.5).repeat_interleave(group, dim=1)
        k = _l2norm(k.view(t, -1, self.dk)).repeat_interleave(group, dim=1)
        v = v.view(t, -1, self.dv)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        out = torch.empty_like(v)
        ssm = state["ssm"]
        decodes = leading_decodes(query_lens)
        if decodes:
            out[:decodes] = recurrent_step(q[:decodes], k[:decodes], v[:decodes], g[:decodes], beta[:decodes],
                                           ssm[:decodes])
        start = decodes
        for i in range(decodes, len(query_lens)):
            end = start + query_lens[i]
            if trace is not None and i in trace.rows:  # a verification: a token at a time, as decodes step
                for j in range(start, end):
                    out[j:j + 1] = recurrent_step(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1],
                                                  ssm[i:i + 1])
                    trace.record("ssm", i, ssm[i])
            else:
                out[start:end] = chunked_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end],
                                                    beta[start:end], ssm[i], self.chunk_size)
            start = end

        # The gated norm: normalised in float32, scaled by the weight in the model's dtype, then gated.
        out = (self.norm(out.to(x.dtype)).float() * F.silu(z.float().view(t, -1, self.dv))).to(x.dtype)
        if self.tiled:  # [t, key heads, value heads of each, dv] -> [t, value heads of each, key heads, dv]
            out = out.view(t, self.num_k_heads, group, self.dv).transpose(1, 2)
        return self.out_proj(out.reshape(t, -1))
