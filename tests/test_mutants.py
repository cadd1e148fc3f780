"""The exactness and sharing tests must be able to fail: each known mutant (a deliberately
broken engine) is applied to a copy of the source, and the tests named for it must fail there.

A mutant is a one-place edit that reproduces a real class of bug: positions restarting
at every prefill chunk, RoPE clamped, a bias not loaded, copy-on-write skipped, a prefix
cache hit one block off, the wrong preemption victim. If a mutant survives, the tests
named for it cannot see that bug any more.

`python tests/test_mutants.py` prints the table (mutant -> tests that failed); the suite
runs it as one slow test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str          # file in the repository
    old: str           # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail with the mutant in place
    # A mutant of the compiled kernels' source: its copy builds them (about a minute and a half)
    # instead of running the torch path, which would never reach the edit.
    compiled: bool = False
    # A CPU flag (as /proc/cpuinfo names it) without which the edited code never runs: skipped there.
    cpu_flag: str = ""
    # The -march its copy builds the kernels for (PAGELLM_CPU_MARCH), where the edited code is one
    # instruction set's: x86-64-v3 reaches the AVX2 kernels on AVX-512 machines too.
    march: str = ""


MUTANTS = [
    Mutant("a step's time kept by its rows when a prompt's chunk ran in it too",
           "pagellm/core/scheduler.py",
           "s.samples and s.num_sequence_tokens == 1 and s.start >= s.request.num_prompt_tokens",
           "s.samples",
           ("tests/engine/test_spec_decode.py::test_decode_steps_are_timed_by_their_rows",)),
    Mutant("positions restart at 0 for every prefill chunk after the first",
           "pagellm/worker/model_runner.py",
           "positions.extend(range(start, end))",
           "positions.extend(range(n) if start > 0 and n > 1 else range(start, end))",
           ("tests/engine/test_hf_equivalence.py::test_chunked_prefill",
            "tests/engine/test_sharing.py::test_prefix_caching_matches_transformers")),
    Mutant("a verification's tokens in the fused attention call see all of their sequence's keys, later tokens' too",
           "pagellm/attention/torch_backend.py",
           "            token_seq, lens = meta.query_token_keys()",
           "            token_seq = meta.query_token_keys()[0]\n            lens = meta.seq_lens_tensor[token_seq]",
           ("tests/attention/test_torch_backend.py::test_decode_from_qkv_is_the_split_path[verify-plain-f32]",)),
    Mutant("RoPE clamped at position 8",
           "pagellm/layers/rotary.py",
           "tables = (self.cos[positions].to(dtype), self.sin[positions].to(dtype))",
           "positions = positions.clamp(max=8)\n        tables = (self.cos[positions].to(dtype), self.sin[positions].to(dtype))",
           ("tests/engine/test_hf_equivalence.py::test_batched_matches_transformers",)),
    Mutant("k_proj bias not loaded (left zero)",
           "pagellm/models/base.py",
           "            loader = getattr(param, \"weight_loader\", None)",
           "            loader = getattr(param, \"weight_loader\", None)\n"
           "            if ckpt_name.endswith('k_proj.bias'):\n                tensor = torch.zeros_like(tensor)",
           ("tests/engine/test_hf_equivalence.py::test_batched_matches_transformers[qwen2]",)),
    Mutant("a decode plan attends through KV group 0's block tables on every layer",
           "pagellm/layers/decode_plan.py",
           "group = meta.for_group(self.kv_group)",
           "group = meta",
           ("tests/models/test_decode_plan.py::test_llama_shaped_families_decode_the_same_bits_with_plans[qwen3-options1]",
            "tests/models/test_families.py::test_batched_matches_transformers[qwen3]")),
    Mutant("copy-on-write copies skipped",
           "pagellm/worker/model_runner.py",
           "        if inputs.block_copies:\n            self.copy_blocks(inputs.block_copies)",
           "        if False:\n            self.copy_blocks(inputs.block_copies)",
           ("tests/engine/test_sharing.py::test_parallel_samples_equal_their_solo_runs",)),
    Mutant("a prefix cache hit claims one block more than it found",
           "pagellm/core/kv/coordinator.py",
           "        computed = min(k * bs, n - 1)\n        blocks = []",
           "        computed = min((k + 1) * bs, n - 1)\n        blocks = []",
           ("tests/engine/test_sharing.py::test_prefix_caching_matches_transformers",)),
    Mutant("a fork's recurrent state blocks written in place, not copied first",
           "pagellm/core/kv/coordinator.py",
           "shared += [(g, i) for i, b in enumerate(tables[g]) if ref[b] + (b in extra) > 1]",
           "shared += []",
           ("tests/core/test_hybrid_kv.py::test_a_fork_copies_the_state_before_either_sequence_writes_it",)),
    Mutant("a new sequence starts from the state its blocks last held",
           "pagellm/layers/recurrent.py",
           "        rows.index_fill_(0, meta.fresh_states, 0)",
           "        pass",
           ("tests/layers/test_recurrent_state.py::"
            "test_cached_forward_carries_state_across_steps_and_restarts_fresh_sequences",)),
    Mutant("a GGUF file's delta-rule out_proj multiplied as if its value heads were grouped, not tiled",
           "pagellm/layers/gated_delta_net.py",
           "        if self.tiled:  # [t, key heads",
           "        if False:  # [t, key heads",
           ("tests/layers/test_gated_delta_net.py::test_out_proj_kept_in_a_gguf_files_blocks_and_tiled_order",)),
    Mutant("the delta rule's chunked form leaves beta out of its triangular system",
           "pagellm/layers/gated_delta_net.py",
           "    system = torch.mul(decay, (k @ k_t).unsqueeze(2)).mul_(beta.view(*per_key, 1))",
           "    system = torch.mul(decay, (k @ k_t).unsqueeze(2))",
           ("tests/layers/test_delta_rule.py::test_a_sequence_in_pieces_carries_the_state_as_a_whole_one",)),
    Mutant("a prefix hit resumes without restoring the state checkpoint",
           "pagellm/core/kv/coordinator.py",
           "                self.pending_copies.extend(zip(computed_blocks[g], tables[g]))",
           "                pass",
           ("tests/core/test_hybrid_kv.py::test_a_prefix_resumes_from_the_state_checkpoint_at_its_end",
            "tests/models/test_families.py::test_chunked_preempted_cached_and_shared[qwen3_5]")),
    Mutant("the oldest running request is preempted instead of the newest",
           "pagellm/core/scheduler.py",
           "victim = self.running.pop()",
           "victim = self.running.pop(0)",
           ("tests/core/test_scheduler.py::test_preemption_takes_the_most_recently_admitted",)),
    Mutant("speculative decoding counts the token after the accepted proposals as computed",
           "pagellm/core/scheduler.py",
           "req.num_computed_tokens += min(accepted, appended)",
           "req.num_computed_tokens += appended",
           ("tests/core/test_spec_decode_kv.py::test_rejected_proposals_give_their_blocks_back",)),
    Mutant("the proposals' K/V computed in the wrong order (a rollback would keep wrong K/V)",
           "pagellm/core/scheduler.py",
           "req.token_slice(s.start, end) + s.draft_token_ids,",
           "req.token_slice(s.start, end) + s.draft_token_ids[::-1],",
           ("tests/engine/test_spec_decode.py::test_greedy_equals_plain_decoding",)),
    Mutant("each verified position samples with the first one's history (penalties, seeded uniform)",
           "pagellm/worker/rejection_sampler.py",
           "output_token_ids=output + list(draft_token_ids[:j])",
           "output_token_ids=output",
           ("tests/engine/test_spec_decode.py::test_seeded_sampling_and_logits_processors_equal_plain_decoding",)),
    Mutant("the Triton latent prefill lets each query see the row after its own",
           "pagellm/attention/triton_latent.py",
           "keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])",
           "keep = valid[None, :] & (pos[None, :] <= q_pos[:, None] + 1)",
           ("tests/attention/test_triton_latent.py::test_mixed_batch_matches_reference",
            "tests/attention/test_triton_latent.py::test_prefill_tiles_of_several_tokens_and_long_decodes")),
    Mutant("a draft rejected by rejection sampling is replaced by a draw from p, not from the residual max(0, p - q)",
           "pagellm/worker/rejection_sampler.py",
           "residual = (p[accepted] - q[accepted]).clamp_(min=0.0)",
           "residual = p[accepted].clone()",
           ("tests/worker/test_rejection_sampler.py::"
            "test_rejection_sampling_with_a_real_draft_distribution_keeps_the_target_distribution",)),
    Mutant("a finished sequence's draft-model KV blocks are never given back",
           "pagellm/worker/proposers/draft_model.py",
           "                self.kv.free(seq)",
           "                pass",
           ("tests/engine/test_spec_decode_draft.py::test_greedy_with_a_draft_model_equals_plain_decoding",)),
    Mutant("a cross-encoder's score head reads the trailing padding token, not the last real one",
           "pagellm/loader/score_head.py",
           "        while len(ids) > 1 and ids[-1] == self.pad_token_id:",
           "        while False:",
           ("tests/engine/test_cross_encoder.py::test_scores_match_sentence_transformers_cross_encoder",)),
    Mutant("the MTP layer concatenates the hidden state before the embedding",
           "pagellm/models/mtp.py",
           "torch.cat([self.enorm(embedded), self.hnorm(previous_hidden.to(embedded.dtype))], dim=-1)",
           "torch.cat([self.hnorm(previous_hidden.to(embedded.dtype)), self.enorm(embedded)], dim=-1)",
           ("tests/engine/test_spec_decode_mtp.py::test_mtp_layer_forward_equals_the_reference_in_chunks",
            "tests/engine/test_spec_decode_mtp_qwen3_5.py::test_mtp_layer_forward_equals_the_reference_in_chunks")),
    Mutant("an MTP layer's hidden-state norm applies its weight as w, not as the family's 1 + w (Qwen3.5)",
           "pagellm/models/mtp.py",
           "self.hnorm = RMSNorm(hidden, eps, unit_offset=self.unit_offset_norms)",
           "self.hnorm = RMSNorm(hidden, eps)",
           ("tests/engine/test_spec_decode_mtp_qwen3_5.py::test_mtp_layer_forward_equals_the_reference_in_chunks",)),
    Mutant("Qwen3.5's MTP layer hands a chain its output before the final norm",
           "pagellm/models/qwen3_5.py",
           "    normed_output = True",
           "    normed_output = False",
           ("tests/engine/test_spec_decode_mtp_qwen3_5.py::test_mtp_layer_forward_equals_the_reference_in_chunks",
            "tests/engine/test_spec_decode_mtp_qwen3_5.py::"
            "test_first_proposals_are_the_reference_chain_from_the_targets_hidden_states")),
    Mutant("the MTP layer pairs a position's hidden state with that position's token, not the next one",
           "pagellm/worker/proposers/mtp.py",
           "return _Read(state, state.known[state.valid + 1:state.valid + 1 + n], rows)",
           "return _Read(state, state.known[state.valid:state.valid + n], rows)",
           ("tests/engine/test_spec_decode_mtp.py::"
            "test_first_proposal_is_the_reference_prediction_from_the_targets_hidden_states",)),
    Mutant("a finished sequence's MTP-layer KV blocks are never given back",
           "pagellm/worker/proposers/mtp.py",
           "                self.kv.free(state.entries)",
           "                pass",
           ("tests/engine/test_spec_decode_mtp.py::test_greedy_with_mtp_equals_plain_decoding",)),
    Mutant("every round of the spec-decode bench repeats the first round's prompt (a peer keeping n-grams "
           "across requests would find its own earlier output)",
           "pagellm/bench/spec_decode.py",
           "                prompt = prompts[workload][i]",
           "                prompt = prompts[workload][0]",
           ("tests/bench/test_spec_decode_bench.py::test_spec_decode_bench_tiny",)),
    Mutant("the spec-decode bench's summary documents keep their pages' code blocks and tables (not prose to quote)",
           "pagellm/bench/spec_decode.py",
           "        if fenced or s.startswith(\"|\"):",
           "        if False:",
           ("tests/bench/test_spec_decode_bench.py::test_the_document_is_the_pages_prose",)),
    Mutant("a recurrent layer's state keeps the rejected proposals' updates (no roll-back after a verification)",
           "pagellm/layers/recurrent.py",
           "            if states is not None and n < states.shape[0]:",
           "            if False:",
           ("tests/engine/test_spec_decode.py::test_greedy_equals_plain_decoding",)),
    Mutant("the widened Q4_1 products (decode steps of many streams, prefills) subtract the blocks' minimum",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "mins[bl * 8 + r] = -b.m;",
           "mins[bl * 8 + r] = b.m;",
           ("tests/kernels/test_quant_ops.py::"
            "test_repacked_prefill_products_are_the_rounded_activations_exact_product[Q4_1]",), compiled=True),
    Mutant("the repacked Q4_1 kernel multiplies a unit's high nibbles by x's values 8p.. (they are 16 + 8p..)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "x = xi_bcast64(a[r].codes + at + 16);",
           "x = xi_bcast64(a[r].codes + at);",
           ("tests/kernels/test_quant_ops.py::test_repacked_k_quants_multiply_as_their_blocks[Q4_1]",),
           compiled=True),
    Mutant("the repacked Q5_K kernel joins the high nibbles' fifth bits to the low nibbles and back",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "lo = xi_or(lo, bit_at_4(qh, 2 * q)), hi = xi_or(hi, bit_at_4(qh, 2 * q + 1));",
           "lo = xi_or(lo, bit_at_4(qh, 2 * q + 1)), hi = xi_or(hi, bit_at_4(qh, 2 * q));",
           ("tests/kernels/test_quant_ops.py::test_repacked_k_quants_multiply_as_their_blocks[Q5_K]",),
           compiled=True),
    Mutant("the repacked Q5_K kernel lets a lane sum 16 products of 5-bit codes before the 16-bit scale step",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "constexpr int kRun = kFive && !kPairs16 ? 2 : 4;",
           "constexpr int kRun = 4;",
           ("tests/kernels/test_quant_ops.py::test_repacked_q5_k_at_its_largest_codes_sums_without_overflow",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("the repacked Q5_K kernel joins its two codes' super-block sums as 128 first + residual in int32",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "        if constexpr (kFive && kTwo) {",
           "        if constexpr (false) {",
           ("tests/kernels/test_quant_ops.py::test_repacked_q5_k_at_its_largest_codes_sums_without_overflow",),
           compiled=True),
    Mutant("Q6_K's products of 2-5 rows round x per 256 values (one row alone: per 32)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "return qtype == Q6_K || qtype == Q4_K || qtype == Q5_K ? 6 : 0;",
           "return qtype == Q6_K ? 2 : qtype == Q4_K || qtype == Q5_K ? 6 : 0;",
           ("tests/kernels/test_quant_ops.py::test_a_row_gets_the_same_bits_with_up_to_4_rows_beside_it[Q6_K]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("AMX products join Q6_K's two parts of W as 32 hi + lo (they are 64 hi + lo)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "constexpr int kShift = T == Q4_K ? 3 : 6;",
           "constexpr int kShift = T == Q4_K ? 3 : 5;",
           ("tests/kernels/test_quant_ops.py::"
            "test_repacked_prefill_products_are_the_rounded_activations_exact_product[Q6_K-amx]",), compiled=True,
           cpu_flag="amx_int8"),
    Mutant("the fused Gated DeltaNet decode step keeps a state span cut by a block boundary in its scratch copy "
           "(the pool's blocks keep the old state)",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "    pieces(false);",
           "    (void)pieces;",
           ("tests/layers/test_gdn_decode_kernel.py::test_decode_steps_equal_the_torch_path",), compiled=True),
    Mutant("a float16 KV cache stores values past its range as infinities",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "dst[j] = static_cast<C>(std::min(kF16Max, std::max(-kF16Max, xp[t * row + j])));",
           "dst[j] = static_cast<C>(xp[t * row + j]);",
           ("tests/kernels/test_cpu_ops.py::test_store_kv_into_a_float_cache_is_index_copy",), compiled=True),
    Mutant("a verification group's widened 8-bit K rows lose their scales (AVX2)",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "for (int64_t t = 0; t < n; ++t) sh[t] *= wide_scales[t * KVH + h];",
           "(void)sh;",
           ("tests/kernels/test_cpu_ops.py::test_paged_attention_groups_a_sequences_query_tokens_as_each_token_alone",),
           compiled=True, march="x86-64-v3"),
    Mutant("a verification group's widened rows are the block's first token's for every token (AVX2)",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "      float* to = wide + (t * KVH + h) * DT;",
           "      float* to = wide + h * DT;",
           ("tests/kernels/test_cpu_ops.py::test_paged_attention_groups_a_sequences_query_tokens_as_each_token_alone",),
           compiled=True, march="x86-64-v3"),
    Mutant("a float16 KV cache read as if it were bfloat16",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "    return paged_attention_impl<F16>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk, softcap,",
           "    return paged_attention_impl<uint16_t>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk, softcap,",
           ("tests/kernels/test_cpu_ops.py::test_paged_attention_reads_a_16_bit_cache_as_float32",), compiled=True),
    Mutant("the attention lanes kernel lets every token of a verification group read the group's longest context "
           "(a proposal sees the keys after it)",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "lane_lens[i] = static_cast<int32_t>(lens[i / G]);",
           "lane_lens[i] = static_cast<int32_t>(lens[w.nq - 1]);",
           ("tests/kernels/test_cpu_ops.py::test_attention_lanes_kernel_is_attend_run_in_another_order",),
           compiled=True, cpu_flag="avx512f"),
    Mutant("a verification masks every position with the grammar's mask for its first (not the state after "
           "the proposals before it)",
           "pagellm/worker/rejection_sampler.py",
           "token_bitmask=None if masks is None else masks[j])",
           "token_bitmask=None if masks is None else masks[0])",
           ("tests/engine/test_spec_decode.py::test_structured_outputs_speculate_and_decode_as_without",)),
    Mutant("a structured output stops at the first token a step appends once its grammar has ended anywhere in "
           "that step (cutting a verification's accepted run short)",
           "pagellm/core/request.py",
           "self.grammar.end is not None and n_out >= self.grammar.end:",
           "self.grammar.end is not None:",
           ("tests/engine/test_spec_decode.py::test_structured_outputs_speculate_and_decode_as_without",)),
    Mutant("a recurrent draft model keeps the state its rejected drafts left (no roll-back between proposals)",
           "pagellm/worker/proposers/draft_model.py",
           "                self.runner.write_states(self.kv.group_tables(query.request_id), seq.states[common])",
           "                pass",
           ("tests/engine/test_spec_decode_draft.py::test_a_recurrent_draft_rolls_back_to_the_accepted_drafts",)),
    Mutant("under tensor parallelism only rank 0 rolls its recurrent states back after a verification",
           "pagellm/worker/model_runner.py",
           "            if self.mirror_call is None:\n                self.roll_back_verified(tokens_kept)",
           "            if True:\n                self.roll_back_verified(tokens_kept)",
           ("tests/engine/test_spec_decode.py::test_recurrent_models_roll_back_on_every_tensor_parallel_rank",)),
    Mutant("the attention kernel is chosen by a run's query tokens times its group (a token verified among "
           "others is summed in another order than decoded alone, and greedy speculation drifts)",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "fcap == 0.f && H / KVH >= lanes_from(D)) {",
           "fcap == 0.f && w.nq * (H / KVH) >= lanes_from(D)) {",
           ("tests/kernels/test_cpu_ops.py::test_attention_lanes_kernel_is_attend_run_in_another_order",),
           compiled=True, cpu_flag="avx512f"),
    Mutant("a one-token MoE step keeps only its last expert's output",
           "pagellm/layers/moe.py",
           "                out.add_(y)",
           "                out.copy_(y)",
           ("tests/models/test_gpt_oss.py::test_moe_block_of_one_token_equals_transformers",)),
    Mutant("AVX2's many-row Q4_K kernel adds the minimums' term to one lane's sum before the other's",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "_mm256_add_ps(_mm256_add_ps(acc[2 * m], acc[2 * m + 1]), mins[m])",
           "_mm256_add_ps(acc[2 * m], _mm256_add_ps(acc[2 * m + 1], mins[m]))",
           ("tests/kernels/test_quant_ops.py::test_repacked_and_block_rows_keep_their_bits_beside_many_rows[Q4_K]",),
           compiled=True, cpu_flag="avx2", march="x86-64-v3"),
    Mutant("repacked Q4_1's products of 9-16 rows leave its row loop for the AMX tiles or the widening",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "const bool q4_1_rows = x8 && (qtype == Q4_1 || qtype == Q8_0) && M <= kQ41RowLoopMax;",
           "const bool q4_1_rows = x8 && (qtype == Q4_1 || qtype == Q8_0) && M <= 8;",
           ("tests/kernels/test_quant_ops.py::test_repacked_q4_1_rows_keep_their_bits_beside_up_to_16_rows[Q4_1]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("repacked Q4_0's tile kernels take its blocks' d for m (Q4_0's tiles hold no m: m = -8 d)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "return x8 == kQ40Tiles ? _mm256_mul_ps(v, _mm256_set1_ps(-8.f)) : v;",
           "return x8 == kQ40Tiles ? _mm256_mul_ps(v, _mm256_set1_ps(-1.f)) : v;",
           ("tests/kernels/test_quant_ops.py::test_repacked_k_quants_multiply_as_their_blocks[Q4_0]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("a prompt's products widen Q4_0's tiles as Q4_1's (u and m = -8 d) instead of as its blocks (u - 8)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "const int64_t widened = x8 == kQ40Tiles ? Q4_0 : qtype;",
           "const int64_t widened = qtype;",
           ("tests/kernels/test_quant_ops.py::test_repacked_k_quants_multiply_as_their_blocks[Q4_0]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("repacked Q8_0's lanes take 127 times x's codes for the offset of u = w + 128",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "offsets[m * K / 16 + i / 32 * 2 + i / 4 % 2] -= 128 * v;",
           "offsets[m * K / 16 + i / 32 * 2 + i / 4 % 2] -= 127 * v;",
           ("tests/kernels/test_quant_ops.py::test_repacked_k_quants_multiply_as_their_blocks[Q8_0]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("AVX2's many-row Q4_1 kernel puts a pair of each row's high nibbles in the other lane's set",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "out[8 * set + 4 + j] = _mm256_srli_epi16(pairs[k], 4);",
           "out[8 * (1 - set) + 4 + j] = _mm256_srli_epi16(pairs[k], 4);",
           ("tests/kernels/test_quant_ops.py::test_repacked_q4_1_rows_keep_their_bits_beside_up_to_16_rows[Q4_1]",
            "tests/kernels/test_quant_ops.py::test_repacked_and_block_rows_keep_their_bits_beside_many_rows[Q4_1]"),
           compiled=True, cpu_flag="avx2", march="x86-64-v3"),
    Mutant("AVX2's many-row Q6_K kernel sums a lane's 16-value groups in their order (the tile kernel: "
           "0, 2, 4, 6, 1, 3, ...)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "kQ6GroupOrder[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};",
           "kQ6GroupOrder[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};",
           ("tests/kernels/test_quant_ops.py::test_repacked_and_block_rows_keep_their_bits_beside_many_rows[Q6_K]",),
           compiled=True, cpu_flag="avx2", march="x86-64-v3"),
    Mutant("VNNI's widened Q6_K kernel takes x's scale of a super-block's first 32 values for all 256",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "const float dx = kPer32 ? a[r].scale[at / 32] : kTwo ? a[r].scale[b] / 128.f : a[r].scale[b];",
           "const float dx = kPer32 ? a[r].scale[at / 256 * 8] : kTwo ? a[r].scale[b] / 128.f : a[r].scale[b];",
           ("tests/kernels/test_quant_ops.py::test_repacked_k_quants_multiply_as_their_blocks[Q6_K]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("VNNI's widened Q8_0 tiles take their stored codes as they are (u, not u - 128)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "const XI bias = _mm512_set1_epi16(128), pairs0 = word_pairs(0), pairs1 = word_pairs(1);",
           "const XI bias = _mm512_set1_epi16(0), pairs0 = word_pairs(0), pairs1 = word_pairs(1);",
           ("tests/kernels/test_quant_ops.py::test_repacked_q4_1_rows_keep_their_bits_beside_up_to_16_rows[Q8_0]",),
           compiled=True, cpu_flag="avx512_vnni"),
    Mutant("a product's threads stop claiming before a short last chunk (its rows of W never multiplied)",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "for (int64_t c0 = next.fetch_add(chunk); c0 < n; c0 = next.fetch_add(chunk))",
           "for (int64_t c0 = next.fetch_add(chunk); c0 + chunk <= n; c0 = next.fetch_add(chunk))",
           ("tests/kernels/test_quant_ops.py::"
            "test_a_large_repacked_product_claimed_in_chunks_is_its_one_thread_product[Q4_K]",), compiled=True,
           cpu_flag="avx2"),
    Mutant("the attention's threads each claim one run of keys and stop (a long context's later runs unread)",
           "pagellm/kernels/csrc/cpu_ops.cpp",
           "for (int64_t i = next_item.fetch_add(1); i < n_items; i = next_item.fetch_add(1)) {",
           "for (int64_t i = next_item.fetch_add(1); i < n_items; i = n_items) {",
           ("tests/kernels/test_cpu_ops.py::test_paged_attention_against_float64_on_long_contexts_and_nan",),
           compiled=True),
    Mutant("AVX2's Q8_0 kernel multiplies a block's second 16 codes by x's first 16",
           "pagellm/kernels/csrc/quant_ops.cpp",
           "_mm256_madd_epi16(w.hi, x.hi)",
           "_mm256_madd_epi16(w.hi, x.lo)",
           ("tests/kernels/test_quant_ops.py::"
            "test_int8_activation_products_are_the_rounded_activations_exact_product[Q8_0-K128-int8x2]",),
           compiled=True, cpu_flag="avx2", march="x86-64-v3"),
]

# Imported first by every Python started in the copy: the package installed in editable mode
# is found through a meta-path finder that would win over the copy on sys.path.
_SITECUSTOMIZE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
"""


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for rel in files:
        # docs/: the spec-decode bench's summary workload reads its pages.
        if rel.startswith(("pagellm/", "tests/", "docs/")) or rel in ("pyproject.toml",):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / rel).is_file():
                shutil.copy2(ROOT / rel, dst / rel)


