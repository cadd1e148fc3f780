"""A mixture-of-experts MLP: a router picks each token's top-k experts, and each expert runs
as one matrix product over all the tokens routed to it (never a loop over tokens).

Expert weights are stacked: `w13` [E, 2I, H] (gate then up), `w2` [E, H, I], and where the
experts have biases (gpt-oss) `w13_bias` [E, 2I], `w2_bias` [E, H]. Tensor parallelism splits
every expert's intermediate dimension, like a dense MLP (column-parallel w13 and its bias,
row-parallel w2), and one all-reduce sums the partial outputs; w2's bias is added by rank 0
alone, so the sum holds it once.

A GGUF file's stacked experts in a type with a CPU kernel (layers/quant/gguf.py ExpertBlocks:
MXFP4 in gpt-oss's files, the K-quants in others) stay in their blocks: w13 or w2 is then uint8
[E, rows, row_bytes] and each expert's product is gguf_matmul's, in the activation mode of the
linear layers built beside it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.activation import Activation, act_and_mul
from pagellm.layers.linear import ReplicatedLinear, default_linear_method
from pagellm.layers.module import HotModule
from pagellm.layers.parallel import divide, load_whole, rank_and_size
from pagellm.layers.quant.gguf import NATIVE_TYPES, ExpertBlocks, gguf_matmul

# What a checkpoint tensor of one expert is: its gate (w1), up (w3) or down (w2) projection.
EXPERT_PARTS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}
# gpt-oss's checkpoints (transformers' GptOssExperts): every expert stacked, each matrix stored
# [in, out] (the "_t" kinds), gate and up interleaved feature by feature, each with a bias.
# Checkpoint tensor -> (the parameter it fills, the kind of part).
INTERLEAVED_EXPERT_TENSORS = {
    "gate_up_proj": ("w13", "w13_interleaved_t"),
    "gate_up_proj_bias": ("w13_bias", "w13_interleaved"),
    "down_proj": ("w2", "w2_t"),
    "down_proj_bias": ("w2_bias", "w2"),
}


class FusedMoE(HotModule):
    """`act`: a `hidden_act` name or an activation object (layers/activation.py); `bias`: every
    expert's gate/up and down projections add a bias (gpt-oss); `scale_inputs`: a token's routing
    weight multiplies what goes into the expert instead of what comes out (Llama 4)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, act: Activation,
                 tp: TensorParallelGroup | None = None, bias: bool = False, scale_inputs: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.act = num_experts, top_k, act
        self.scale_inputs = scale_inputs
        self.tp = tp
        self.rank, size = rank_and_size(tp)
        self.inter = divide(intermediate_size, size, "moe_intermediate_size")  # this rank's
        method = default_linear_method()
        # In the model's dtype from the start where the method knows it (GGUF): the runner's
        # .to(dtype) then leaves these untouched placeholders alone, instead of writing a dense
        # copy of every expert that the blocks replace (gpt-oss-20b: 38 GB in bfloat16).
        dtype = getattr(method, "dtype", None)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype), requires_grad=False)
        self.w13_bias = self.w2_bias = None
        self.hidden_size = hidden_size
        # Where w13 / w2 stay in GGUF blocks: their type (None: dense). The product's options are
        # the linear layers' (layers/quant/gguf.py GGUFLinearMethod), built in the same context.
        self.block_types: dict[str, int | None] = {"w13": None, "w2": None}
        self.activations = getattr(method, "activations", "none")
        self.batch_invariant = getattr(method, "batch_invariant", False)
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * self.inter, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        for p, parts in ((self.w13, ("w1", "w3")), (self.w2, ("w2",)), (self.w13_bias, ("w1", "w3")),
                         (self.w2_bias, ("w2",))):
            if p is None:
                continue
            p.weight_loader = self.weight_loader
            # Filled when every expert's parts arrived, one by one or stacked (part ("all", kind)).
            p.parts_needed = {(e, part) for e in range(num_experts) for part in parts}
            p.expand_part = self.expand_part
        self._touched: set[int] = set()  # the parameters a part was loaded into

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: tuple) -> None:
        """`part`: (expert, "w1" | "w3" | "w2") for one expert's matrix, or ("all", kind) for
        every expert's at once: "w13" (transformers 5's gate_up_proj), "w13_interleaved" (gate
        and up alternating feature by feature: gpt-oss), "w1", "w3" or "w2" (GGUF's
        ffn_{gate,up,down}_exps, transformers 5's down_proj). A kind ending in "_t": the
        checkpoint stores the matrix transposed, [in, out]. A bias takes the same kinds as its
        matrix, without the input dimension. Every expert's matrix in GGUF blocks (ExpertBlocks,
        rows of outputs whatever the kind says) stays in its blocks (_load_blocks)."""
        expert, kind = part
        n, r = self.inter, self.rank
        if isinstance(loaded, ExpertBlocks):
            kind = kind.removesuffix("_t")  # blocks are rows of outputs, whatever a dense checkpoint's layout
            matrix = param is self.w13 or param is self.w2
            if matrix and expert == "all" and (
                    param.dtype == torch.uint8 or not self._filled(param)):
                self._load_blocks(param, loaded, kind)
                return
            loaded = loaded.dequantize(param.dtype)  # a layout kept dense, or joining dense parts already there
        if param.dtype == torch.uint8:
            raise ValueError(f"experts' {kind} is dense but the other parts of its matrix are "
                             f"{self._type_name(param)} blocks; serve the file with quantization 'none'")
        self._touched.add(id(param))
        dst = param.data[slice(None) if expert == "all" else expert]
        if kind.endswith("_t"):
            kind, loaded = kind[:-2], loaded.transpose(-1, -2)
        if param is self.w2_bias:
            load_whole(dst, loaded)  # whole on every rank; rank 0 adds it (forward)
            return
        if param is self.w13_bias:  # as a matrix of one input feature: the rows split as w13's
            dst, loaded = dst.unsqueeze(-1), loaded.unsqueeze(-1)
        if kind in ("w13", "w13_interleaved"):
            gate, up = loaded.chunk(2, dim=-2) if kind == "w13" else (loaded[..., 0::2, :], loaded[..., 1::2, :])
            load_whole(dst[..., :n, :], gate.narrow(-2, r * n, n))
            load_whole(dst[..., n:, :], up.narrow(-2, r * n, n))
        elif kind == "w2":
            load_whole(dst, loaded.narrow(-1, r * n, n))
        else:
            rows = slice(0, n) if kind == "w1" else slice(n, 2 * n)
            load_whole(dst[..., rows, :], loaded.narrow(-2, r * n, n))

    def _filled(self, param: nn.Parameter) -> bool:
        return id(param) in self._touched

    def _type_name(self, param: nn.Parameter) -> str:
        return NATIVE_TYPES[self.block_types["w2" if param is self.w2 else "w13"]]

    def _load_blocks(self, param: nn.Parameter, loaded: ExpertBlocks, kind: str) -> None:
        """Every expert's gate, up or down rows kept in their blocks (this rank's rows of gate and
        up, its columns of down: those cut at block boundaries, or ValueError). `kind` as in
        weight_loader, with gate and up stacked ("w13") or alternating ("w13_interleaved") rows."""
        if kind in ("w13", "w13_interleaved"):
            rows = loaded.data.shape[1]
            gate, up = ((slice(0, rows // 2), slice(rows // 2, rows)) if kind == "w13"
                        else (slice(0, rows, 2), slice(1, rows, 2)))
            for half, part in ((gate, "w1"), (up, "w3")):
                self._load_blocks(param, ExpertBlocks(loaded.data[:, half].contiguous(), loaded.qtype, loaded.cols),
                                  part)
            return
        key = "w2" if param is self.w2 else "w13"
        n, r = self.inter, self.rank
        parts = [loaded.expert(e) for e in range(self.num_experts)]
        parts = [p.narrow(1, r * n, n) if kind == "w2" else p.narrow(0, r * n, n) for p in parts]
        data = torch.stack([p.data for p in parts])
        if param.dtype != torch.uint8:  # the first part: the dense placeholder becomes blocks
            param.data = torch.zeros((self.num_experts, param.shape[1], data.shape[2]), dtype=torch.uint8)
            self.block_types[key] = loaded.qtype
        elif self.block_types[key] != loaded.qtype:
            raise ValueError(f"experts' {kind} is {loaded.type_name} but the other parts of its matrix are "
                             f"{self._type_name(param)}; serve the file with quantization 'none'")
        self._touched.add(id(param))
        rows = slice(None) if kind == "w2" else slice(0, n) if kind == "w1" else slice(n, 2 * n)
        param.data[:, rows] = data

    def expand_part(self, part: tuple) -> set[tuple]:
        """The (expert, matrix) pairs a loaded part fills."""
        expert, kind = part
        kind = kind.removesuffix("_t")
        experts = range(self.num_experts) if expert == "all" else (expert,)
        kinds = ("w1", "w3") if kind in ("w13", "w13_interleaved") else (kind,)
        return {(e, k) for e in experts for k in kinds}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; weights, experts: [T, k] (each token's routing weights and experts)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        routed = x[tokens]
        scale = weights.reshape(-1)[order]
        if self.scale_inputs:
            routed = routed * scale[:, None]
        out = torch.zeros_like(x)
        start = 0
        b13 = self.w13_bias
        b2 = self.w2_bias if self.rank == 0 else None  # once in the all-reduced sum
        one_token = x.shape[0] == 1  # a decode step of one sequence: every expert adds into row 0
        # Experts in index order, each adding into its tokens' rows: the reference's summation order.
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = act_and_mul(self._product(routed[rows], "w13", e, None if b13 is None else b13[e]), self.act)
            y = self._product(h, "w2", e, None if b2 is None else b2[e])
            if not self.scale_inputs:
                y = y * scale[rows, None]
            y = y.to(out.dtype)
            if one_token:
                out.add_(y)
            else:
                # A token picks an expert once, so its rows here are distinct: gather, add and scatter
                # round as index_add_ does. index_add_ itself runs a parallel region even for one row,
                # which waits for a worker thread: on busy cores milliseconds, 96 times a gpt-oss step.
                idx = tokens[rows]
                out[idx] += y
            start += n
        return out if self.tp is None else self.tp.all_reduce(out)

    def _product(self, x: torch.Tensor, key: str, e: int, bias: torch.Tensor | None) -> torch.Tensor:
        w, qtype = getattr(self, key)[e], self.block_types[key]
        if qtype is None:
            return F.linear(x, w, bias)
        cols = self.hidden_size if key == "w13" else self.inter
        y = gguf_matmul(x, w, qtype, cols, self.batch_invariant, self.activations)
        return y if bias is None else y + bias

    def macs_per_token(self) -> int:
        """Multiply-adds of one token's experts (gate, up and down of its top_k)."""
        return self.top_k * 3 * self.inter * self.hidden_size


class SparseMoeBlock(HotModule):
    """Router + experts. By default the router's softmax runs over every expert and the top-k
    are taken from it; `renormalize`: those weights are rescaled to sum to 1 (Mixtral always;
    Qwen3-MoE when norm_topk_prob). `softmax_after_topk`: the top-k router logits are taken
    first and the softmax runs over them alone (gpt-oss). `bias`: the router and the experts
    have biases (gpt-oss).

    DeepSeek-V3's router (`sigmoid`): each expert scores sigmoid(logit); experts are chosen by
    score + `e_score_correction_bias` (a loaded parameter) but weighted by the score alone; with
    `groups` (n_group, topk_group) only the topk_group groups whose two best choice scores sum
    highest are eligible; the weights are renormalized (+ 1e-20) when `renormalize`, then
    multiplied by `routed_scaling_factor`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, act: Activation,
                 renormalize: bool, tp: TensorParallelGroup | None = None, *, softmax_after_topk: bool = False,
                 bias: bool = False, sigmoid: bool = False, groups: tuple[int, int] | None = None,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, act, tp, bias)
        self.top_k, self.renormalize, self.softmax_after_topk = top_k, renormalize, softmax_after_topk
        self.sigmoid, self.routed_scaling_factor = sigmoid, routed_scaling_factor
        self.e_score_correction_bias = None
        if sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        if groups is not None and num_experts % groups[0]:
            raise ValueError(f"n_group={groups[0]} does not divide the {num_experts} experts")
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.sigmoid:
            weights, experts = self._sigmoid_route(logits)
        elif self.softmax_after_topk:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            weights = F.softmax(top, dim=-1, dtype=torch.float32)
        else:
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, weights.to(x.dtype), experts)

    def _sigmoid_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float().sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.groups is not None:
            n_group, topk_group = self.groups
            grouped = choice.view(-1, n_group, choice.shape[-1] // n_group)
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(-1), topk_group, dim=-1)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class GatedSharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus one shared expert every token goes through, its output scaled by the
    sigmoid of its own one-output gate (Qwen2-MoE, Qwen3.5-MoE). Checkpoint names: `gate`,
    `experts`, `shared_expert`, `shared_expert_gate`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, act: Activation,
                 renormalize: bool, shared_expert: nn.Module, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, act, renormalize, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def route_expert_weight(name: str) -> tuple[str, tuple] | None:
    """A checkpoint name of experts' matrices -> (the stacked parameter, its part), or None.
    One expert per tensor: `...experts.<e>.<w1|w3|w2|gate_proj|up_proj|down_proj>.weight`; all
    experts stacked: `...experts.<gate_up_proj|gate_proj|up_proj|down_proj>[.weight]`, and their
    biases stacked one kind at a time (GGUF's ffn_*_exps.bias): `...experts.<w1|w3|w2|...>_bias`."""
    head, sep, tail = name.partition(".experts.")
    if not sep:
        return None
    tail = tail.removesuffix(".weight")
    if tail == "gate_up_proj":
        return f"{head}.experts.w13", ("all", "w13")
    bias = ""
    if tail.endswith("_bias") and tail.removesuffix("_bias") in EXPERT_PARTS:
        tail, bias = tail.removesuffix("_bias"), "_bias"
    expert, _, rest = tail.partition(".") if "." in tail else ("all", "", tail)
    kind = EXPERT_PARTS.get(rest)
    if not (expert == "all" or expert.isdigit()) or kind is None:
        return None
    param = f"{'w2' if kind == 'w2' else 'w13'}{bias}"
    return f"{head}.experts.{param}", (expert if expert == "all" else int(expert), kind)


def route_interleaved_expert_weight(name: str) -> tuple[str, tuple] | None:
    """A checkpoint name of gpt-oss's experts (INTERLEAVED_EXPERT_TENSORS:
    `...experts.<gate_up_proj|down_proj>[_bias]`) -> (the stacked parameter, its part), or None."""
    head, sep, tail = name.partition(".experts.")
    if not sep or tail not in INTERLEAVED_EXPERT_TENSORS:
        return None
    param, kind = INTERLEAVED_EXPERT_TENSORS[tail]
    return f"{head}.experts.{param}", ("all", kind)
