"""A GGUF file's quantized matrices served in their blocks give the model the same file gives
dequantized (`quantization="none"`, the reference): greedy tokens agree on >= 99% of positions
and logprobs within LOGPROB_ATOL in float32, on the bundled Q4_1 SmolLM2 and on a random model
whose fused layers mix types (q Q4_0, k Q4_1, v Q8_0; gate Q4_1 with up kept float32), also with
its down in Q4_K, Q5_K or Q6_K (the tests' own encoder's blocks). No dense copy of a quantized
matrix exists after load, and the weights take the file's bytes.

Agreement is measured teacher-forced: the reference's greedy continuation is fed back as a
prompt with prompt_logprobs, so every position is compared on the same context (a free-running
comparison would stop meaning anything after the first divergence). The quantized engine runs
with float32 activations (activation_quantization "none") and FEW_ROWS tokens a step, so every
product goes through the fused kernel that decode steps use; with large steps the weights are
widened tile by tile (checked too).

With `activation_quantization="int8"` the products round their activations to int8 (as
llama.cpp does), so logprobs move by more than summation order; "int8x2" adds a second code
and must still reach MIN_AGREEMENT.
"""
from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from pagellm import LLM, SamplingParams
from pagellm.kernels.cpu import quant_kernels
from pagellm.layers.quant.gguf import BF16_TILES, INT8_MAX_ROWS
from pagellm.loader.bundled import default_model_path
from tests.models.families import build
from tests.models.llama_cpp import convert, requantize
from tests.models.test_gguf_families import smollm2_tokenizer  # noqa: F401  (a fixture)

# Float32 products in another summation order (blocks, tiles) than the dense GEMM.
LOGPROB_ATOL = 2e-3
MIN_AGREEMENT = 0.99
# Activations rounded to int8 codes (activation_quantization): each product's inputs carry an error of up to
# 1/254 of their 32-value block's largest value with one code, 1/32512 with two. One code moves this small
# model's greedy token at ~2-3% of positions (measured 98.0% on 64 x 64, below MIN_AGREEMENT: docs/quantization.md says
# so); two do not.
INT8_MIN_AGREEMENT, INT8_LOGPROB_ATOL = 0.95, 1.0
INT8X2_LOGPROB_ATOL = 1e-2
# At most this many rows per product: the fused kernel's regime (FUSED_MAX_ROWS[float32] is 32).
FEW_ROWS = dict(max_num_batched_tokens=32, max_num_seqs=32)

# The random model's types: fused q/k/v of three types, gate/up of a quantized and a dense part.
RANDOM_TYPES = {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
                "ffn_gate": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0, "output": T.Q4_0}


WORDS = ("the a of to in is was for on with he she it they we you that this what when where why how "
         "cat dog house city river mountain story code function number list water music").split()


def word_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n short sentences of WORDS (2-11 words), tokenized: prompts a small chat model continues."""
    rng = random.Random(seed)
    return [tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 12))).capitalize())
            for _ in range(n)]


def _type_of(name: str):
    return RANDOM_TYPES.get(name.split(".")[-2])  # None (ffn_up): kept float32


def _teacher_forced(llm: LLM, sequences: list[list[int]], starts: list[int],
                    top: int = 0) -> list[list[tuple[float, int, float]]]:
    """(logprob, rank, margin) of each token of each sequence from position `starts[i]` on, given
    those before it; all sequences in one batch. The margin is the token's logprob less the best other
    token's among the `top` most likely (nan when `top` is 0: not asked)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    rows = []
    for seq, start, out in zip(sequences, starts, outs):
        row = []
        for tok, e in zip(seq[start:], out.prompt_logprobs[start:]):
            others = [v.logprob for t, v in e.items() if t != tok]
            margin = e[tok].logprob - max(others) if top and others else float("nan")
            row.append((e[tok].logprob, e[tok].rank, margin))
        rows.append(row)
    return rows


@dataclass
class Comparison:
    """How one engine's teacher-forced tokens compare with the reference's."""
    agreement: float  # share of positions where its greedy token is the reference's
    worst: float  # the largest logprob difference of the reference's token
    # at each disagreement, how far the reference's token led its runner-up (the reference's margin):
    # a flip where the reference itself nearly tied is the arithmetic's rounding, not a broken product
    disagreement_margins: list[float]


