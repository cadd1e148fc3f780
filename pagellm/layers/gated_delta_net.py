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
The recurrence is computed in float32. A step of decodes alone, float32 on the CPU, is one compiled
call (cpu.gdn_decode_step: from in_proj's output to out_proj's input, the states updated where they
lie in the pool) instead of the torch code below, which it matches to float32 rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagellm.kernels import cpu
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


def decode_kernel_serves(layer: GatedDeltaNet, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                         meta) -> bool:
    """Whether cpu.gdn_decode_step computes this step of `layer`: every sequence decoding one token
    with nothing to trace (verifications run the torch path), float32 inputs and parameters on the
    CPU with the kernels built, the layer as the kernel knows it (SiLU convolution without bias, a
    plain norm weight), and a pool each of whose blocks' K and V parts is contiguous (a layer's view
    of a larger slot is, block by block) and the same whole number of 4-byte words."""
    if meta.verifying or any(n != 1 for n in meta.query_lens) or x.dtype != torch.float32 or not cpu.usable(x):
        return False
    if (layer.conv1d.bias is not None or layer.conv1d.activation != "silu" or layer.norm.unit_offset
            or any(p.dtype != torch.float32 for p in (layer.A_log, layer.dt_bias, layer.norm.weight))):
        return False
    k, v = kv_cache
    return (k.is_cpu and k.dim() >= 2 and k[0].is_contiguous() and v[0].is_contiguous()
            and k[0].numel() * k.element_size() == v[0].numel() * v.element_size()
            and k[0].numel() * k.element_size() % 4 == 0)


# The smallest decay factor the chunked form uses (see there): 2^-40.
_LOG_TINY = -40 * math.log(2)