def edit_is_there(m: Mutant, root: Path = ROOT) -> bool:
    """Whether the code `m` edits appears exactly once in its file under `root`."""
    return (root / m.path).read_text().count(m.old) == 1


def run_mutant(m: Mutant, workdir: Path) -> dict[str, bool]:
    """Apply `m` in a fresh copy and run its tests; returns test id -> failed."""
    copy = workdir / m.name.replace(" ", "_")[:40]
    _copy_tree(copy)
    target = copy / m.path
    assert edit_is_there(m, copy), f"mutant {m.name!r}: the code it edits has changed ({m.path})"
    target.write_text(target.read_text().replace(m.old, m.new))
    site = copy / "_mutant_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    # The torch path instead of the compiled CPU kernels: a copy at a new path would rebuild them
    # (30 s a mutant), and every mutant here edits Python code that both paths run through.
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{copy}", "PYTHONDONTWRITEBYTECODE": "1",
           "PAGELLM_CPU_KERNELS": "1" if m.compiled else "0", **({"PAGELLM_CPU_MARCH": m.march} if m.march else {})}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *m.tests],
                       cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode not in (0, 1):  # 2+: the tests could not even run (a bad mutant or test id)
        raise RuntimeError(f"{m.name}: pytest exited {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
    failures = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("FAILED ")]
    # A test counts as failed when it, or any of its parametrized cases, failed.
    return {t: any(f == t or f.startswith(t + "[") for f in failures) for t in m.tests}


def test_every_mutant_edits_code_that_is_there():
    """Each mutant's edit appears exactly once in its file: in the fast suite, so that a change to the
    code a mutant edits is seen when it lands, not at the next slow run (a rewritten Q4_1 widening left
    one mutant pointing at a line that no longer existed)."""
    stale = [m.name for m in MUTANTS if not edit_is_there(m)]
    assert not stale, f"mutants whose edit is no longer in their file (or not once): {stale}"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_caught(mutant, tmp_path):
    if mutant.cpu_flag and mutant.cpu_flag not in _cpu_flags():
        pytest.skip(f"this CPU lacks {mutant.cpu_flag}: the edited code never runs here")
    failed = run_mutant(mutant, tmp_path)
    survived = [t for t, f in failed.items() if not f]
    assert not survived, f"mutant {mutant.name!r} passes {survived}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print("| mutant | tests that fail |\n| --- | --- |")
        for m in MUTANTS:
            result = run_mutant(m, Path(d))
            caught = ", ".join(f"`{t.split('::')[1]}`" for t, f in result.items() if f) or "**none: survives**"
            print(f"| {m.name} | {caught} |")