class Reference:
    """The reference engine's greedy continuations of `prompts` and its teacher-forced logprobs on
    them, computed once; `compare` measures another engine against them."""

    def __init__(self, reference: LLM, prompts: list[list[int]], new_tokens: int) -> None:
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outs = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        self.seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        self.starts = [len(p) for p in prompts]
        # All sequences in one batch per engine (the pools here hold them all: a batch of prompt-logprob
        # requests that did not fit would thrash on preemption, since the prefix cache cannot serve them).
        self.rows = _teacher_forced(reference, self.seqs, self.starts, top=2)

    def compare(self, quantized: LLM) -> tuple[float, float]:
        """(share of positions where the quantized model's greedy token is the reference's, the
        largest logprob difference there)."""
        c = self.compare_detail(quantized)
        return c.agreement, c.worst

    def compare_detail(self, quantized: LLM) -> Comparison:
        agree = total = 0
        worst = 0.0
        margins = []
        for ref, ours in zip(self.rows, _teacher_forced(quantized, self.seqs, self.starts)):
            for (ref_lp, _, ref_margin), (lp, rank, _) in zip(ref, ours):
                agree += rank == 1
                total += 1
                worst = max(worst, abs(lp - ref_lp))
                if rank != 1:
                    margins.append(ref_margin)
        return Comparison(agree / total, worst, margins)


def _compare(quantized: LLM, reference: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Reference(...).compare(quantized), over the reference's greedy continuations."""
    return Reference(reference, prompts, new_tokens).compare(quantized)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, smollm2_tokenizer):  # noqa: F811
    tmp = tmp_path_factory.mktemp("quantized")
    # 128 wide: a row-parallel layer's half of the columns (64) is a whole chunk of the integer kernel.
    model_dir = build("llama", tmp / "llama", vocab_size=49152, hidden_size=128, intermediate_size=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_tokenizer / name, model_dir / name)
    f32 = convert(model_dir, tmp / "llama-f32.gguf")
    return requantize(f32, tmp / "llama-mixed.gguf", _type_of)


def test_mixed_types_match_the_dequantized_model(mixed_gguf):
    """Float32 activations (activation_quantization "none"), within LOGPROB_ATOL; the default mode
    (auto: int8x2 where the integer kernels are built), within INT8X2_LOGPROB_ATOL: which steps round
    their activations depends on the build (gguf.int8_max_rows: against these types up to 8 rows with
    AVX-512 VNNI, 32 with AVX2), and with every FEW_ROWS step rounded this model's logprobs move by
    ~5e-3 on either build, past LOGPROB_ATOL."""
    types = {t.name.split(".")[-2]: t.tensor_type for t in GGUFReader(mixed_gguf).tensors}
    assert types["attn_v"] == T.Q8_0 and types["ffn_up"] == T.F32  # the file is what the test says
    exact = LLM(str(mixed_gguf), num_kv_blocks=128, block_size=8, activation_quantization="none", **FEW_ROWS)
    reference = LLM(str(mixed_gguf), num_kv_blocks=128, block_size=8, quantization="none")
    qkv = exact.engine.runner.model.layers[0].self_attn.qkv_proj
    assert [t for t in qkv.segment_types] == [int(T.Q4_0), int(T.Q4_1), int(T.Q8_0)]
    gate_up = exact.engine.runner.model.layers[0].mlp.gate_up_proj
    assert gate_up.segment_types == [int(T.Q4_1), None]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    few = Reference(reference, prompts, 24)
    agreement, worst = few.compare(exact)
    assert agreement >= MIN_AGREEMENT
    assert 0 < worst <= LOGPROB_ATOL  # not 0: the blocks were multiplied, not a dense copy
    agreement, worst = few.compare(LLM(str(mixed_gguf), num_kv_blocks=128, block_size=8, **FEW_ROWS))
    assert agreement >= MIN_AGREEMENT
    assert worst <= INT8X2_LOGPROB_ATOL
    # One step of all the rows: float32 tiles; in the default mode Q8_0's products are the integer
    # prefill kernel's (x8_prefill, int8x2 on both builds), the others still float32 tiles.
    whole = Reference(reference, prompts, 8)
    for activations, atol in (("none", LOGPROB_ATOL), ("auto", INT8X2_LOGPROB_ATOL)):
        tiled = LLM(str(mixed_gguf), num_kv_blocks=128, block_size=8, activation_quantization=activations)
        agreement, worst = whole.compare(tiled)
        assert agreement >= MIN_AGREEMENT
        assert worst <= atol, activations