def _chunk_major(t: torch.Tensor, n: int, chunk: int, scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """[L, h, ...] -> [n, h, chunk, ...] (a chunk's rows of one head together), zero past L, in
    one pass: multiplied by `scale` ([n, h, chunk], already chunk-major) where given, written
    into `out` where given."""
    length, h = t.shape[:2]
    out = t.new_empty(n, h, chunk, *t.shape[2:]) if out is None else out
    if scale is not None:
        scale = scale.view(*scale.shape, *(1,) * (t.dim() - 2))

    def put(dst: torch.Tensor, src: torch.Tensor, sc: torch.Tensor | None) -> None:
        if sc is None:
            dst.copy_(src)
        else:
            torch.mul(src, sc, out=dst)

    full, tail = divmod(length, chunk)
    if full:
        put(out[:full], t[:full * chunk].unflatten(0, (full, chunk)).transpose(1, 2),
            None if scale is None else scale[:full])
    if tail:
        put(out[full, :, :tail], t[full * chunk:].transpose(0, 1), None if scale is None else scale[full, :, :tail])
        out[full, :, tail:].zero_()
    return out


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """L tokens of one sequence: q, k [L, Hk, dk] on key heads, each serving H / Hk consecutive
    value heads; v [L, H, dv], g, beta [L, H]; state [H, dk, dv] (updated in place) -> [L, H, dv].

    Within a chunk the delta rule's updates are one triangular solve (the UT transform, as in
    transformers' torch_chunk_gated_delta_rule); across chunks the state is carried one chunk at
    a time. Fewer than `chunk` tokens are one chunk of their own length: padded to a whole chunk,
    a short prefill (a prompt's tail after a cached prefix) would cost as much as 64 tokens.

    Laid out chunk-major ([n, heads, chunk, ...]) so that every chunk's slice is contiguous: the
    products of the carried state are then one batched product over the heads each, with no
    per-head loop inside torch and no copy of their operands. Products that do not depend on
    the value head (q k^T, k k^T) are computed once per key head. The solve is handed its
    matrices transposed (solve X A^T = B^T for X^T), the layout LAPACK works in, and writes
    into its right-hand side, so it copies nothing."""
    length, heads = g.shape
    key_heads, dk = k.shape[1:]
    dv = v.shape[2]
    group = heads // key_heads
    chunk = min(chunk, length)
    n = -(-length // chunk)
    per_key = (n, key_heads, group, chunk)  # a value-head tensor viewed by its key heads
    # Padding adds tokens with g = 0, beta = 0 and k = 0: no decay, no write, so the state is the last real token's.
    g, beta = _chunk_major(g, n, chunk), _chunk_major(beta, n, chunk)  # [n, H, chunk]
    q, k = _chunk_major(q, n, chunk), _chunk_major(k, n, chunk)  # [n, Hk, chunk, dk]
    cum = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    # Every decay factor is at least 2^-40 (_LOG_TINY): a fast-forgetting head's factors would
    # otherwise reach float32's subnormal range, where each product costs a microcode assist (the
    # chunk's products ran at half speed), and what they weight is then 2^-40 of its size or less,
    # far below float32's rounding of the terms beside it.
    decay_in = cum.clamp(min=_LOG_TINY).exp_()
    # -inf above the diagonal (a later token does not reach an earlier one): added, not masked_fill_
    # with a broadcast mask, which is several times slower on the CPU.
    future = torch.full((chunk, chunk), float("-inf"), device=q.device).triu_(1)
    decay = (cum[..., :, None] - cum[..., None, :]).clamp_(min=_LOG_TINY).add_(future).exp_()  # token j to token i
    decay = decay.view(*per_key, chunk)
    k_t = k.mT
    # solve_triangular reads the strict lower part of `system` as I + that (the diagonal is never read).
    system = torch.mul(decay, (k @ k_t).unsqueeze(2)).mul_(beta.view(*per_key, 1))
    attn = decay.mul_((q @ k_t).unsqueeze(2)).view(n, heads, chunk, chunk)  # in place: decay is not read again
    # Right-hand sides [v beta | k beta e^cum], solved in place into [u | w].
    uw = torch.empty(*per_key, dv + dk, dtype=v.dtype, device=v.device)
    _chunk_major(v, n, chunk, scale=beta, out=uw.view(n, heads, chunk, dv + dk)[..., :dv])
    torch.mul(k.unsqueeze(2), (beta * decay_in).view(*per_key, 1), out=uw[..., dv:])
    torch.linalg.solve_triangular(system.mT, uw.mT, upper=True, left=False, unitriangular=True, out=uw.mT)
    uw = uw.view(n, heads, chunk, dv + dk)
    u, w = uw[..., :dv], uw[..., dv:]
    q_decayed = torch.mul(q.unsqueeze(2), decay_in.view(*per_key, 1)).view(n, heads, chunk, dk)
    to_end = (cum[..., -1:] - cum).clamp_(min=_LOG_TINY).exp_()
    k_to_end = torch.mul(k.unsqueeze(2), to_end.view(*per_key, 1)).view(n, heads, chunk, dk)
    chunk_decay = decay_in[..., -1, None, None]  # [n, H, 1, 1]
    out = torch.empty(n, heads, chunk, dv, dtype=v.dtype, device=v.device)
    v_new = torch.empty_like(out)
    # A sequence's first prefill starts from a zero state: the first chunk's products with it are zeros.
    first = 0 if state.any() else 1
    if first:
        torch.bmm(attn[0], u[0], out=out[0])
        torch.bmm(k_to_end[0].mT, u[0], out=state)
    for i in range(first, n):
        torch.baddbmm(u[i], w[i], state, alpha=-1, out=v_new[i])  # what the state does not already predict
        torch.bmm(q_decayed[i], state, out=out[i])
        out[i].baddbmm_(attn[i], v_new[i])
        state.mul_(chunk_decay[i]).baddbmm_(k_to_end[i].mT, v_new[i])
    return out.transpose(1, 2).reshape(n * chunk, heads, dv)[:length]


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

    def cached_forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        """A step of decodes in one compiled call (cpu.gdn_decode_step), the states updated in their
        pool blocks, where the kernel serves (decode_kernel_serves); otherwise the torch path."""
        if not decode_kernel_serves(self, x, kv_cache, meta):
            return super().cached_forward(x, kv_cache, meta)
        out = cpu.gdn_decode_step(self.in_proj(x), self.conv1d.weight[:, 0], self.A_log, self.dt_bias,
                                  self.norm.weight, self.norm.eps, kv_cache, meta.state_block_ids[self.kv_group],
                                  meta.fresh_states, self.num_k_heads, self.dk, self.dv, self.tiled)
        return self.out_proj(out)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int],
                trace: StateTrace | None = None) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        q, k, v = self.conv1d(qkv, state["conv"], query_lens, trace).split(self.qkv_splits, dim=-1)
        group = self.num_v_heads // self.num_k_heads  # value heads per key head
        q = _l2norm(q.view(t, -1, self.dk)) * self.dk ** -0.5  # [t, key heads, dk]
        k = _l2norm(k.view(t, -1, self.dk))
        v = v.view(t, -1, self.dv)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        def by_value_head(rows: slice) -> tuple[torch.Tensor, ...]:  # what recurrent_step takes: q, k per value head
            return (q[rows].repeat_interleave(group, dim=1), k[rows].repeat_interleave(group, dim=1), v[rows],
                    g[rows], beta[rows])

        ssm = state["ssm"]
        decodes = leading_decodes(query_lens)
        if decodes == 0 and len(query_lens) == 1 and trace is None:  # one prefill: its output as it comes
            out = chunked_delta_rule(q, k, v, g, beta, ssm[0], self.chunk_size)
        else:
            out = torch.empty_like(v)
            if decodes:
                out[:decodes] = recurrent_step(*by_value_head(slice(0, decodes)), ssm[:decodes])
            start = decodes
            for i in range(decodes, len(query_lens)):
                end = start + query_lens[i]
                if trace is not None and i in trace.rows:  # a verification: a token at a time, as decodes step
                    for j in range(start, end):
                        out[j:j + 1] = recurrent_step(*by_value_head(slice(j, j + 1)), ssm[i:i + 1])
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