@pytest.mark.slow
def test_table_types_match_the_dequantized_model(mixed_gguf, tmp_path):
    """q in IQ4_NL, gate in MXFP4 and down in IQ4_XS (the types whose codes index a table), served in
    their blocks beside the others, against the same file dequantized: float32 products, and the
    default int8x2 activations."""
    table = {"attn_q": T.IQ4_NL, "ffn_gate": T.MXFP4, "ffn_down": T.IQ4_XS}
    path = requantize(mixed_gguf, tmp_path / "table.gguf", lambda name: table.get(name.split(".")[-2]))
    reference = LLM(str(path), num_kv_blocks=128, block_size=8, quantization="none")
    exact = LLM(str(path), num_kv_blocks=128, block_size=8, activation_quantization="none", **FEW_ROWS)
    layer = exact.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.segment_types == [int(T.IQ4_NL), int(T.Q4_1), int(T.Q8_0)]
    assert layer.mlp.gate_up_proj.segment_types == [int(T.MXFP4), None]
    assert layer.mlp.down_proj.segment_types == [int(T.IQ4_XS)]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    agreement, worst = _compare(exact, reference, prompts, 16)
    assert agreement >= MIN_AGREEMENT and 0 < worst <= LOGPROB_ATOL
    agreement, worst = _compare(LLM(str(path), num_kv_blocks=128, block_size=8, **FEW_ROWS), reference, prompts, 16)
    assert agreement >= MIN_AGREEMENT and worst <= INT8X2_LOGPROB_ATOL


# Q5_K in the fast suite (test_mixed_types_match_the_dequantized_model's file cannot carry it), Q4_K and Q6_K
# with the slow tests.
@pytest.mark.parametrize("qtype", [pytest.param(T.Q4_K, marks=pytest.mark.slow), T.Q5_K,
                                   pytest.param(T.Q6_K, marks=pytest.mark.slow)], ids=lambda t: t.name)
def test_k_quant_down_matches_the_dequantized_model(mixed_gguf, tmp_path, qtype):
    """down in a K-quant (tests/kernels/gguf_blocks.quantize_k's blocks; its rows of 256 values are this model's
    only ones whole super-blocks fit, and the mixed file keeps Q8_0 there: two ranks split them at 128 values),
    served in its blocks beside the other types, against the same file dequantized: float32 products within
    LOGPROB_ATOL, and the default int8x2 activations, which take the tiles the 128 rows are repacked into,
    within INT8X2_LOGPROB_ATOL; FEW_ROWS steps, and steps of all the rows."""
    path = requantize(mixed_gguf, tmp_path / f"{qtype.name}.gguf",
                      lambda name: qtype if name.split(".")[-2] == "ffn_down" else None)
    reference = LLM(str(path), num_kv_blocks=128, block_size=8, quantization="none")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    ref = Reference(reference, prompts, 16)
    for activations, atol in (("none", LOGPROB_ATOL), ("auto", INT8X2_LOGPROB_ATOL)):
        for steps in (FEW_ROWS, {}):
            llm = LLM(str(path), num_kv_blocks=128, block_size=8, activation_quantization=activations, **steps)
            down = llm.engine.runner.model.layers[0].mlp.down_proj
            assert down.segment_types == [int(qtype)]  # the file is what the test says
            # Mode none keeps the blocks; the integer modes multiply the tiles of 8 rows.
            repacked = activations == "auto" and INT8_KERNELS
            assert down.gguf_products[0][0] == (quant_kernels().repacked_types[int(qtype)] if repacked else int(qtype))
            agreement, worst = ref.compare(llm)
            assert agreement >= MIN_AGREEMENT, (activations, steps)
            assert worst <= atol, (activations, steps)
            # Not 0 in FEW_ROWS steps: the blocks were multiplied (steps of all the rows widen them for the
            # dense GEMM, measured 0 apart from the reference).
            assert activations != "none" or not steps or worst > 0


@pytest.fixture(scope="module")
def bundled_reference() -> Reference:
    """The bundled SmolLM2 dequantized, on 16 prompts x 48 tokens: 768 positions, where MIN_AGREEMENT
    leaves room for 7 greedy tokens that differ."""
    reference = LLM(quantization="none", max_model_len=256)
    return Reference(reference, word_prompts(reference.get_tokenizer(), 16), 48)


INT8_KERNELS = getattr(quant_kernels(), "has_int8_activations", False)


@pytest.mark.parametrize("activations, atol", [
    ("none", 1e-4),
    pytest.param("int8", 0.1, marks=pytest.mark.skipif(not INT8_KERNELS, reason="no AVX2 or VNNI"))])
def test_blocks_split_over_two_ranks_match_one(mixed_gguf, activations, atol):
    """Tensor parallelism over GGUF blocks: q/k/v and gate/up split by rows, o and down by columns
    at block boundaries, the ranks' partial sums all-reduced: one rank's tokens, and logprobs up
    to the order of that sum. With int8 activations (every step within the kernel's 16 rows) each
    rank rounds its own 32-value blocks of x as one rank would, so the ranks must all get the
    option (rank 0 without it: logprobs 0.46 off). What is left: a value that the all-reduce's
    summation order moves across a rounding boundary takes the neighbouring int8 code, by luck of
    where the values fall: with Q8_0 in its tiles 0.055 on these prompts, 2.5e-3 and below 5e-6 on
    three other sets (0.009 with Q8_0 in blocks)."""
    prompts = [[(7 * i + 3 * j) % 49000 + 10 for j in range(5 + i)] for i in range(3)]
    options = dict(num_kv_blocks=64, block_size=8, activation_quantization=activations, max_num_batched_tokens=16)
    reference = Reference(LLM(str(mixed_gguf), **options), prompts, 12)
    with LLM(str(mixed_gguf), tensor_parallel_size=2, **options) as two:
        agreement, worst = reference.compare(two)
    assert agreement == 1.0 and worst <= atol


def test_bundled_q4_1_model_matches_its_dequantized_self(bundled_reference):
    """16 prompts x 48 tokens on the bundled SmolLM2 (Q4_1 matrices, a Q8_0 embedding and tied head)."""
    quantized = LLM(quantization="auto", activation_quantization="none", max_model_len=256, **FEW_ROWS)
    agreement, worst = bundled_reference.compare(quantized)
    assert agreement >= MIN_AGREEMENT
    assert 0 < worst <= LOGPROB_ATOL


@pytest.mark.skipif(not INT8_KERNELS, reason="no AVX2 or VNNI")
# int8x2 is the default mode (fast suite); int8, chosen only by name, runs with the slow sweeps.
@pytest.mark.parametrize("mode, min_agreement, atol", [
    ("int8x2", MIN_AGREEMENT, INT8X2_LOGPROB_ATOL),
    pytest.param("int8", INT8_MIN_AGREEMENT, INT8_LOGPROB_ATOL, marks=pytest.mark.slow)])
def test_bundled_model_with_int8_activations_against_its_dequantized_self(bundled_reference, mode, min_agreement,
                                                                          atol, monkeypatch):
    """The integer kernel in every product (its row bound raised to the steps' 16 rows here)."""
    monkeypatch.setitem(INT8_MAX_ROWS, mode, 16)
    quantized = LLM(max_model_len=256, activation_quantization=mode, max_num_batched_tokens=16, max_num_seqs=16)
    agreement, worst = bundled_reference.compare(quantized)
    assert agreement >= min_agreement
    assert LOGPROB_ATOL < worst <= atol  # the rounding is there to see, and bounded


@pytest.mark.slow  # mode int8 is chosen only by name
@pytest.mark.skipif(not (INT8_KERNELS and BF16_TILES), reason="no integer kernels and AVX-512 BF16")
def test_int8_mode_large_batches_in_bfloat16_tiles_against_the_dequantized_model(bundled_reference):
    """Mode int8 past its integer kernel's 16 rows: the teacher-forced prefills here (up to 59 rows a
    product) round the activations to bfloat16 and multiply bfloat16 tiles of the weights. Measured:
    99.87% greedy agreement, logprobs within 0.18."""
    quantized = LLM(max_model_len=256, activation_quantization="int8")
    agreement, worst = bundled_reference.compare(quantized)
    assert agreement >= MIN_AGREEMENT  # measured 99.87%: bfloat16 keeps more of x than one int8 code
    assert LOGPROB_ATOL < worst <= INT8_LOGPROB_ATOL


def test_int8_activations_are_refused_where_they_cannot_run(tmp_path):
    model_dir = build("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="activation_quantization 'int8' rounds the activations of a GGUF model's "
                                         "quantized products; this model's weights are 'dense'"):
        LLM(str(model_dir), num_kv_blocks=8, activation_quantization="int8")
    with pytest.raises(ValueError, match="activation_quantization 'int8x2' and batch_invariant exclude each other"):
        LLM(num_kv_blocks=8, activation_quantization="int8x2", batch_invariant=True)
    with pytest.raises(ValueError, match="activation_quantization 'int8' rounds .* weights are 'int8'"):
        LLM(str(model_dir), num_kv_blocks=8, quantization="int8", activation_quantization="int8")
    with pytest.raises(ValueError, match="activation_quantization must be one of"):
        LLM(num_kv_blocks=8, activation_quantization="int4")


def test_no_dense_copy_of_a_quantized_weight_and_the_files_bytes():
    llm = LLM(quantization="auto", num_kv_blocks=16)
    model = llm.engine.runner.model
    dense = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.is_floating_point() and p.dim() > 1]
    assert dense == []  # every matrix of the bundled file is Q4_1 or Q8_0: none may exist widened
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(default_model_path()).tensors)
    weights = llm.engine.memory_report()[0]["weight_bytes"]
    assert weights <= 1.1 * file_bytes
    dequantized = LLM(quantization="none", num_kv_blocks=16).engine.memory_report()[0]["weight_bytes"]
    assert dequantized > 4 * weights


def test_types_without_a_kernel_are_dequantized_with_one_warning(mixed_gguf, tmp_path, caplog):
    q5 = requantize(mixed_gguf, tmp_path / "q5.gguf", lambda name: T.Q5_0 if "ffn_down" in name else None)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(q5), num_kv_blocks=32, block_size=8)
    warnings = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert len(warnings) == 1 and "Q5_0" in warnings[0]
    down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert down.segment_types == [None] and down.segments[0].dtype == torch.float32
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.skipif(not INT8_KERNELS, reason="no AVX2 or VNNI")
def test_auto_activations_take_int8x2_on_gguf_blocks_and_say_so_once(tmp_path, caplog):
    """The default: a GGUF file's products take two int8 codes where the kernels have them (the
    start-up log names the mode and the way back); batch_invariant and dense weights keep float32."""
    with caplog.at_level(logging.INFO, logger="pagellm.engine"):
        llm = LLM(max_model_len=64, num_kv_blocks=8)
    assert llm.engine.activation_quantization == "int8x2"
    assert llm.engine.runner.model.layers[0].mlp.down_proj.method.activations == "int8x2"
    lines = [r.getMessage() for r in caplog.records if "activation_quantization auto" in r.getMessage()]
    assert len(lines) == 1 and "-> int8x2" in lines[0] and "--activation-quantization none" in lines[0]
    llm.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagellm.engine"):
        LLM(max_model_len=64, num_kv_blocks=8, activation_quantization="none").shutdown()
    assert "loading" in caplog.text and "activation_quantization auto" not in caplog.text
    invariant = LLM(max_model_len=64, num_kv_blocks=8, batch_invariant=True)
    assert invariant.engine.activation_quantization == "none"
    invariant.shutdown()
    dense = LLM(str(build("llama", tmp_path / "llama")), num_kv_blocks=8)
    assert dense.engine.activation_quantization == "none"
