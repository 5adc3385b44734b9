"""The harness's power, measured: plant each catalogued bug in a copy of the tree and run the CI selection.

Each mutant is a realistic bug written as one edit anchored in the code, not in its text:
`Mutant(name, "path::Qual.name", old, new, bug)` names the file and the function, method or class the bug lives in
(`path::<module>` for module-level code), and `old` is a pattern inside it, matched with whitespace and comments
ignored and found there exactly once (the function's span comes from `ast`). A pattern that starts with
indentation replaces from the start of its line and `new` is re-indented to the code's indentation; one that ends
with a newline replaces through the end of its line. So a reformat (re-wrapped or re-indented statements, blank
lines, comments), a rename elsewhere, or a function moved to another file or its file moved (found once: "moved";
`--anchor` writes its new path) keeps a mutant valid; a renamed function or a rewritten pattern fails that mutant
alone, naming it and what is missing.

For each, the tracked and untracked-but-not-ignored files are copied to a temporary directory, the edit is applied
there, and the CI selection runs with `-x` (stop at the first failure), in two stages so that pinned examples run
first: the whole selection with Hypothesis kept to its `@example`s (more than 15 minutes on one shared core for a
mutant none of them kills), then, only for a mutant that survives those, the whole selection as CI runs it (random
draws too). In both, the order is: the test that killed this mutant last time (KILLS, written after every run), the
tests whose own code names what it changes (`named`), then the smoke tier (the `smoke` marker, conftest.py's SMOKE:
the tests that kill the most bugs soonest), then the rest; the order only says how soon a mutant dies, never
whether. `--smoke-only` runs the smoke tier's pinned examples alone. A mutant is killed when a test fails; it
survives when both stages pass. The table says which stage and test killed it and the seconds taken (both stages
together).

    python scripts/mutants.py                # every mutant, one at a time
    python scripts/mutants.py --list         # names, where each lives, and the bug each plants
    python scripts/mutants.py --only NAME,NAME -j 2
    python scripts/mutants.py --pinned-only  # the first stage only: is each bug killed by a pinned example?
    python scripts/mutants.py --smoke-only   # the smoke tier's pinned examples only: does the first minute kill it?
    python scripts/mutants.py --baseline     # first run the unmutated selection; tests failing there
                                             # are deselected (and listed), so they cannot "kill" a mutant
    python scripts/mutants.py --anchor       # rewrite this file: old-format entries anchored, moved paths updated

The old format, `Mutant(name, "path", old, new, bug)` with `old` an exact text of the file, is accepted by
`--anchor` only (and `anchor()`, its function): it finds the text, takes the innermost function holding it, drops
comments from the pattern (adding the lines before it where that function holds it more than once), checks that
the anchored mutant plants the byte-identical file, and rewrites the entry in place. Elsewhere an old-format
entry is refused by name.

Exit status: 0 when every mutant is killed; 1 when one survives, times out or crashes the run; 2 when a
mutant has lost its anchor (its function or its pattern is gone, the pattern is ambiguous there, the edit would
not compile, or the entry is in the old format); every such mutant is listed before anything runs.
"""
from __future__ import annotations

import argparse
import ast
import bisect
import inspect
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The CI selection: the files whose tests a catalogued bug can fail (conftest.py runs the smoke tier first
# whatever this order: the unit tests against outside oracles, every limit, the pool, the kernels, parity's
# pinned edges), then the rest in this order: the anchoring of this catalogue (on files of its own), the engine's
# contract, the server, tensor parallelism on gloo, and the README's Python blocks checked for names they never
# define (CI runs the blocks themselves: tests/test_readme.py).
SELECTION = [
    "tests/test_mutant_anchors.py",
    "tests/test_draws.py",   # the ci profile's costly properties: their @examples alone
    "tests/test_interpreter.py",   # Triton's interpreter sped up, computing what it computed before: a second
    "tests/test_config.py",
    "tests/test_sampling.py",
    "tests/test_checkpoints.py",
    "tests/test_reference_engine.py",
    "tests/test_reference_vs_hf.py",
    "tests/test_limits.py",
    "tests/test_limits_table.py",
    "tests/test_attention_backend.py",
    "tests/test_text.py",
    "tests/test_parity.py",
    "tests/test_page_pool.py",
    "tests/test_chunks.py",
    "tests/test_row_plan.py",
    "tests/test_blend_policy.py",
    "tests/test_blend.py",
    "tests/test_blend_reference.py",
    "tests/test_chunk_contexts.py",
    "tests/test_page_tables.py",
    "tests/test_scheduler.py",
    "tests/test_kernels_split.py",
    "tests/test_kernels.py",
    "tests/test_kernels_positions.py",
    "tests/test_kernels_fused.py",
    "tests/test_kernels_relocate.py",
    "tests/test_kernels_cascade.py",
    "tests/test_engine.py",
    "tests/test_engine_isolation.py",
    "tests/test_async_scheduling.py",
    "tests/test_cascade_engine.py",
    "tests/test_step_graphs.py",
    "tests/test_deterministic.py",
    "tests/test_bf16_cpu.py",
    "tests/test_serve.py",
    "tests/test_serve_chunks.py",
    "tests/test_serve_chat_chunks.py",
    "tests/test_serve_streaming.py",
    "tests/test_serve_driver.py",
    "tests/test_stop_strings.py",
    "tests/test_serve_process.py",
    "tests/test_bench_serving.py",
    "tests/test_tensor_parallel_lifecycle.py",
    "tests/test_tensor_parallel.py",   # tensor parallelism's config and ranks on gloo
    "tests/test_engine_core.py",   # the core's contract: ids only, prefix jobs, stats
    "tests/test_layers.py",
    "tests/test_engine_config.py",
    "tests/test_readme.py::test_python_block_uses_only_names_it_or_its_section_defines",   # cheap: no block runs
    "tests/test_bench_host.py",                                                # the benchmarks' CPU tier, seconds
    "tests/test_bench_blend_quality.py::test_a_known_paired_difference_gives_a_known_interval_side",   # the
    "tests/test_bench_blend_quality.py::test_a_two_hop_answer_needs_both_its_documents",      # quality bench's
    "tests/test_bench_blend_quality.py::test_batched_forcing_equals_the_reference_extend_per_prompt",   # parts
    "tests/test_cli.py",   # the command line's checks and its engines' comparison (tiny models)
    "tests/test_warm_up.py",   # pure checks of the warm-up's step lists
    "tests/test_xdist_groups.py",   # CI's loadgroup keeps a group on one worker: a pytest under -n 2, seconds
]
SMOKE_MARKER = "smoke"   # conftest.py runs these first in any selection
DEFAULT_TIMEOUT = 900   # seconds per mutant: more than the whole selection takes unmutated on 2 cores


@dataclass(frozen=True)
class Mutant:
    name: str
    where: str     # "path::Qual.name": the file (from the repository root) and the function, method or class the
                   # bug lives in, or "path::<module>" for module-level code
    old: str       # a pattern of code inside `where`, matched ignoring whitespace and comments, found exactly once
    new: str       # what replaces it, written at the pattern's indentation (re-indented to the code's)
    bug: str       # what the bug is, in the words of someone who might write it

    @property
    def path(self) -> str:
        return self.where.partition("::")[0]

    @property
    def function(self) -> str:
        return self.where.partition("::")[2]


MUTANTS = [
    # ---- positions, RoPE, the K/V cache layout ----------------------------------------------------------
    Mutant('chunk_local_positions', 'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           '        host = HostStep(ids=ids, positions=pos, slots=slots,',
           '        host = HostStep(ids=ids, positions=pos - np.where(n[owner] > 1, start[owner], 0), slots=slots,',
           'a prompt chunk is run at positions 0..n-1 instead of its global positions'),
    Mutant('decode_rope_position_off_by_one', 'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           '        host = HostStep(ids=ids, positions=pos, slots=slots,',
           '        host = HostStep(ids=ids, positions=pos + np.array([k == 1 and c >= s.num_prompt_tokens for s, k, _, c in entries], np.int64)[owner], slots=slots,',
           'a decode token is rotated at num_tokens instead of num_tokens - 1'),
    Mutant('k_stored_before_rope', 'chunkwise/kernels/rope_store.py::_rope_store_kernel',
           '    tl.store(k_cache_ptr + kv, y1, mask=is_k)\n    tl.store(k_cache_ptr + kv + HALF, y2, mask=is_k)\n',
           '    tl.store(k_cache_ptr + kv, cast(x1, dtype), mask=is_k)\n    tl.store(k_cache_ptr + kv + HALF, cast(x2, dtype), mask=is_k)\n',
           'the fused kernel stores K (normed) into the cache before RoPE is applied'),
    Mutant('rope_rotates_the_wrong_way', 'chunkwise/kernels/rope_store.py::_rope_store_kernel',
           '    y1 = cast(tl.where(is_v, x1, x1 * cos - x2 * sin), dtype)\n    y2 = cast(tl.where(is_v, x2, x2 * cos + x1 * sin), dtype)\n',
           '    y1 = cast(tl.where(is_v, x1, x1 * cos + x2 * sin), dtype)\n    y2 = cast(tl.where(is_v, x2, x2 * cos - x1 * sin), dtype)\n',
           'the fused RoPE kernel negates the wrong half (rotates by -theta)'),
    Mutant('k_norm_skipped', 'chunkwise/kernels/rope_store.py::_rope_store_kernel',
           '        x1 = tl.where(is_v, x1, weigh(',
           '        x1 = tl.where(is_v | ~is_q, x1, weigh(',
           'the fused q/k-norm + RoPE kernel normalises q only (the first half of each k head is left unnormed)'),
    Mutant('gemma_norm_without_plus_one', 'chunkwise/kernels/fused_norm.py::weigh',
           '        return cast(xn * (1.0 + w.to(tl.float32)), OUT_DTYPE)\n',
           '        return cast(xn * w.to(tl.float32), OUT_DTYPE)\n',
           "the fused RMSNorm kernel forgets Gemma's (1 + w)"),
    Mutant('slot_off_by_one_at_page_starts', 'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           '        slots = self.tables.host[rows[owner], pos // self.page_size]',
           '        slots = self.tables.host[rows[owner], np.maximum(pos - 1, 0) // self.page_size]',
           'the first token of each page is written into the previous page'),
    Mutant("padding_rows_write_slot_0", "chunkwise/kernels/rope_store.py::_rope_store_kernel",
           "    slot = tl.load(slot_ptr + token, mask=token < num_tokens, other=-1)\n",
           "    slot = tl.maximum(tl.load(slot_ptr + token, mask=token < num_tokens, other=-1), 0)\n",
           "CUDA-graph padding rows (slot -1) are clamped to slot 0 and overwrite page 0"),
    # ---- attention kernels ------------------------------------------------------------------------------
    Mutant("chunk_skips_its_cached_prefix", "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           "    t_start = 0\n",
           "    t_start = (seq_len - q_len) // BLOCK_N\n",
           "a prompt chunk starts its KV loop at its own first tile, skipping the cached prefix before it"),
    Mutant("causal_mask_off_by_one", "chunkwise/kernels/attention_tile.py::attend_tiles",
           "mask = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]",
           "mask = (pos[None, :] < q_pos[:, None]) & pos_ok[None, :]",
           "a query does not see its own key"),
    Mutant("window_off_by_one", "chunkwise/kernels/attention_tile.py::attend_tiles",
           "mask = mask & (pos[None, :] > q_pos[:, None] - window)",
           "mask = mask & (pos[None, :] >= q_pos[:, None] - window)",
           "a sliding window keeps one key too many"),
    Mutant('accumulator_not_rescaled', 'chunkwise/kernels/attention_tile.py::attend_tiles',
           'acc = acc * alpha[:, None] + dot(',
           'acc = acc + dot(',
           'the online-softmax accumulator is not rescaled when a later KV tile raises the max'),
    Mutant("explicit_positions_attend_past_their_position",
           "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           "        q_pos = tl.load(positions_ptr + row_tok, mask=row_ok, other=0).to(tl.int32)\n",
           "        q_pos = tl.load(positions_ptr + row_tok, mask=row_ok, other=0).to(tl.int32) + 1\n",
           "a row placed by explicit positions attends one key past its own position (its window shifted by one)"),
    Mutant("prefill_split_reads_past_its_end", "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           "tl.minimum(t_end, (split + 1) * SPLIT_TILES)",
           "tl.minimum(t_end, (split + 2) * SPLIT_TILES)",
           "a split-context prefill program reads on into the next split's keys, which are then counted twice"),
    Mutant("prefill_split_arrivals_not_reset", "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           '                    tl.store(arrival, 0)\n',
           "",
           "a split-context launch leaves its arrival counts behind, so the next layer's merges never run"),
    Mutant("prefill_split_direct_write_past_one_split", "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           "            if last - first == 1:\n",
           "            if last - first <= 2:\n",
           "a block of two splits writes each split's own result as its output instead of merging them"),
    Mutant("prefill_tables_narrowed_past_the_last_page",
           "chunkwise/engine/model_runner.py::ModelRunner._prefill_tables",
           "        need = cdiv(int(seq_lens.max(initial=1)), self.page_size)\n",
           "        need = int(seq_lens.max(initial=1)) // self.page_size\n",
           "an eager step's prefill page tables are cut one page short of the longest sequence's last (partial) page"),
    Mutant("decode_tiles_take_64_keys", "chunkwise/kernels/paged_attention.py::tile_config",
           "        return block_m, 128, 8 if rows >= 128 else 4, stages\n",
           "        return block_m, 128 if rows >= 128 else 64, 8 if rows >= 128 else 4, stages\n",
           "deterministic decodes' 64-row tiles also take 64-key tiles: their online softmax rounds differently from "
           "the prefill's, so a token's bits depend on which computed it"),
    Mutant("three_stages_beyond_hopper_decode_tiles", "chunkwise/kernels/paged_attention.py::tile_config",
           "        stages = 3 if block_m == rows <= 128 and shared_memory >= HOPPER_SHARED_MEMORY else 2\n",
           "        stages = 3 if block_m <= 128 else 2\n",
           "the third pipeline stage, measured for Hopper's 64- and 128-row tiles, goes to GPUs with less shared "
           "memory too, where the tiles' buffers no longer fit"),
    Mutant("capped_tiles_third_stage_past_the_limit_only", "chunkwise/kernels/paged_attention.py::tile_config",
           "        stages = 3 if block_m == rows <= 128 and shared_memory >= HOPPER_SHARED_MEMORY else 2\n",
           "        stages = 3 if block_m == rows <= 128 and shared_memory > HOPPER_SHARED_MEMORY else 2\n",
           "a device with exactly Hopper's shared memory threshold keeps capped tiles on two stages"),
    Mutant("three_stages_for_256_row_tiles", "chunkwise/kernels/paged_attention.py::tile_config",
           "        stages = 3 if block_m == rows <= 128 and shared_memory >= HOPPER_SHARED_MEMORY else 2\n",
           "        stages = 3 if block_m <= 256 and shared_memory >= HOPPER_SHARED_MEMORY else 2\n",
           "the plain prefill's 256-row tiles take the third stage too, whose buffers overflow Hopper's shared memory"),
    Mutant("busy_decodes_stay_pipelined", "chunkwise/kernels/paged_attention.py::tile_config",
           "        if stages == 3 and busy:\n            stages = 1\n",
           "        if stages == 3 and busy:\n            stages = 2\n",
           "busy decode batches take two stages instead of one: the same two K and V buffers as three (144 KB), so "
           "one block an SM where one stage would fit two"),
    Mutant("paged_attention_grid_misses_kv_heads", "chunkwise/kernels/paged_attention.py::_launch",
           "    _paged_attention_kernel[(blocks * num_kv_heads, splits)](\n",
           "    _paged_attention_kernel[(blocks, splits)](\n",
           "the launch gives axis 0 one program a query block, as before the KV heads joined it: most (block, "
           "head) pairs are never computed"),
    Mutant("paged_decode_row_of_the_launch_order", "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           "        q_start = s\n        q_len = 1\n",
           "        q_start = tl.program_id(0) // num_kv_heads\n        q_len = 1\n",
           "paged_decode takes its query row by launch order, forgetting that the programs run the last sequence "
           "first: each sequence's keys meet another sequence's query"),
    Mutant("paged_decode_one_loop_skips_the_mask", "chunkwise/kernels/paged_attention.py::_fold",
           '            q, q_pos, m_i, l_i, acc, lo, hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,\n'
           '            kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,\n'
           '            HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, True, PAGES_PER_TILE, SUM_BY_DOT,\n'
           '        )\n',
           '            q, q_pos, m_i, l_i, acc, lo, hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,\n'
           '            kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,\n'
           '            HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, False, PAGES_PER_TILE, SUM_BY_DOT,\n'
           '        )\n',
           "paged_decode's one loop folds its tiles unmasked, as the middle of the three loops does: positions past "
           "the sequence (in its last tile) and outside its window are scored"),
    Mutant("deterministic_decodes_split_kv", "chunkwise/engine/model.py::Model._decode_attention",
           "        if self.deterministic:\n            paged_decode(",
           "        if False:\n            paged_decode(",
           "deterministic mode's decodes take split-KV, whose splits round a row differently from the prefill's one "
           "pass"),
    Mutant("matmul_wide_tile_below_a_warpgroup", "chunkwise/kernels/matmul.py::<module>",
           "WIDE_TILES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3))",
           "WIDE_TILES = ((128, 256, 64, 8, 3), (32, 128, 64, 2, 3))",
           "the deterministic matmul's second wide tile takes 32 rows and 2 warps, which Hopper runs as mma.sync, not "
           "the 64-row tiles' warpgroup MMA: a row's bits depend on the step's row count"),
    Mutant("matmul_wide_tiles_beyond_hopper", "chunkwise/kernels/matmul.py::matmul_config",
           "    if m >= 128 and capability(device)[0] == 9:",
           "    if m >= 128:",
           "the deterministic matmul's tiles grow with the rows on any GPU, though their bits were measured alike "
           "only on Hopper's warpgroup MMA"),
    Mutant("matmul_warm_up_scan_stops_short", "chunkwise/kernels/matmul.py::config_changes",
           "    for m in range(1, max_m + 1):\n",
           "    for m in range(1, max_m):\n",
           "the warm-up's scan of row counts stops one short of the step budget: a tile first taken at exactly the "
           "budget compiles inside a user's step"),
    Mutant("matmul_wide_from_129_rows", "chunkwise/kernels/matmul.py::matmul_config",
           "    if m >= 128 and capability(device)[0] == 9:",
           "    if m > 128 and capability(device)[0] == 9:",
           "the deterministic matmul's wide tiles start one row late: a step of exactly 128 rows keeps the decode "
           "tile"),
    Mutant("matmul_wide_tile_one_program_short", "chunkwise/kernels/matmul.py::matmul_config",
           "            if cdiv(m, tile[0]) * cdiv(n, tile[1]) >= sm_count(device):",
           "            if cdiv(m, tile[0]) * cdiv(n, tile[1]) > sm_count(device):",
           "a wide tile needs one program more than the SMs, not one each"),
    Mutant("busy_decodes_one_sequence_late", "chunkwise/kernels/paged_attention.py::paged_decode",
           "    busy = not sum_by_dot and num_seqs >= busy_decode_seqs(k_cache.shape[2], q.device)\n",
           "    busy = not sum_by_dot and num_seqs > busy_decode_seqs(k_cache.shape[2], q.device)\n",
           "a decode batch with programs for exactly two an SM stays pipelined, one block an SM"),
    Mutant("decode_tiles_own_key_tiles", "chunkwise/kernels/paged_attention.py::decode_tile_config",
           "    block_n = tile_config(head_dim, group, dtype, shared_memory)[1]\n    return max(16,",
           "    block_n = 64\n    return max(16,",
           "paged_decode's 16-row tiles take 64-key tiles where the prefill's take 128: a row folds other tiles, so "
           "its softmax rescales at other keys and its bits differ from the prefill's"),
    Mutant("decode_tiles_two_stages_on_hopper", "chunkwise/kernels/paged_attention.py::decode_tile_config",
           "block_n, 4, 3 if shared_memory >= HOPPER_SHARED_MEMORY else 2\n",
           "block_n, 4, 2\n",
           "deterministic decodes' 16-row tiles keep two stages on Hopper, where three were measured"),
    Mutant("paged_decode_sums_by_layout", "chunkwise/kernels/paged_attention.py::paged_decode",
           "                   layout[:-1] + (num_seqs,), None, None, None, sum_by_dot)",
           "                   layout[:-1] + (num_seqs,), None, None, None, False)",
           "paged_decode takes the 16-row tiles for sum_by_dot but sums its rows with tl.sum: other bits than "
           "paged_attention's rows summed by dot"),
    Mutant("fold_unmasked_tiles_sum_by_layout", "chunkwise/kernels/paged_attention.py::_fold",
           "PRECISION, False, PAGES_PER_TILE, SUM_BY_DOT,",
           "PRECISION, False, PAGES_PER_TILE, False,",
           "the one pass's unmasked middle loop sums its rows with tl.sum whatever sum_by_dot says: a prefill row's "
           "whole tiles round otherwise than a decode's one masked loop"),
    Mutant("deterministic_prefill_sums_by_layout", "chunkwise/engine/model.py::Model._attention",
           "                            sum_by_dot=self.deterministic)",
           "                            sum_by_dot=False)",
           "deterministic mode's prefill sums its rows with tl.sum while its decodes sum by dot: a token's K/V "
           "depend on whether prefill or decode computed it"),
    Mutant("interpreter_dot_splits_by_tile_height", "chunkwise/kernels/tiling.py::dot",
           "        c = tl.sum(a0[:, None, :] * b0[None, :, :], 2) + tl.sum(a1[:, None, :] * b1[None, :, :], 2)\n",
           "        if a.shape[0] * a.shape[1] * bt.shape[0] > 2 ** 20:\n"
           "            c = tl.sum(a0[:, None, :] * b0[None, :, :], 2) + tl.sum(a1[:, None, :] * b1[None, :, :], 2)\n"
           "        else:\n"
           "            c = tl.sum(a[:, None, :] * bt[None, :, :], 2)\n",
           "the interpreter's dot splits even and odd k only where the tile's own products pass Triton's cap: a "
           "128-row tile sums a row otherwise than a 16-row one, so the CPU suite would see the tile in a row's bits"),
    Mutant("costly_properties_draw_in_ci", "tests/draws.py::costly",
           '        if PROFILE == "ci":\n',
           '        if PROFILE == "thorough":\n',
           "CI's costly properties draw their profile's examples beside their @examples again: the suite's time "
           "outgrows CI's 15 minutes on 2 cores, with no recorded kill gained (the catalogue's kills run @examples)"),
    Mutant("costly_property_without_examples_runs_nothing_in_ci", "tests/draws.py::costly",
           "        if not explicit_examples(test):\n",
           "        if False:\n",
           "a costly property with no @example is accepted, so under the ci profile it runs no example at all "
           "and passes"),
    Mutant("interpreter_keeps_public_builtins_only", "chunkwise/kernels/interpreter.py::_keep_lookups",
           "            if tl.core.is_builtin(member):\n",
           "            if tl.core.is_builtin(member) and not name.startswith('_'):\n",
           "the builtins kept for the interpreter's patch leave out the private ones (`_reduce_with_indices`...), "
           "so a launch would run them with the compiler's semantics"),
    Mutant("interpreter_checks_integer_overflow", "chunkwise/kernels/interpreter.py::speed_up",
           "    _no_overflow_checks(interpreter)\n",
           "",
           "the interpreter computes Triton's integer-overflow checks, whose asserts it drops without debug as a "
           "compiled kernel does: every launch pays about a third more for nothing"),
    Mutant("interpreter_drops_overflow_checks_under_debug", "chunkwise/kernels/interpreter.py::_no_overflow_checks",
           'and not getattr(options, "debug", True)',
           'and True',
           "the interpreter drops Triton's overflow checks even where it runs with debug, whose asserts would fire: "
           "an int32 overflow a debugging user asked to see passes silently"),
    Mutant("host_cdiv_floors", "chunkwise/kernels/tiling.py::cdiv",
           "    return -(a // -b)\n",
           "    return a // b\n",
           "the kernels' host-side ceiling division rounds down: grids one program short of a partial last block"),
    Mutant("reference_blend_ignores_a_given_selection", "chunkwise/reference/blend.py::blend_prefill",
           "    if selection is not None:\n        kept = candidate & selection.to(device)\n    elif",
           "    if False:\n        kept = candidate & selection.to(device)\n    elif",
           "the reference blend computes its policy's candidates instead of the selection a diagnostic gives it"),
    Mutant("prefill_split_rows_limit_exclusive", "chunkwise/engine/model.py::Model._prefill_workspace",
           "        if self.deterministic or selecting or not 0 < p <= cap or self._fa3(inp):\n",
           "        if self.deterministic or selecting or not 0 < p < cap or self._fa3(inp):\n",
           "a step of exactly PREFILL_SPLIT_ROWS prefill rows takes one pass instead of splitting its context"),
    Mutant("heavy_tests_not_sent_first", "conftest.py::_tiers",
           "    return _smoke_rank(item), _heavy_rank(item)\n",
           "    return _smoke_rank(item), 0\n",
           "the heaviest tests keep their collection place: a minute-long one can start last while the other xdist "
           "worker idles"),
    Mutant("id_array_sliced_past_the_prompt_array", "chunkwise/engine/sequence.py::Sequence.id_array",
           "        if ids is not None and hi <= len(ids):\n",
           "        if ids is not None:\n",
           "a composite prompt's id array is sliced past its end: generated tokens go missing from the pool's page "
           "bytes and the runner's step ids"),
    Mutant("retired_mutants_keep_their_kills", "scripts/mutants.py::record_kills",
           "    kills = {name: test for name, test in load_kills().items() if name in catalogued}\n",
           "    kills = load_kills()\n",
           "a retired mutant's recorded killer stays in mutant_kills.json for ever, a kill of a bug no longer planted"),
    Mutant("recorded_killer_base_name_not_matched", "scripts/mutants.py::order_named_first",
           'if item.nodeid in first or item.nodeid.split("[")[0] in first',
           "if item.nodeid in first",
           "a killer recorded by its base name (a parametrized test's id cut at a space) moves none of its cases "
           "first: the mutant's run waits for it in the selection's order"),
    Mutant("failed_node_cut_at_a_space", "scripts/mutants.py::failed_nodes",
           'r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$"',
           'r"^(?:FAILED|ERROR) (\\S+)"',
           "a parametrized killer whose id holds a space is recorded cut at it: no node id equals it next time"),
    Mutant("planned_rows_split_as_plain_prefills", "chunkwise/engine/model.py::Model._prefill_split",
           "            return (PLANNED_SPLIT_SIZE if split else None), PLANNED_TILE_ROWS\n",
           "            return (PREFILL_SPLIT_SIZE if split else None), PLANNED_TILE_ROWS\n",
           "a blend's later layers split their context every PREFILL_SPLIT_SIZE positions, the plain prefill's "
           "constant, not the row plan's own"),
    Mutant("blend_graph_refuses_cascade_groups", "chunkwise/engine/blend_graphs.py::BlendGraphs.key_for",
           "        if plan is None or not self.max_rows or host.num_prefill > PREFILL_SEQS or plan.groups is not None:\n",
           "        if plan is None or not self.max_rows or host.cascade is not None or host.num_prefill > PREFILL_SEQS "
           "or plan.groups is not None:\n",
           "a blended step beside decodes that share a prefix (cascade groups) runs eagerly: 3 of 4 blended steps of "
           "the prefill-bound RAG workload did"),
    Mutant("planned_one_pass_takes_plain_tiles", "chunkwise/engine/model.py::Model._prefill_split",
           "            return (PLANNED_SPLIT_SIZE if split else None), PLANNED_TILE_ROWS\n",
           "            return (PLANNED_SPLIT_SIZE if split else None), PREFILL_TILE_ROWS if not split else PLANNED_TILE_ROWS\n",
           "a blend's one-pass layers (layer 0, its check layers) take the plain prefill's 256-row tiles, whose "
           "query blocks span twice the scattered positions"),
    Mutant("deterministic_prefill_splits_context", "chunkwise/engine/model.py::Model._prefill_workspace",
           "        if self.deterministic or selecting or not 0 < p <= cap or self._fa3(inp):\n",
           "        if selecting or not 0 < p <= cap or self._fa3(inp):\n",
           "deterministic mode's short prefill steps split their context, so a token's bits depend on its step"),
    Mutant("gqa_paged_q_head_mod_kv_heads", "chunkwise/kernels/paged_attention.py::_paged_attention_kernel",
           "    head = kv_head * GROUP + rows % GROUP\n",
           "    head = rows % GROUP * num_kv_heads + kv_head\n",
           "prefill attention maps query head h to KV head h % kv_heads instead of h // group"),
    Mutant("gqa_split_q_head_mod_kv_heads", "chunkwise/kernels/split_kv.py::_split_kernel",
           "        head = kv_head * GROUP + rows\n",
           "        head = rows * tl.num_programs(0) + kv_head\n",
           "split-KV decode maps query head h to KV head h % kv_heads instead of h // group"),
    Mutant("split_reads_past_split_end", "chunkwise/kernels/split_kv.py::_split_kernel",
           "            hi = tl.minimum(lo + split_size, seq_len)\n",
           "            hi = tl.minimum(lo + 2 * split_size, seq_len)\n",
           "a split reads on into the next split's keys, which are then counted twice"),
    Mutant("decode_does_not_see_its_own_key", "chunkwise/kernels/split_kv.py::_split_kernel",
           "q, tl.zeros([BLOCK_H], tl.int32) + seq_len - 1, lo // BLOCK_N",
           "q, tl.zeros([BLOCK_H], tl.int32) + seq_len - 2, lo // BLOCK_N",
           "split-KV decode places its query one position early"),
    Mutant("merge_drops_last_split", "chunkwise/kernels/split_kv.py::_merge",
           "    for j in tl.range(first, last, loop_unroll_factor=8):\n",
           "    for j in tl.range(first, last - 1, loop_unroll_factor=8):\n",
           "the merge leaves out the last split"),
    Mutant("split_count_rounded_down", "chunkwise/kernels/split_kv.py::num_splits_for",
           "    return cdiv(max_pages_per_seq * page_size, split_size)\n",
           "    return max_pages_per_seq * page_size // split_size\n",
           "the number of splits is rounded down, so a partly filled last split is never computed"),
    Mutant("merge_without_max_lse", "chunkwise/kernels/split_kv.py::_merge",
           'cache_modifier=".cg") - m)\n',
           'cache_modifier=".cg"))\n',
           "the merge exponentiates the LSEs without subtracting their max (overflows for large scores)"),
    Mutant("merge_of_all_empty_splits_is_nan", "chunkwise/kernels/split_kv.py::_merge",
           '    m = tl.where(m == float("-inf"), 0.0, m)',
           "    m = m + 0.0",
           "a sequence with no keys (seq_len 0), whose splits are all empty, merges to NaN instead of 0"),
    Mutant("merge_leaves_its_arrival_count", "chunkwise/kernels/split_kv.py::_split_kernel",
           '            tl.store(arrival, 0)\n',
           "",
           "the merging program does not reset its arrival counter, so the next launch on the workspace (the next "
           "layer) never merges that sequence"),
    # ---- fused kernels, cascade, deterministic mode ----------------------------------------------------
    Mutant('v_rotated_too', 'chunkwise/kernels/rope_store.py::_rope_store_kernel',
           '    y1 = cast(tl.where(is_v, x1, x1 * cos - x2 * sin), dtype)\n    y2 = cast(tl.where(is_v, x2, x2 * cos + x1 * sin), dtype)\n',
           '    y1 = cast(x1 * cos - x2 * sin, dtype)\n    y2 = cast(x2 * cos + x1 * sin, dtype)\n',
           'the fused RoPE kernel rotates the v heads as well as q and k'),
    Mutant('relocate_rotates_by_the_wrong_offset', 'chunkwise/kernels/relocate.py::_relocate_kernel',
           '    tl.store(k_cache_ptr + dst_off, cast(x1 * cos - x2 * sin, dtype), mask=ok)\n'
           '    tl.store(k_cache_ptr + dst_off + HALF, cast(x2 * cos + x1 * sin, dtype), mask=ok)\n',
           '    tl.store(k_cache_ptr + dst_off, cast(x1 * cos + x2 * sin, dtype), mask=ok)\n'
           '    tl.store(k_cache_ptr + dst_off + HALF, cast(x2 * cos - x1 * sin, dtype), mask=ok)\n',
           'relocating K to new positions rotates it by -delta instead of delta'),
    # Blend mode (chunkwise/engine/blend.py and its place in the step)
    Mutant('blend_rerotates_chunks_by_their_start_minus_one', 'chunkwise/engine/blend/planning.py::plan_blend',
           'firsts[owner] - n_ctx[owner], layers, kept',
           'firsts[owner] - n_ctx[owner] - 1, layers, kept',
           "a placed chunk's K are rotated to one position before their new one"),
    Mutant('blend_attention_takes_kept_rows_as_the_sequences_last', 'chunkwise/engine/model.py::Model._attention',
           '                            positions=inp.positions[:p] if inp.explicit_positions else None,',
           '                            positions=None,',
           "a blended prefill's kept rows attend as if they were its last rows (positions past their own)"),
    Mutant('blended_pages_enter_the_prefix_cache', 'chunkwise/engine/scheduler.py::Scheduler.postprocess',
           '                self.page_pool.commit(seq, end if approx is None else min(end, approx))',
           '                self.page_pool.commit(seq, end)',
           "a blended request's approximate pages are cached and served to later exact requests"),
    Mutant('check_layers_keep_the_least_deviating_candidates', 'chunkwise/engine/row_plan.py::select_rows',
           '            order = torch.sort(score[first:first + rows], descending=True, stable=True).indices[:keep]',
           '            order = torch.sort(torch.where(score.isinf(), score, -score)[first:first + rows], descending=True,'
           ' stable=True).indices[:keep]',
           'kv-deviation keeps the candidates whose K/V deviate least (fixed rows still kept)'),
    Mutant('blend_fills_pending_tokens_at_their_rows_after_the_check_layers',
           'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           '                        pending=(ends - 1)[pending], pending_src=src, row_plan=plan,',
           '                        pending=(final - 1)[pending], pending_src=src, row_plan=plan,',
           "a decode's pending token is written at its row after the blend's check layers, not at its input row"),
    Mutant('relocate_layers_taken_in_grid_order', 'chunkwise/kernels/relocate.py::_relocate_kernel',
           '        base = tl.load(layers_ptr + tl.program_id(1)) * layer_stride',
           '        base = tl.program_id(1).to(tl.int64) * layer_stride',
           "the one-launch relocation moves layers 0..m-1 instead of the layers it was given (Gemma's local ones)"),
    Mutant('chunk_heads_counts_heads_from_the_exact_prefix', 'chunkwise/engine/blend/planning.py::plan_blend',
           '    head[idx] = off < heads[owner]\n',
           '    head[idx] = idx < heads[owner]\n',
           "chunk-heads recomputes the prompt's first tokens after the exact prefix, not each chunk's first tokens"),
    Mutant('add_rms_norm_does_not_store_the_residual', 'chunkwise/kernels/fused_norm.py::add_residual',
           '    tl.store(res_out_ptr + offs, s, mask=mask)\n',
           '',
           'the fused add + RMSNorm kernel normalises the sum but never writes the residual stream out'),
    # (Reading the table of batch row `first` instead of members[first] was tried first: out-of-range rows
    # crash the interpreter instead of failing an assertion.)
    Mutant('cascade_shared_split_queries_of_the_first_member', 'chunkwise/kernels/cascade.py::_shared_split_kernel',
           '        s = tl.load(members_ptr + member, mask=row_ok, other=0).to(tl.int64)\n',
           '        s = tl.load(members_ptr + first + 0 * member, mask=row_ok, other=0).to(tl.int64)\n',
           "a shared split attends every member's rows with the first member's queries (and writes them there)"),
    Mutant('cascade_programs_skip_work_items', 'chunkwise/kernels/cascade.py::_shared_split_kernel',
           '    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):\n',
           '    for item in range(tl.program_id(0), num_items, tl.num_programs(0) + 1):\n',
           "the persistent shared-split programs stride past some work items when they are fewer than the items"),
    Mutant('cascade_groups_ignore_a_splits_last_page', 'chunkwise/kernels/cascade.py::cascade_groups',
           '        need = (np.arange(1, depth + 1) * split_size - 1) // page_size + 1',
           '        need = np.maximum((np.arange(1, depth + 1) * split_size - 1) // page_size, 1)',
           "sequences are grouped on a split when they agree on all of its pages but the last"),
    Mutant('cascade_graph_groups_not_staged', 'chunkwise/engine/cuda_graphs.py::StepGraphs.stage',
           '            staged = len(s32)\n',
           '            staged = self.seg\n',
           "a cascade graph step copies its seq lens but not its groups to the static buffers"),
    Mutant('deterministic_mode_uses_torch_for_gate_up', 'chunkwise/engine/model.py::Model._mlp',
           '        out = self._linear(act_and_mul(self._linear(x, lw["gate_up"]), self.cfg.hidden_act), lw["down"])\n',
           '        out = self._linear(act_and_mul(x @ lw["gate_up"].t(), self.cfg.hidden_act), lw["down"])\n',
           "deterministic mode sends one projection (gate_up) through torch's row-count-dependent BLAS"),
    # ---- runner, sampling -------------------------------------------------------------------------------
    Mutant('sampling_rows_in_batch_order', 'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           '        return host, [e[0] for e in entries if e[2]]\n',
           '        return host, [s for s, smp in zip(batch.seqs, batch.samples) if smp]\n',
           "sampled sequences are listed in batch order, not in the logits rows' order (prefills, then decodes)"),
    Mutant('logits_row_of_the_chunk_start', 'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           'logits_indices=(final - 1)[samples]',
           'logits_indices=(final - n)[samples]',
           "the logits row taken is the chunk's first token, not its last"),
    Mutant('decode_feeds_a_stale_token', 'chunkwise/engine/model_runner.py::ModelRunner.prepare',
           '            ids = np.array([s.token_ids[-1] for s in seqs], np.int64)\n',
           '            ids = np.array([s.token_ids[-2] for s in seqs], np.int64)\n',
           "overlap scheduling: a decode-only step is prepared before the previous step's token lands, and feeds the one before"),
    Mutant("logprobs_of_the_top_token_in_the_engine_sampler", "chunkwise/engine/sampler.py::Sampler.sample",
           "                logprobs[seq.seq_id] = token_logprobs(logits[row], token, params.logprobs)\n",
           "                logprobs[seq.seq_id] = token_logprobs(logits[row], greedy[row], params.logprobs)\n",
           "the engine's Sampler reports the logprob of the argmax token instead of the sampled one"),
    Mutant("logprobs_of_the_top_token_in_the_sampler", "chunkwise/sampling.py::token_logprobs",
           "    out = {int(token): float(lp[token])}\n",
           "    out = {int(lp.argmax()): float(lp.max())}\n",
           "the shared sampler reports the top-1 logprob instead of the sampled token's (both engines agree)"),
    # ---- page pool, prefix cache ------------------------------------------------------------------------
    Mutant("leaked_tail_page", "chunkwise/engine/page_pool.py::PagePool.free",
           "        for page_id in reversed(seq.page_table):\n",
           "        for page_id in reversed(seq.page_table[:seq.num_computed_tokens // self.page_size]):\n",
           "freeing a sequence gives back only its full pages; the partly filled tail page leaks"),
    Mutant("full_prefix_hit_computes_no_token", "chunkwise/engine/page_pool.py::PagePool.probe_prefix",
           "self.seq_bytes(seq, (seq.num_tokens - 1) // self.page_size * self.page_size)",
           "self.seq_bytes(seq, seq.num_tokens // self.page_size * self.page_size)",
           "a prompt whose pages are all cached takes every one, leaving no token to compute"),
    Mutant("page_hash_ignores_its_parent", "chunkwise/engine/page_pool.py::page_hash",
           "    return hashlib.sha256(parent + tokens).digest()\n",
           "    return hashlib.sha256(tokens).digest()\n",
           "a page's hash covers its own tokens only, not the prefix before it"),
    Mutant("partial_page_cached", "chunkwise/engine/page_pool.py::PagePool.commit",
           "        num_full = num_tokens // self.page_size\n",
           "        num_full = -(-num_tokens // self.page_size)\n",
           "a page is cached before all its slots are computed"),
    Mutant("prefix_hit_stays_evictable", "chunkwise/engine/page_pool.py::PagePool.take_prefix",
           "            if page.ref_count == 0:\n                del self.evictable[page_id]\n            page.ref_count += 1\n"
           "            self._record(",
           "            page.ref_count += 1\n            self._record(",
           "a cached page taken by a new request stays evictable and can be handed out while in use"),
    Mutant("eviction_keeps_the_cache_entry", "chunkwise/engine/page_pool.py::PagePool._take_page",
           "        del self.cached[page.key]\n",
           "",
           "an evicted page stays in the hash table, pointing at a page that now holds other tokens"),
    Mutant("eviction_most_recently_used", "chunkwise/engine/page_pool.py::PagePool._take_page",
           "        page_id, _ = self.evictable.popitem(last=False)\n",
           "        page_id, _ = self.evictable.popitem(last=True)\n",
           "prefix-cache eviction takes the most recently freed page instead of the least"),
    Mutant("retaken_pages_written_after_the_old_ones", "chunkwise/engine/page_pool.py::PagePool.free",
           '            self._new.pop(seq.seq_id, None)\n',
           "",
           "a sequence freed (preempted) and given pages again before the next page changes keeps its old report: "
           "its new pages are written after its old ones, from its old first column, instead of from column 0"),
    Mutant("freed_row_never_released", "chunkwise/engine/page_pool.py::PagePool.free",
           "            self._released[seq.seq_id] = None\n        seq.page_table = []\n",
           "        seq.page_table = []\n",
           "freeing a sequence's pages never reports it freed, so its page-table row is never released"),
    # ---- scheduler, engine ------------------------------------------------------------------------------
    Mutant("preemption_forgets_generated_tokens", "chunkwise/engine/scheduler.py::Scheduler._preempt",
           "        seq.status = SequenceStatus.WAITING\n        seq.num_preemptions += 1\n",
           "        seq.status = SequenceStatus.WAITING\n        del seq.token_ids[seq.num_prompt_tokens:]\n"
           "        seq.num_preemptions += 1\n",
           "a preempted sequence is readmitted with its prompt only, its generated tokens dropped"),
    Mutant("preempts_the_oldest", "chunkwise/engine/scheduler.py::Scheduler._reserve",
           "            victim = self.running[-1]\n",
           "            victim = self.running[0]\n",
           "when pages run out the oldest running sequence is preempted instead of the newest"),
    Mutant('prompt_check_misses_negative_ids', 'chunkwise/limits.py::<module>',
           '_row("prompt_token_id", 0, "vocab_size",',
           '_row("prompt_token_id", None, "vocab_size",',
           "a prompt's negative token id passes the request check (nothing checks it later on the engine's path)"),
    Mutant("failed_step_keeps_its_pages", "chunkwise/engine/core.py::EngineCore._fail",
           '            if self.scheduler.abort(seq.seq_id, reason="error") is None:\n',
           "            if self.scheduler.seqs.pop(seq.seq_id, None) is None:\n",
           "failure isolation forgets a failed step's requests without freeing their pages"),
    Mutant("tp_preparation_failure_skips_the_workers_page_changes",
           "chunkwise/engine/executor/executor.py::MultiprocExecutor.execute",
           "            if not sent:\n", "            if False:\n",
           "under tensor parallelism, a step that fails in preparation never sends the workers the page changes "
           "rank 0's tables already took: from then on the ranks' page-table rows name different pages"),
    Mutant("failed_launch_loses_its_releases", "chunkwise/engine/core.py::EngineCore.step",
           '            self.page_pool.release_again(batch.page_changes)\n',
           "",
           "a step that fails before the runner applied its page changes loses the releases they carried: "
           "those sequences keep their page-table rows forever"),
    # ---- overlap scheduling ---------------------------------------------------------------------------------
    Mutant("overlap_feeds_the_token_before_the_pending_one", "chunkwise/engine/model_runner.py::ModelRunner.prepare",
           "        pending = start + n > np.array([len(s.token_ids) for s in seqs], np.int64)\n",
           "        pending = start + n > np.array([len(s.token_ids) + s.num_pending for s in seqs], np.int64)\n",
           "a token still on the device is taken as known, so the step feeds the host's last token instead"),
    Mutant("overlap_streams_the_wasted_token", "chunkwise/engine/sampler.py::Sampler.sample",
           "            if seq.is_finished:\n                continue\n",
           "",
           "the token a request computed in vain (its finish became known after the next step launched) is sampled "
           "and streamed"),
    Mutant("overlap_defers_drawn_tokens", "chunkwise/engine/core.py::EngineCore.step",
           "        if self.config.async_scheduling and step.can_overlap:\n",
           "        if self.config.async_scheduling:\n",
           "a step with seeded sampling or logprobs stays in flight, as if its tokens were on the device"),
    Mutant("overlap_launch_failure_drops_the_step_in_flight", "chunkwise/engine/core.py::EngineCore.step",
           "            return self._postprocess(prev) + self._fail(batch, exc)\n",
           "            return self._fail(batch, exc)\n",
           "a step that fails to launch drops the step in flight instead of postprocessing it"),
    Mutant("overlap_caches_pages_of_the_step_in_flight", "chunkwise/engine/scheduler.py::Scheduler.postprocess",
           "                self.page_pool.commit(seq, end if approx is None else min(end, approx))\n",
           "                self.page_pool.commit(seq, None if approx is None else min(end, approx))\n",
           "postprocess caches pages up to the tokens computed by the step in flight, whose last token is unknown"),
    Mutant("overlap_decodes_past_max_tokens", "chunkwise/engine/scheduler.py::Scheduler.schedule",
           "        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_is_last]:\n",
           "        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:\n",
           "a decode whose pending token is its last is scheduled again, computing past max_tokens"),
    # ---- the prefill cap of a step that decodes (max_prefill_tokens_with_decodes) ------------------------------------
    Mutant("decode_step_prefill_cap_ignored", "chunkwise/engine/scheduler.py::_Plan.prefill_budget",
           "        return min(self.budget, self.rows, self.prefill_cap - sum(self.capped.values()))\n",
           "        return min(self.budget, self.rows)\n",
           "the cap is set once a step decodes, but a prefill split by the budget still takes all the budget left, so "
           "every decoding user waits for a full-budget prefill"),
    Mutant("decode_step_prefill_cap_per_sequence", "chunkwise/engine/scheduler.py::_Plan.prefill_budget",
           "        return min(self.budget, self.rows, self.prefill_cap - sum(self.capped.values()))\n",
           "        return min(self.budget, self.rows, self.prefill_cap)\n",
           "each prefill beside the decodes gets the whole cap for itself instead of sharing it, so a step with "
           "several prompts prefilling exceeds it"),
    Mutant("decode_step_prefill_cap_kept_by_a_preempted_prefill", "chunkwise/engine/scheduler.py::_Plan.drop",
           '            self.capped.pop(seq.seq_id, None)\n',
           "",
           "a prefill preempted out of a step keeps counting against the step's prefill cap, so the prompts left in "
           "the step get fewer tokens than the cap allows"),
    Mutant("decode_step_prefill_cap_cuts_caller_chunks", "chunkwise/engine/scheduler.py::Scheduler._chunk",
           "        if counted <= plan.budget and want <= plan.rows:\n",
           "        if counted <= plan.prefill_budget and want <= plan.rows:\n",
           "a caller's chunk (chunk_sizes) waits for the decode-step cap, not only the budget, so while any request "
           "decodes a composed request's chunk larger than the cap never runs"),
    # ---- a blended prefill's rows against the budget (computed rows counted, placed ones capped per step) --------
    Mutant("blended_prefill_counts_its_placed_rows", "chunkwise/engine/blend/blender.py::Blender.counted_rows",
           "        return -(-sum(rows) // len(rows))\n",
           "        return n\n",
           "a blended prefill counts all its rows against the budget, placed ones too, so a step holds about one and "
           "one longer than the budget runs alone, without the decodes"),
    Mutant("blended_rows_uncapped", "chunkwise/engine/scheduler.py::Scheduler._chunk",
           "        if counted <= plan.budget and want <= plan.rows:\n",
           "        if counted <= plan.budget:\n",
           "blended prefills join a step while their counted rows fit the budget, whatever their rows at layer 0: "
           "more than the activations and blend graphs are sized for"),
    Mutant("planned_chunk_refused_at_the_budget_exactly", "chunkwise/engine/scheduler.py::Scheduler._chunk",
           "        if counted <= plan.budget and want <= plan.rows:\n",
           "        if counted < plan.budget and want <= plan.rows:\n",
           "a blended prefill whose counted rows fill the budget left exactly waits for a later step"),
    Mutant("planned_chunk_refused_at_the_steps_rows_exactly", "chunkwise/engine/scheduler.py::Scheduler._chunk",
           "        if counted <= plan.budget and want <= plan.rows:\n",
           "        if counted <= plan.budget and want < plan.rows:\n",
           "a blended prefill whose rows fill the step's max_blended_rows exactly waits for a later step"),
    Mutant("blend_count_skips_the_check_layers", "chunkwise/engine/blend/policy.py::computed_candidates",
           "    return [n, *kept] + [kept[-1]] * (num_layers - 1 - len(kept)) if kept else [n] * num_layers\n",
           "    return [n] + [kept[-1]] * (num_layers - 1) if kept else [n] * num_layers\n",
           "the scheduler's count of a kv-deviation blend takes its check layers at the final ratio, not the gradual "
           "filter's larger shares"),
    Mutant("blend_count_takes_a_chunks_partial_page", "chunkwise/engine/blend/planning.py::layer_rows",
           "            cached = max((n_ctx + p.num_tokens) // page_size * page_size - n_ctx, 0)\n",
           "            cached = p.num_tokens\n",
           "the scheduler counts a chunk's tail past its last full page as placed, though the prefix cache holds only "
           "full pages, so the plan computes more rows than the budget took"),
    Mutant("blend_graph_tail_rows_bucketed_coarsely", "chunkwise/engine/blend_graphs.py::BlendGraphs.key_for",
           "tuple(head_bucket(k) for k in kept[:-1]) + tuple(tail_bucket(k) for k in kept[-1:])",
           "tuple(head_bucket(k) for k in kept)",
           "the rows kept after the last check layer take the coarse buckets of the layers before it, padding every "
           "later layer by up to an eighth"),
    Mutant("blend_graph_decodes_unpadded", "chunkwise/engine/blend_graphs.py::BlendGraphs.key_for",
           "_pow2_at_least(max(d, real // DECODE_PAD_SHARE))",
           "_pow2_at_least(d)",
           "a blend graph's decodes are keyed by their own power of two however many prefill rows beside them, so "
           "steps of several blended prefills meet a new graph to capture for every decode count"),
    Mutant("head_bucket_pads_a_quarter", "chunkwise/engine/cuda_graphs.py::head_bucket",
           "    step = max(TAIL_ROWS_STEP, (1 << (n.bit_length() - 1)) // STEPS_PER_OCTAVE)\n",
           "    step = max(TAIL_ROWS_STEP, (1 << (n.bit_length() - 1)) // (STEPS_PER_OCTAVE // 2))\n",
           "a blend graph's first layers are padded by up to a quarter of their rows, not an eighth"),
    # ---- the accepting side of every limit (issue 32: checks that refuse too much passed CI) --------------------
    Mutant('max_model_len_refuses_a_request_of_exactly_it', 'chunkwise/requests.py::validate_requests',
           'admits(len(tokens) + p.max_tokens, max_model_len=max_model_len)',
           'admits(len(tokens) + p.max_tokens, max_model_len=max_model_len - 1)',
           'a request whose prompt + max_tokens equals max_model_len is refused'),
    Mutant('max_position_embeddings_refused_as_max_model_len', 'chunkwise/open_config.py::open_config',
           'bound.admits(max_len, max_position_embeddings=limit)',
           'bound.admits(max_len, max_position_embeddings=limit - 1)',
           "max_model_len equal to the checkpoint's max_position_embeddings (the default) is refused"),
    Mutant('prompt_check_refuses_the_last_vocabulary_id', 'chunkwise/tokenizer.py::check_vocabulary',
           'PROMPT_TOKEN_ID.first_outside(ids, vocab_size=cfg.vocab_size)',
           'PROMPT_TOKEN_ID.first_outside(ids, vocab_size=cfg.vocab_size - 1)',
           'a prompt holding token id vocab_size - 1 is refused as outside the vocabulary'),
    Mutant('stop_token_check_refuses_the_last_vocabulary_id', 'chunkwise/requests.py::check_against_vocab',
           'stop.admits(t, vocab_size=vocab_size)',
           'stop.admits(t, vocab_size=vocab_size - 1)',
           'stop token id vocab_size - 1 is refused as outside the vocabulary'),
    Mutant('logprobs_of_the_whole_vocabulary_refused', 'chunkwise/limits.py::<module>',
           '_row("logprobs", 0, "vocab_size", "request", ENGINES),',
           '_row("logprobs", 0, "vocab_size", "request", ENGINES, upper_inclusive=False),',
           "logprobs=vocab_size (every token's logprob) is refused"),
    # ---- sizes derived from the configuration ----------------------------------------------------------------------
    Mutant("pages_per_sequence_rounded_down", "chunkwise/engine_config.py::EngineConfig.max_pages_per_seq",
           "        return math.ceil(self.max_model_len / self.page_size)\n",
           "        return self.max_model_len // self.page_size\n",
           "max_pages_per_seq rounds max_model_len / page_size down, so a request of exactly max_model_len outgrows "
           "its page-table row when page_size does not divide max_model_len"),
    # ---- streamed text ------------------------------------------------------------------------------------------------
    Mutant("text_stream_sends_partial_characters", "chunkwise/tokenizer.py::TextStream.push",
           'if len(text) <= len(sent) or text.endswith("\\ufffd"):',
           "if len(text) <= len(sent):",
           "streamed text sends U+FFFD for a character whose bytes have not all arrived, then the character"),
    Mutant("text_stream_drops_the_held_back_tail", "chunkwise/tokenizer.py::TextStream.finish",
           "        return decode(self.tokenizer, self.token_ids)[self.num_chars:]\n",
           '        return ""\n',
           "a streamed request's last piece leaves out the text held back for an incomplete character"),
    # ---- the HTTP server ----------------------------------------------------------------------------------------------
    Mutant("serve_disconnect_does_not_abort", "chunkwise/serve/app.py::_AbortingStream.__call__",
           "            await super().__call__(scope, receive, send)\n        finally:\n"
           "            self.reply.state.loop.abort(self.reply.running_ids())\n",
           "            await super().__call__(scope, receive, send)\n        finally:\n            pass\n",
           "a client that disconnects mid-stream leaves its request running, holding its pages until max_tokens"),
    Mutant("serve_leaving_client_of_a_whole_answer_not_aborted", "chunkwise/serve/app.py::_Reply.collect",
           "            gone.cancel()\n            self.state.loop.abort(self.running_ids())\n",
           "            gone.cancel()\n",
           "a client that gives up waiting for a whole (non-streamed) answer leaves its request running"),
    Mutant("serve_last_streamed_piece_dropped", "chunkwise/serve/app.py::_Choice.feed",
           "        self.text += piece\n        return piece, pairs\n",
           '        self.text += piece\n        return ("" if out.finished else piece), pairs\n',
           "the streamed event that finishes a request carries its finish_reason but not its text"),
    Mutant("serve_stop_string_leaves_the_request_running", "chunkwise/serve/client.py::EngineClient._on_outputs",
           "        self.abort(self.outputs.take_stopped())\n",
           "        self.outputs.take_stopped()\n",
           "a stop string ends the text sent, but the engine goes on generating the request to max_tokens"),
    Mutant("serve_n_samples_share_one_seed", "chunkwise/serve/protocol.py::_GenerationRequest.sampling_params",
           "seed=None if self.seed is None else self.seed + index,",
           "seed=self.seed,",
           "n > 1 with a seed gives every sample the same seed, so n identical samples"),
    Mutant("serve_stop_string_prefix_not_held_back", "chunkwise/engine/stop_strings.py::StopStrings.push",
           "        keep = max((self._partial(text, s) for s in self.stops), default=0)\n",
           "        keep = 0\n",
           "streamed text that may begin a stop string is sent at once, so a stop string split across pieces is "
           "missed"),
    Mutant("serve_itl_measured_from_arrival", "chunkwise/serve/streams.py::Streams._time_token",
           "self.metrics.itl.observe(now - stream.last_token)",
           "self.metrics.itl.observe(now - stream.arrival)",
           "the inter-token latency histogram measures from the request's arrival, not from its previous token"),
    Mutant("serve_core_drops_aborts", "chunkwise/serve/driver.py::EngineDriver._abort",
           "(list(self.live) if m.request_ids is None else m.request_ids)",
           "(list(self.live) if m.request_ids is None else [])",
           "the engine process ignores the server's aborts of running requests: a client that disconnects leaves "
           "its request holding pages in the engine process"),

    Mutant("serve_core_dead_engine_unnoticed", "chunkwise/serve/engine_core.py::EngineCore._receive",
           "                self._fail(f\"the engine process exited unexpectedly (exit code {self._process.exitcode})\")\n",
           "",
           "the server does not notice that its engine process died: its requests wait for ever and new ones are "
           "taken"),
    Mutant("serve_core_loop_sends_itself", "chunkwise/serve/engine_core.py::EngineCore._send",
           "        self._outbox.put(message)\n        return True\n",
           "        try:\n            self._conn.send(message)\n        except (OSError, ValueError):\n"
           "            return False\n        return True\n",
           "the event loop writes to the engine process's pipe itself: a submission larger than the pipe holds, sent "
           "while the engine process waits for the loop to read its outputs, deadlocks both"),
    Mutant("serve_heap_not_settled", "chunkwise/serve/engine_core.py::settled_heap",
           "    gc.collect()\n    gc.freeze()\n",
           "    gc.collect()\n",
           "serving processes keep their built heap in the garbage collector's full passes, each of which stalls "
           "every stream for 0.1-0.3 s"),
    Mutant("serve_keep_alive_as_long_as_clients", "chunkwise/serve/cli.py::<module>",
           "KEEP_ALIVE_S = 15\n",
           "KEEP_ALIVE_S = 5\n",
           "the server closes idle connections as soon as clients stop keeping them, so a client may reuse one as it "
           "closes and get a read error"),
    # ---- the serving benchmark ---------------------------------------------------------------------------------------
    Mutant("bench_serving_clients_traces_misdealt", "benchmarks/bench_serving.py::Bench.http_mode.run",
           "                    traces[i::k] = part.result()\n",
           "                    traces[i * len(part.result()):(i + 1) * len(part.result())] = part.result()\n",
           "the traces of the requests dealt to several client processes are put back in blocks, not in turn, so "
           "each latency is matched to another request"),
    Mutant("bench_serving_run_takes_earlier_steps", "benchmarks/bench_serving.py::window_stats",
           "    inside = [s for s in steps if begin <= s[\"at\"] <= end]\n",
           "    inside = [s for s in steps if s[\"at\"] <= end]\n",
           "a run's steps include those before it began (warm-up, earlier runs), so its step counts and decode-only "
           "step time are not its own"),
    # ---- every dtype through every kernel ---------------------------------------------------------------------------
    Mutant("matmul_truncates_to_bf16", "chunkwise/kernels/matmul.py::_matmul_kernel",
           "cast(acc, out_ptr.dtype.element_ty)",
           "acc.to(out_ptr.dtype.element_ty)",
           "the deterministic matmul stores with a plain .to(), which the interpreter truncates for bf16 instead of "
           "rounding to nearest even"),
    # ---- chunks: pins, the pin cap, the per-piece report ------------------------------------------------
    Mutant("pinned_pages_stay_evictable", "chunkwise/engine/page_pool.py::PagePool.pin",
           "            if page.ref_count == 0:\n                del self.evictable[page_id]\n            page.ref_count += 1\n"
           "            self.pins[",
           "            page.ref_count += 1\n            self.pins[",
           "pinning takes a reference but leaves the page on the LRU list, so eviction pressure takes pinned pages"),
    Mutant("unpin_keeps_the_reference", "chunkwise/engine/page_pool.py::PagePool.unpin",
           "                del self.pins[page_id]\n            page.ref_count -= 1\n",
           "                del self.pins[page_id]\n",
           "unpin forgets the pin's reference: the chunk's pages stay in use forever"),
    Mutant("pin_cap_counts_shared_pages_twice", "chunkwise/engine/core.py::EngineCore._pin",
           "        self.check_pin_cap(sum(1 for p in pages if p not in pool.pins))\n",
           "        self.check_pin_cap(len(pages))\n",
           "the pin cap counts pages already pinned by another chunk again"),
    Mutant("pin_ignores_queued_requests", "chunkwise/engine/core.py::EngineCore._pin",
           "            self.scheduler.check_fits(seq, f\"pinning these {num_full} pages: request {seq.seq_id}\", pages)\n",
           "            pass\n",
           "a pin may leave a queued request no room in the pool (it could then never run)"),
    Mutant("chunk_reuse_counted_from_the_prompt_start", "chunkwise/chunks.py::reuse_report",
           "        exact = max(0, min(start + p.num_tokens, num_cached_tokens) - start)\n",
           "        exact = min(p.num_tokens, num_cached_tokens)\n",
           "chunk_reuse credits each piece with the cached tokens from the prompt's start, not from its own start"),
    Mutant("chunks_hoisted_before_plain_pieces", "chunkwise/chunks.py::ChunkRegistry.pieces",
           "                ids += chunk.token_ids\n",
           "                ids[:0] = chunk.token_ids\n",
           "each chunk piece of a composite is put in front of the ids so far instead of after them, so a chunk "
           "follows another predecessor than the prompt says"),
    # ---- an unplanted sample (2026-11-25): written by someone who had not seen the tests, in code the catalogue did
    # not touch; the suite then missed three of these (the exact top-p cut, a transformers-4 Gemma config, the
    # reference's stop at max_tokens), which now have tests. (Its max_pages_per_seq bug is pages_per_sequence_rounded_down.)
    Mutant('seed_zero_draws_a_fresh_seed', 'chunkwise/sampling.py::make_generator',
           '    gen.manual_seed(params.seed if params.seed is not None else torch.seed())\n',
           '    gen.manual_seed(params.seed or torch.seed())\n',
           'a request with seed=0 is treated as unseeded (falsy seed), so seed 0 gives different tokens on every run'),
    Mutant('top_p_keeps_the_token_at_the_exact_cut', 'chunkwise/sampling.py::sampling_probs',
           '        drop = torch.softmax(sorted_logits, dim=-1).cumsum(-1) <= 1 - params.top_p\n',
           '        drop = torch.softmax(sorted_logits, dim=-1).cumsum(-1) < 1 - params.top_p\n',
           "top-p drops tail tokens only while their mass is strictly below 1 - top_p, so a token whose cumulative mass lands exactly on the cut is kept (HF's warper drops it)"),
    Mutant('gemma_default_layer_pattern_off_by_one', 'chunkwise/model_config.py::_default_layer_types',
           '        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]\n',
           '        return [FULL if i % pattern == 0 else SLIDING for i in range(layers)]\n',
           'for a Gemma 3 config.json without layer_types (transformers 4), the full-attention layers are taken as layers 0, 6, 12... instead of 5, 11, 17...'),
    Mutant('llama3_rope_smoothing_reversed', 'chunkwise/model_config.py::RopeConfig.inv_freq',
           '            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled\n',
           '            smoothed = smooth * scaled / self.factor + (1 - smooth) * scaled\n',
           'llama3 RoPE scaling interpolates the medium band the wrong way round (the frequencies nearest the low-frequency end are scaled least)'),
    Mutant('reference_length_wins_over_stop', 'chunkwise/reference/engine.py::Engine._generate_one',
           '            if token in stops:\n                out.finish_reason = "stop"\n            elif len(out.token_ids) >= params.max_tokens:\n                out.finish_reason = "length"\n',
           '            if len(out.token_ids) >= params.max_tokens:\n                out.finish_reason = "length"\n            elif token in stops:\n                out.finish_reason = "stop"\n',
           'the reference checks max_tokens before the stop tokens, so a stop token drawn as the max_tokens-th token finishes with "length" instead of "stop"'),
    Mutant('max_tokens_counts_pending_tokens', 'chunkwise/engine/sequence.py::Sequence.num_generated_tokens',
           '        return len(self.token_ids) - len(self.prompt_token_ids)\n',
           '        return self.num_tokens - self.num_prompt_tokens\n',
           "num_generated_tokens counts the tokens still on the device too, so under overlap scheduling a request finishes with 'length' one token early (the in-flight token is wasted)"),
    Mutant('o_proj_shape_transposed', 'chunkwise/weights.py::expected_shapes',
           '"self_attn.o_proj.weight": (h, q_out),',
           '"self_attn.o_proj.weight": (q_out, h),',
           'the checkpoint check expects o_proj as [num_heads * head_dim, hidden] instead of [hidden, num_heads * head_dim], so a model whose heads * head_dim != hidden_size (Gemma 3 270m, any head_dim override) is refused'),
    # ---- a second unplanted sample (2026-11-25), written the same way; the suite missed three (logprobs at the
    # server's max, a refused sample leaving its request's earlier samples queued, EOS text in the output), and
    # the float16 pool size was not checked: each now has a test in the smoke tier. (The composite-prompt bug's
    # `elif` follows blend mode's branch before it, written after the sample.)
    Mutant('serve_refuses_logprobs_at_max_logprobs', 'chunkwise/serve/app.py::_logprobs',
           'admits(k, max_logprobs=state.max_logprobs)',
           'admits(k, max_logprobs=state.max_logprobs - 1)',
           "the server refuses logprobs (or top_logprobs) equal to --max-logprobs (OpenAI's 20) with a 400, though the message says it must be between 0 and 20"),
    Mutant("output_text_keeps_special_tokens", "chunkwise/tokenizer.py::decode",
           "    return tokenizer.decode(token_ids, skip_special_tokens=True)\n",
           "    return tokenizer.decode(token_ids)\n",
           "generated text is decoded with the special tokens kept, so a request that stops on EOS (or <end_of_turn>) "
           "returns and streams the token's text, e.g. a trailing '<eos>'"),
    Mutant("composite_prompt_ignores_explicit_chunk_sizes", "chunkwise/requests.py::validate_requests",
           "        if mode != \"exact\" and pc is not None:\n            c = [len(tokens)]\n",
           "        if mode != \"exact\" and pc is not None:\n            c = [len(tokens)]\n"
           "        elif pc is not None:   # a composite prompt is prefilled piece by piece\n"
           "            c = [piece.num_tokens for piece in pc]\n",
           "a composite prompt (holding a Chunk) is always prefilled at its pieces' boundaries: the caller's explicit "
           "chunk_sizes for it are silently ignored"),
    Mutant("pool_check_counts_the_last_sampled_token", "chunkwise/engine/scheduler.py::Scheduler.check_fits",
           "        most = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1\n",
           "        most = seq.num_prompt_tokens + seq.sampling_params.max_tokens\n",
           "the pool check counts the last sampled token as cached, so a request that exactly fits the pool "
           "(prompt + max_tokens - 1 filling every page) is refused as needing one page more than num_pages"),
    Mutant("admission_counts_its_evictable_prefix_as_free", "chunkwise/engine/page_pool.py::PagePool.can_admit",
           "        taken_evictable = sum(1 for page_id, _ in prefix if self.pages[page_id].ref_count == 0)\n"
           "        return need <= self.num_free_pages - taken_evictable\n",
           "        return need <= self.num_free_pages\n",
           "admission counts the evictable cached pages of the request's own prefix hit as free pages for its new "
           "tokens too, so under memory pressure a prefix-cache hit is admitted without room and the step's "
           "allocation raises out of Engine.step"),
    Mutant('pin_cap_refuses_pins_reaching_the_cap', 'chunkwise/engine/core.py::EngineCore.check_pin_cap',
           'admits(pool.num_pinned_pages + num_new, pin_cap=cap)',
           'admits(pool.num_pinned_pages + num_new, pin_cap=cap - 1)',
           'register_chunk(pin=True) is refused when the pinned pages would reach max_pinned_fraction of the pool exactly, though the cap allows it'),
    Mutant("gelu_tanh_argument_not_doubled", "chunkwise/kernels/activation.py::_act_and_mul_kernel",
           "        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)\n",
           "        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)\n",
           "the fused GELU(tanh) takes sqrt(2/pi) where x * sigmoid(2u) needs 2 * sqrt(2/pi), so Gemma's MLP "
           "activation is wrong (silu models unaffected)"),
    Mutant("sandwich_pre_norm_mean_over_padded_width", "chunkwise/kernels/fused_norm.py::_rms_norm_kernel",
           "        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / hidden + eps)\n",
           "        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / BLOCK_N + eps)\n",
           "the fused Gemma sandwich pre-norm (post-attention / post-FF norm) averages the squares over the padded "
           "block width instead of hidden_size, so for a hidden size that is not a power of two (Gemma 3 270m: 640, "
           "1b: 1152) that norm is too large"),
    Mutant("kv_page_bytes_miss_float16", "chunkwise/engine/kv_cache.py::page_bytes",
           "    \"\"\"Bytes one page takes over all layers, K and V (of `kv_heads` heads: a tensor-parallel rank's).\"\"\"\n"
           "    elem = torch.empty((), dtype=dtype).element_size()\n",
           "    \"\"\"Bytes one page takes over all layers, K and V (of `kv_heads` heads: a tensor-parallel rank's).\"\"\"\n"
           "    elem = 2 if dtype == torch.bfloat16 else 4\n",
           "a page's size in bytes is taken as 4-byte elements for float16, so a float16 engine sizes its KV pool "
           "as if float32: half the pages its memory budget holds, and an explicit num_pages is checked against "
           "twice its real size"),
    # ---- a third unplanted sample (2026-11-25, written by a helper who had not seen the tests, against the
    # suite after the second sample's tests): the suite killed 7 of 10; a transformers-4 Gemma 3 config's RoPE,
    # the server's top_k=-1 and the CLI's prefix report then got tests, and a pinned blend example ends on a chunk.
    Mutant('blend_prompts_last_token_taken_as_a_candidate', 'chunkwise/engine/blend/planning.py::plan_blend',
           '        inside = (pos >= start) & (pos < total - 1)\n',
           "        inside = (pos >= start) & (pos < total)   # the chunk's stored tokens within this prefill's rows\n",
           "plan_blend lets the prompt's last token be a candidate when the prompt ends on a chunk's full page, so under chunk-heads (or kv-deviation's filtering) the row whose logits give the first token may not be computed: the first generated token comes from a reused, uncomputed row"),
    Mutant('reference_blend_rounds_half_to_even', 'chunkwise/reference/blend.py::num_kept',
           '    return min(n, int(ratio * n + 0.5))\n',
           '    return min(n, round(ratio * n))\n',
           "the reference blend's k(r) uses Python's round (half to even) instead of floor(r n + 0.5), so at an exact half (r = 0.5 of a 5-token chunk) it recomputes one token fewer than the fast engine and than documented: its chunk_reuse counts and its blended logits differ"),
    Mutant('blend_ratio_zero_refused', 'chunkwise/limits.py::<module>',
           '_row("recompute_ratio", 0, 1, "chunk", ENGINES),',
           '_row("recompute_ratio", 0, 1, "chunk", ENGINES, lower_inclusive=False),',
           "Blend(recompute_ratio=0) (reuse the chunks' K/V as they are, documented) is refused with a ValueError that still says [0, 1]"),
    Mutant('split_kv_threshold_zero_refused', 'chunkwise/limits.py::<module>',
           '_row("split_kv_threshold", 0, None,',
           '_row("split_kv_threshold", 1, None,',
           'split_kv_threshold=0 (every decode takes split-KV, the GPU default) is refused as not >= 1, so it cannot be asked for explicitly on CPU'),
    Mutant('gemma_local_rope_scaled_like_global', 'chunkwise/model_config.py::_rope_configs',
           '            params = {FULL: params, SLIDING: {"rope_theta": d.get("rope_local_base_freq")}}\n',
           '            params = {FULL: params, SLIDING: dict(params, rope_theta=d.get("rope_local_base_freq"))}\n',
           "for a Gemma 3 config.json in transformers 4's layout (rope_theta / rope_scaling / rope_local_base_freq), the sliding layers' RoPE also takes the global rope_scaling (e.g. linear factor 8 of Gemma 3 4b+), though Gemma scales only the full-attention layers: every sliding layer's positions are compressed"),
    Mutant('top_k_above_the_vocabulary_crashes', 'chunkwise/sampling.py::sampling_probs',
           '        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]\n',
           '        kth = torch.topk(logits, params.top_k).values[-1]\n',
           'a sampled request whose top_k exceeds the vocabulary size (accepted by SamplingParams, e.g. top_k=1000 on a 384-token vocabulary) raises a RuntimeError from torch.topk instead of keeping every token'),
    Mutant('serve_top_k_minus_one_refused', 'chunkwise/serve/protocol.py::_GenerationRequest.sampling_params',
           '        top_k = 0 if self.top_k == -1 else self.top_k\n',
           '        top_k = self.top_k\n',
           "the server passes top_k=-1 (vLLM's 'keep every token', documented as an accepted value) straight to SamplingParams, so such a request is refused with a 400 instead of sampling from every token"),
    Mutant('page_table_refuses_a_full_row', 'chunkwise/engine/page_tables.py::PageTables.apply',
           '            if end > self.width:\n',
           '            if end >= self.width:\n',
           "PageTables.apply refuses a sequence whose pages fill its row exactly (max_pages_per_seq pages), so a request reaching the last page of max_model_len fails its step with 'more than max_pages_per_seq'"),
    Mutant('cascade_items_rounded_down', 'chunkwise/kernels/cascade.py::cascade_groups',
           '    chunks = -(-np.diff(starts) // item_size)\n',
           '    chunks = np.diff(starts) // item_size\n',
           "cascade_groups counts each shared split's work items rounding down, so a shared split with fewer members than item_size (or the remainder past a multiple of it) gets no item: its members never attend to that split's keys, and cascade decode output is wrong whenever decodes share a whole split"),
    Mutant('cli_reports_a_shorter_output_as_identical', 'chunkwise/__main__.py::run',
           '    if first is None and len(tokens) == len(ref_tokens):\n',
           '    if first is None:\n',
           "python -m chunkwise prints 'identical: N tokens' when one engine's output is a strict prefix of the other's (e.g. one stopped early on EOS), instead of 'DIFFERENT: first divergence at ...'"),
    # ---- a fourth unplanted sample (2026-11-26, written by a helper who had not seen the tests, at 4d825dc): all
    # ten killed by the suite that met them (pinned stage, median 53 s under load)
    Mutant('sliding_window_mask_inclusive', 'chunkwise/kernels/attention_tile.py::attend_tiles',
           'mask = mask & (pos[None, :] > q_pos[:, None] - window)',
           'mask = mask & (pos[None, :] >= q_pos[:, None] - window)',
           'Rewrote the sliding-window mask of the shared KV tile loop as ">=" ("keys within window of the query"), '
           'so a sliding layer sees window + 1 keys instead of window: on sliding-window models (Mistral, Gemma 3) '
           'the fast engine\'s logits and tokens differ from the reference once a sequence is longer than the window.'),
    Mutant('gelu_tanh_constant_halved', 'chunkwise/kernels/activation.py::_act_and_mul_kernel',
           'z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)',
           'z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)',
           'Replaced the odd-looking constant in the fused GELU(tanh) with the textbook sqrt(2/pi), forgetting that the '
           'kernel computes x * sigmoid(2u), which needs 2 * sqrt(2/pi): every Gemma MLP activation is wrong, so '
           'Gemma 3 generates different tokens than the reference engine.'),
    Mutant('final_norm_drops_pending_post_ff_norm', 'chunkwise/engine/model.py::Model.tail',
           'x, _ = self._add_norm(state.h, state.residual, self.final_norm, self._pending(state.layer))',
           'x, _ = self._add_norm(state.h, state.residual, self.final_norm)',
           'When tidying the final norm call I dropped the `pending` argument, so the last layer\'s post-feed-forward '
           'norm (Gemma 3 sandwich norms) is never applied before the final norm: Gemma 3 logits and greedy tokens '
           'differ from the reference; other families are unaffected.'),
    Mutant('n_samples_share_one_seed', 'chunkwise/serve/protocol.py::_GenerationRequest.sampling_params',
           'seed=None if self.seed is None else self.seed + index, logprobs=logprobs,',
           'seed=self.seed, logprobs=logprobs,',
           'Forwarded the request seed to every sample as it is instead of seed + index, so a completion with n > 1 '
           'and a seed returns n identical choices instead of n different reproducible samples.'),
    Mutant('max_logprobs_bound_exclusive', 'chunkwise/limits.py::<module>',
           '_row("server_logprobs", 0, "max_logprobs", "server", "server"),',
           '_row("server_logprobs", 0, "max_logprobs", "server", "server", upper_inclusive=False),',
           'Made the upper bound of the logprobs check exclusive, so a request asking for exactly max_logprobs (20, what OpenAI allows) top logprobs gets a 400 "logprobs must be between 0 and 20" instead of its answer.'),
    Mutant('kv_pages_used_counts_cached_pages', 'chunkwise/engine/core.py::EngineCore.stats',
           'pool.num_pages - pool.num_free_pages',
           'pool.num_pages - len(pool.free_page_ids)',
           'Computed the used-pages gauge from the free list alone, forgetting that evictable prefix-cache pages are '
           'free for allocation too: after requests finish, /metrics keeps reporting their cached pages in '
           'chunkwise_kv_pages_used although no request holds them.'),
    Mutant('admit_past_max_num_seqs', 'chunkwise/engine/scheduler.py::Scheduler._admit',
           'and len(self.running) < self.engine_config.max_num_seqs:',
           'and len(self.running) <= self.engine_config.max_num_seqs:',
           'Off-by-one in the admission loop\'s running-sequence cap: the scheduler admits one sequence more than '
           'max_num_seqs, so with max_num_seqs=1 two requests run in the same step.'),
    Mutant('free_pages_head_first', 'chunkwise/engine/page_pool.py::PagePool.free',
           '        for page_id in reversed(seq.page_table):\n'
           '            page = self.pages[page_id]\n'
           '            if page.ref_count < 1:',
           '        for page_id in seq.page_table:\n'
           '            page = self.pages[page_id]\n'
           '            if page.ref_count < 1:',
           'Simplified free() to walk the page table in order instead of tail first, so a finished prompt\'s first '
           'page becomes the least recently used one and is evicted first: under memory pressure one eviction breaks '
           'the whole hash chain and a repeated prompt gets no prefix-cache hit (num_cached_tokens 0 instead of 32).'),
    Mutant('vocab_upper_bound_inclusive', 'chunkwise/limits.py::<module>',
           '"vocab_size", "request", "engine reference server cli", upper_inclusive=False),',
           '"vocab_size", "request", "engine reference server cli"),',
           'Off-by-one in the fast vocabulary bound check: a prompt holding token id == vocab_size passes validation instead of raising ValueError naming it, and then fails inside a step (finish_reason "error"; the reference engine raises IndexError; the server answers 500 instead of 400).'),
    Mutant('tiny_checkpoint_key_ignores_seed', 'chunkwise/checkpoints.py::tiny_checkpoint',
           'key = json.dumps({"v": _FACTORY_VERSION, "family": family, "seed": seed, "config": kw}, sort_keys=True)',
           'key = json.dumps({"v": _FACTORY_VERSION, "family": family, "config": kw}, sort_keys=True)',
           'Left the seed out of the tiny checkpoint cache key, so tiny_checkpoint(family, seed=1) returns the cached '
           'directory built for seed 0 (a stale cache entry): every seed gives the same weights and the same tokens.'),
    # ---- mixed-step CUDA graphs ---------------------------------------------------------------------------
    Mutant("mixed_graph_holds_fewer_decodes_than_the_step", "chunkwise/engine/cuda_graphs.py::StepGraphs.key_for",
           '        if prefill_rows + d > self.budget or d > self.rows:\n',
           "        if prefill_rows + d > self.budget:\n",
           "a mixed step with more decodes than the graphs hold gets a key with fewer decode slots (decodes dropped)"),
    Mutant('mixed_graph_decodes_not_moved_past_padding', 'chunkwise/engine/cuda_graphs.py::StepGraphs.stage.moved',
           '            return np.where(rows < real, rows, rows + (prefill_rows - real))',
           '            return np.where(rows < real, rows, rows)',
           "a mixed graph's staging keeps the sampled and pending rows where they were in the unpadded batch, so a "
           "decode's logits (or its pending id) come from a padding row once the prefill rows are padded"),
    Mutant('mixed_graph_decode_lens_unpadded', 'chunkwise/engine/cuda_graphs.py::StepGraphs.stage',
           '        lens[:d], lens[d:] = host.seq_lens[p:], 1',
           '        lens[:d], lens[d:] = host.seq_lens[:d], 1',
           "a graph step's decode lengths are taken from the start of the step's seq_lens (the prefilling "
           "sequences'), not after them, so in a mixed step each decode attends over another sequence's length"),
    # ---- the day's other new behaviour: graph row buckets, the streamed chunk writer, error types, config defaults
    Mutant('mixed_graph_rows_rounded_down', 'chunkwise/engine/cuda_graphs.py::row_bucket',
           '    return 16 if n <= 16 else 32 if n <= 32 else -(-n // ROWS_STEP) * ROWS_STEP',
           '    return 16 if n <= 16 else 32 if n <= 32 else n // ROWS_STEP * ROWS_STEP',
           "a mixed graph's row bucket rounds down to a multiple of 64, so a step whose rows are not a multiple finds "
           "no captured key and runs eagerly (or, where a key exists, the graph would be too small for its rows)"),
    Mutant('stream_chunk_finish_reason_unquoted', 'chunkwise/serve/app.py::_Reply._choice_json',
           '        reason = "null" if finish_reason is None else _json_str(finish_reason)',
           '        reason = "null" if finish_reason is None else finish_reason',
           "the streamed chunk writer puts the finish reason in as bare text, so the last event of every stream is "
           "not valid JSON"),
    Mutant('client_error_typed_as_server_error', 'chunkwise/serve/protocol.py::APIError.body',
           '"server_error" if self.status >= 500 else "invalid_request_error")',
           '"server_error" if self.status >= 400 else "invalid_request_error")',
           "a 4xx outside the error table (405 for a wrong method) is reported with OpenAI's type server_error"),
    Mutant('gemma_query_scalar_defaults_to_head_dim', 'chunkwise/model_config.py::ModelConfig.from_dict',
           '            scale = float(field("query_pre_attn_scalar")) ** -0.5',
           '            scale = float(d.get("query_pre_attn_scalar") or head_dim) ** -0.5',
           "a Gemma 3 config without query_pre_attn_scalar scales queries by head_dim, where transformers uses 256"),
    Mutant('left_out_eos_means_no_eos', 'chunkwise/model_config.py::ModelConfig.from_dict',
           '        eos = field("eos_token_id")',
           '        eos = d.get("eos_token_id")',
           "a config.json without eos_token_id gives no EOS at all (generation never stops on one), where "
           "transformers' config class has the family's default"),
    Mutant('integer_torch_dtype_accepted', 'chunkwise/weights.py::_to_dtype',
           '        if not dtype.is_floating_point:\n',
           '        if dtype is torch.bool:\n',
           "load_weights checks dtype names but lets an integer torch.dtype through, truncating every weight"),
    # ---- attention_backend="fa3" (its routing; FA3 itself runs on Hopper only) -------------------------------
    Mutant("fa3_backend_takes_a_blends_rows", "chunkwise/engine/model.py::Model._fa3",
           "        return self.fa3_prefill and not inp.explicit_positions\n",
           "        return self.fa3_prefill\n",
           "a blend's rows go to FA3 too, which takes each sequence's rows as its last positions: the blend's "
           "recomputed rows, scattered through the context, attend as if they ended it"),
    Mutant("fa3_backend_never_splits", "chunkwise/engine/model.py::Model._attention",
           "split=p <= PREFILL_SPLIT_ROWS)",
           "split=False)",
           "short prefill steps take FA3 in one pass, where chunkwise's kernel splits their context: a short chunk "
           "after a long context fills few SMs (one pass took 1.2-3.0x the split time on an H100)"),
    Mutant("fa3_backend_accepted_in_deterministic_mode", "chunkwise/engine_config.py::_check_attention_backend",
           "    if config.deterministic:\n        raise ValueError(\"attention_backend='fa3' does not combine",
           "    if False:\n        raise ValueError(\"attention_backend='fa3' does not combine",
           "deterministic mode takes FA3 for its prefill, whose bits its decodes (chunkwise's single pass) do not give"),
    Mutant("fa3_backend_not_passed_to_the_model", "chunkwise/engine/model_runner.py::ModelRunner.__init__",
           'fa3_prefill=config.attention_backend == "fa3")',
           "fa3_prefill=False)",
           "attention_backend='fa3' is validated but never reaches the model: every step takes chunkwise's kernel"),
    # ---- h48docs: the README's code runs (issue 47 part 2) -------------------------------------------------------
    Mutant("readme_composing_block_renames_a_chunk", "README.md::<module>",
           "doc_b = eng.register_chunk(",
           "doc_2 = eng.register_chunk(",
           "the README's composing-chunks example renames a variable it still uses further down, so a reader "
           "pasting it gets a NameError"),
    # ---- issue 48, part 7: the anchoring of this catalogue (tests/test_mutant_anchors.py) --------------------------
    Mutant("anchor_reindents_by_the_first_line_only", "scripts/mutants.py::_reindent",
           "base = max((w for w in levels if w <= width), default=min(levels))",
           "base = min(levels)",
           "an edit is re-indented by its first line's shift alone: in a file whose indentation changed unevenly "
           "its deeper lines land at the wrong depth"),
    Mutant("anchor_line_pattern_keeps_a_comment", "scripts/mutants.py::_fit",
           r'if re.fullmatch(r"[ \t]*(#.*)?" if src.python else r"[ \t]*", text[end:rest]):',
           r'if re.fullmatch(r"[ \t]*", text[end:rest]):',
           "a line pattern stops short of its line's comment: the comment stays behind the new code, whose newline "
           "is dropped"),
    Mutant("anchor_comments_count_as_code", "scripts/mutants.py::Source.__init__",
           "if t.type == tokenize.COMMENT:",
           "if t.type == tokenize.NL:",
           "comments are kept in the code a pattern is looked for in: a comment added inside a mutated statement "
           "loses its anchor"),
    Mutant("anchor_takes_the_outermost_function", "scripts/mutants.py::Source.innermost",
           "return min(holding)[2]",
           "return max(holding)[2]",
           "an old-format mutant is anchored in the largest span holding it (the module), not its own function"),
    Mutant("moved_function_taken_from_the_first_holder", "scripts/mutants.py::resolve",
           "found = [r for r in holders if len(sources.get(r).find(m.old, qual)) == 1]",
           "found = holders[:1]",
           "a function gone from its file is looked for in the first other file defining that name, whether or not "
           "it holds the pattern"),
    Mutant("anchor_ignores_where_the_exact_text_is", "scripts/mutants.py::anchor",
           "hits = [h for h in hits if at <= h[0] and h[1] <= at + len(old)]",
           "hits = hits",
           "an old-format text that only its indentation told apart from another is refused as ambiguous"),
    # the tests that name a mutant's function first (a catalogue run's order, not its verdicts)
    Mutant("named_first_drops_the_other_tests", "scripts/mutants.py::order_named_first",
           "items[:] = front + [item for item in items if id(item) not in seen]",
           "items[:] = front",
           "the tests naming a mutant's function are run instead of the selection, not before it: a bug they miss "
           "survives tests that would have killed it"),
    Mutant("named_first_limit_ignored", "scripts/mutants.py::order_named_first",
           "if len(named) > limit:",
           "if False:",
           "a name that half the suite mentions still moves those tests first: the smoke tier, which kills most "
           "bugs in a minute, waits behind them"),
    Mutant("named_first_forgets_the_recorded_killer", "scripts/mutants.py::order_named_first",
           """for item in [item for item in items if item.nodeid in first or item.nodeid.split("[")[0] in first] + named:""",
           "for item in named:",
           "the test that killed a mutant last time is not run first: a mutant the named tests miss waits for the "
           "whole smoke tier again"),
    Mutant("named_kernel_not_reached_through_its_launcher", "scripts/mutants.py::named",
           'bare = last.lstrip("_").removesuffix("_kernel")',
           'bare = last.lstrip("_")',
           "a Triton kernel's mutant looks for tests naming the kernel, which call its launcher: none move first"),
    # ---- h48layers (issue 48 parts 4 and 6): layers that point one way, an EngineConfig without side effects ----
    Mutant("collective_raises_the_executors_error", "chunkwise/engine/distributed/tensor_parallel.py::CollectiveGuard.issuing",
           '                raise RuntimeError(f"no collective is issued once {self.lost}")\n',
           "                from chunkwise.engine.executor.workers import TensorParallelError\n"
           '                raise TensorParallelError(f"no collective is issued once {self.lost}")\n',
           "a collective refused after its group was lost raises the executor's TensorParallelError, imported "
           "inside the function to dodge the import circle: the collectives reach up past the runner to the "
           "orchestration again, the tangle engine/parallel was"),
    Mutant("engine_config_resolves_its_checkpoint", "chunkwise/engine_config.py::EngineConfig.__post_init__",
           "        _check_tensor_parallel(self)\n",
           "        from chunkwise.checkpoints import resolve_model\n        resolve_model(self.model)\n"
           "        _check_tensor_parallel(self)\n",
           "EngineConfig checks its model while being built: building a config resolves the checkpoint (and builds "
           "or converts a built-in one), the side effect the engines' constructors alone should have"),
    Mutant("opened_config_skips_the_tensor_parallel_shape", "chunkwise/open_config.py::open_config",
           "    _check_tensor_parallel_shape(config.tensor_parallel_size, model_config)\n",
           "",
           "when the model-dependent checks moved out of EngineConfig, the tensor-parallel shape check was left "
           "behind: tensor_parallel_size=3 over 4 heads is accepted"),
    # ---- h49chat (issue 49 parts 1 and 4): composite prompts scheduled by the budget; chunks in chat -----------
    Mutant("composite_piece_boundary_splits_a_step", "chunkwise/requests.py::validate_requests",
           "        if mode != \"exact\" and pc is not None:\n            c = [len(tokens)]\n",
           "        if mode != \"exact\" and pc is not None:\n            c = [len(tokens)]\n"
           "        elif c is None and pc is not None:   # each piece its own prefill step\n"
           "            c = [piece.num_tokens for piece in pc]\n",
           "a composite prompt's piece boundaries still split its prefill: each piece runs as a step of its own "
           "(8 steps for 8 documents) instead of the budget-sized steps of the plain prompt of the same ids"),
    Mutant("chat_chunk_spliced_one_token_off", "chunkwise/serve/chat.py::splice_chat",
           "        start = hit.end()\n",
           "        start = hit.end() + 1   # past the placeholder\n",
           "the chat text after each chunk part starts one character past its placeholder: the token the template "
           "writes right after a chunk (its end-of-turn) is dropped or changed, so the spliced prompt is one token off "
           "the conversation's"),
    # ---- h47cpu (issue 47): the benchmarks' CPU tier through Engine.model_class, and the CLI's one-line usage errors
    # (killed by tests/test_bench_host.py and tests/test_cli.py)
    Mutant("stand_in_forward_without_place", "chunkwise/engine/stand_in_model.py::HashLogitsModel.forward",
           "def forward(self, inp: StepInputs, kv_caches: LayerCaches, place: bool = True) -> torch.Tensor:",
           "def forward(self, inp: StepInputs, kv_caches: LayerCaches) -> torch.Tensor:",
           "the stand-in forward keeps an older signature than Model.forward (no place=): a blend graph's forward "
           "of a host-only engine fails with a TypeError"),
    Mutant("bench_loop_misses_failed_steps", "benchmarks/bench_host.py::checked",
           '    failed = [o for o in outputs if o.finish_reason == "error"]',
           '    failed = [o for o in outputs if o.finish_reason == "failed"]',
           "the benchmark's step check looks for the wrong finish reason, so a step that fails every request passes "
           "and the prefill loop spins to its cap"),
    Mutant("bench_loop_one_step_past_its_cap", "benchmarks/bench_host.py::step_until",
           "    for _ in range(max_steps):\n",
           "    for _ in range(max_steps + 1):\n",
           "the benchmark's bounded loop takes one step more than its cap says"),
    Mutant("engine_ignores_its_model_class", "chunkwise/engine/llm_engine.py::Engine.__init__",
           "        self.core = EngineCore(config, self.model_class)",
           "        self.core = EngineCore(config)",
           "Engine.model_class is never passed to the core's executor: a host-only engine runs the real model's forward"),
    Mutant("usage_error_exits_2", "chunkwise/cli_parser.py::<module>",
           "USAGE_ERROR_STATUS = 1",
           "USAGE_ERROR_STATUS = 2",
           "a bad command-line argument exits with argparse's status 2, where README promises 1 for every CLI error"),
    Mutant("serve_parser_is_argparses_own", "chunkwise/serve/cli.py::parser",
           "    p = ArgumentParser(",
           "    p = argparse.ArgumentParser(",
           "serve's parser is argparse's own: a bad serve argument prints the usage block and exits 2"),
    # ---- merged from h48blend ----
    Mutant("row_plan_check_layer_keeps_no_fixed_rows", "chunkwise/engine/row_plan.py::step_rows",
           "            keep = (plan.num_fixed + plan.keep[plan.check_layers.index(layer)]\n",
           "            keep = (plan.keep[plan.check_layers.index(layer)]\n",
           "a check layer's keep count leaves out the plan's fixed rows: each blended prefill drops as many of its "
           "most deviating candidates as it has fixed rows, and a prefill of only fixed rows keeps none"),
    Mutant("blender_never_marks_blended_kv_approximate", "chunkwise/engine/blend/blender.py::Blender.approximate_from",
           "        return None if record is None or seq.num_preemptions else record.job.start\n",
           "        return None\n",
           "the blend package's record no longer tells the scheduler where a blended sequence's K/V stop being "
           "exact, so its approximate pages enter the prefix cache and serve later exact requests"),
    # ---- h47limits: limits declared once (chunkwise/limits.py), each moved by one step in a validator or the table ----
    Mutant('chunk_ids_checked_against_the_vocabulary_with_le', 'chunkwise/chunks.py::ChunkRegistry.chunk_ids',
           'bad = limit.first_outside(ids, vocab_size=vocab_size)',
           'bad = limit.first_outside(ids, vocab_size=vocab_size + 1)',
           "register_chunk (both engines, and the server's /v1/chunks) accepts a chunk holding token id vocab_size, which then fails inside a step (issue 47's sample: <= instead of <)"),
    Mutant('waiting_queue_refuses_a_request_that_exactly_fills_it', 'chunkwise/serve/app.py::_generate',
           'max_waiting=state.max_waiting)',
           'max_waiting=state.max_waiting - 1)',
           "the server answers 429 to a request whose samples exactly fill max_waiting (issue 47's sample)"),
    Mutant('top_k_of_the_whole_vocabulary_refused', 'chunkwise/limits.py::<module>',
           '_row("top_k", 0, "vocab_size", "request", "engine reference cli"),',
           '_row("top_k", 0, "vocab_size", "request", "engine reference cli", upper_inclusive=False),',
           'top_k=vocab_size (keep every token, spelled out) is refused as exceeding the vocabulary'),
    Mutant('server_accepts_n_zero', 'chunkwise/serve/protocol.py::_GenerationRequest.refuse_unsupported',
           'if not LIMIT["n"].admits(self.n):',
           'if not LIMIT["n"].admits(self.n + 1):',
           'a completion with n=0 is accepted and answered with no choices instead of a 400 naming n'),
    Mutant('exclusive_lower_bounds_admit_their_bound', 'chunkwise/limits.py::Limit.above_lower',
           'return lo is None or (lo <= value if self.lower_inclusive else lo < value)',
           'return lo is None or lo <= value',
           'every bound declared exclusive from below admits the bound itself: top_p=0 (nothing to sample from) and gpu_memory_utilization=0 are accepted'),
    Mutant('long_prompt_admits_the_vocabulary_size', 'chunkwise/limits.py::Limit.first_outside',
           'self.admits(int(a.max()), **context)',
           'self.admits(int(a.max()) - 1, **context)',
           "the vectorised check of a list's largest id is one off, so a prompt or chunk holding token id vocab_size passes validation and fails inside a step"),
    Mutant('max_graph_tokens_below_zero_accepted', 'chunkwise/limits.py::<module>',
           '_row("max_graph_tokens", 0, None, "config", ENGINES),',
           '_row("max_graph_tokens", -1, None, "config", ENGINES),',
           'max_graph_tokens=-1 is accepted (a negative graph budget) instead of refused naming it'),
    Mutant('max_prefill_tokens_with_decodes_zero_accepted', 'chunkwise/engine_config.py::EngineConfig.__post_init__',
           '_bounded_int("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes)',
           '_bounded_int("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes + 1)',
           'max_prefill_tokens_with_decodes=0 is accepted, so a step beside decodes can prefill nothing and a prompt waits while anything decodes'),
    Mutant('pin_cap_one_page_over', 'chunkwise/limits.py::pin_cap',
           'return int(max_pinned_fraction * num_pages)',
           'return int(max_pinned_fraction * num_pages) + 1',
           'register_chunk(pin=True) pins one page more than max_pinned_fraction of the pool allows'),
    Mutant('max_waiting_zero_accepted', 'chunkwise/serve/app.py::check_server_options',
           'if not is_int(value) or not LIMIT[name].admits(value):',
           'if not is_int(value) or not LIMIT[name].admits(value + 1):',
           'the server (and python -m chunkwise serve) accepts --max-waiting 0 (every request a 429) and --max-logprobs -1 (every logprobs request a 400) instead of refusing the option by name'),
    Mutant('waiting_check_written_outside_the_table', 'chunkwise/serve/app.py::_generate',
           'if not LIMIT["waiting_requests"].admits(state.loop.num_waiting() + len(samples), max_waiting=state.max_waiting):',
           'if state.loop.num_waiting() + len(samples) >= state.max_waiting:',
           "a check written by hand beside the table (as the sample's 429 bug was): refuses a request that exactly fills max_waiting"),
    # ---- merged from h48core ----
    Mutant("prefix_job_keeps_its_pages", "chunkwise/engine/core.py::EngineCore._prefixes_done",
           '            self.scheduler.abort(seq.seq_id, reason="stop")\n',
           "            self.scheduler.seqs.pop(seq.seq_id)\n",
           "a compute_prefix job that is done is forgotten without freeing its pages: every registered chunk or "
           "prefill_kv call leaks the pages of its prompt"),
    Mutant("prefix_job_done_at_launch", "chunkwise/engine/core.py::EngineCore._prefixes_done",
           "            if job is None or end < seq.num_prompt_tokens or seq.status is not SequenceStatus.RUNNING:\n",
           "            if job is None or seq.num_computed_tokens < seq.num_prompt_tokens "
           "or seq.status is not SequenceStatus.RUNNING:\n",
           "a prefix job counts as done once its last step is launched: under overlap scheduling that step's pages "
           "are not cached yet, so pinning the chunk fails"),
    Mutant("core_fit_unchecked", "chunkwise/engine/core.py::EngineCore.add_requests",
           '            self.scheduler.check_fits(seq, name=f"prompt {i}")\n',
           "            pass\n",
           "the core queues a request without checking it fits the pool (the scheduler no longer checks it again): "
           "a request that can never fit is queued and stalls the engine"),
    Mutant("stats_count_held_cached_pages_as_cached", "chunkwise/engine/core.py::EngineCore.stats",
           "pool.num_pages - pool.num_free_pages, len(pool.evictable), pool.num_pinned_pages)",
           "pool.num_pages - pool.num_free_pages, len(pool.cached), pool.num_pinned_pages)",
           "stats() counts every page in the prefix cache as cached (reusable), including pages requests or pins "
           "hold"),
    Mutant("output_processor_drops_the_exact_reuse_report", "chunkwise/engine/outputs.py::OutputProcessor._final",
           "report = final.chunk_reuse or reuse_report(tracked.pieces, final.num_cached_tokens)",
           "report = final.chunk_reuse",
           "the output processor passes on only the core's blend report: a composite prompt in exact mode gets no "
           "chunk_reuse report"),
    Mutant("serve_process_streams_lose_their_text", "chunkwise/serve/client.py::EngineClient._connect",
           "        self.outputs = OutputProcessor(frontend)\n",
           "        self.outputs = OutputProcessor(Frontend(frontend.engine_config, None, frontend.chunks))\n",
           "the server's side of an engine decodes nothing: the engine sends token ids only, so every "
           "streamed piece and every answer's text is empty"),
    Mutant("serve_process_unpin_forgets_the_pin", "chunkwise/serve/client.py::EngineClient._on_call_done",
           "            call.future.set_result(self._issue(call.ids, done.pinned if call.pin else None, call.context))\n",
           "            call.future.set_result(self._issue(call.ids, None, call.context))\n",
           "the server issues a chunk the engine process pinned without recording its pin, so DELETE /v1/chunks "
           "refuses to unpin it and its pages stay pinned for ever"),
    # session 29, lead: a temperature that vanishes in float32 is greedy (as in vLLM)
    Mutant("greedy_only_at_exactly_zero_temperature", "chunkwise/sampling.py::SamplingParams.greedy",
           "return self.temperature < GREEDY_TEMPERATURE", "return self.temperature == 0.0",
           "only temperature 0 is greedy: 5e-324 passes validation, reaches the sampler as 0.0 in float32 and the "
           "step fails with finish_reason 'error'"),
    # ---- h51tp (issue 51): the warm-up's one-pass prefill attention; the custom all-reduce on by default --------
    Mutant("warm_up_misses_one_pass_x16_sequences", "chunkwise/engine/model_runner.py::ModelRunner._one_pass_prefills",
           "[-(-need // 16) * 16, other]", "[other]",
           "the warm-up has no one-pass prefill of a multiple of 16 sequences: a real step of 16 prefills above "
           "PREFILL_SPLIT_ROWS compiles the attention kernel inside a user's step"),
    Mutant("custom_all_reduce_opt_in_again", "chunkwise/engine_config.py::EngineConfig",
           "custom_all_reduce: bool = True", "custom_all_reduce: bool = False",
           "the custom all-reduce is opt-in again: NVLink GPUs run every all-reduce through NCCL by default"),
    Mutant("custom_all_reduce_warns_off_cuda",
           "chunkwise/engine/distributed/tensor_parallel.py::TensorParallel.with_custom_all_reduce",
           'if self.device.type == "cuda":', "if True:",
           "every CPU (gloo) tensor-parallel engine warns that the default custom all-reduce is off, though it "
           "never runs there"),
    # ---- h50adapt: blend policy "adaptive" (issue #50 §2): kv-deviation's budget shared among the chunks ----
    Mutant("adaptive_places_split_evenly_among_chunks", "chunkwise/engine/row_plan.py::group_scores",
           "quotient = (sums[last] - sums[first]).float() / (2 * rank + 1).float()",
           "quotient = 1 / (2 * rank + 1).float()",
           "the fast engine's adaptive selection ignores how far each chunk's K/V moved: every chunk gets the same "
           "share of a check layer's places, a self-contained chunk as many as one that leans on the others"),
    Mutant("reference_adaptive_places_split_evenly_among_chunks", "chunkwise/reference/blend.py::apportioned",
           "total = deviation[idx].double().sum().float()",
           "total = torch.ones((), dtype=torch.float32, device=deviation.device)",
           "the reference's adaptive policy shares each check layer's places evenly among the chunks, whatever "
           "their deviation"),
    Mutant("adaptive_plan_selects_over_the_prompt_as_one", "chunkwise/engine/blend/planning.py::plan_blend",
           'groups = group if layers and params.policy == "adaptive" else None',
           "groups = None",
           "an adaptive blend plans no groups: the fast engine keeps kv-deviation's most deviating candidates of the "
           "whole prompt, not each chunk's share"),
    Mutant("blend_budget_grows_a_place_per_piece", "chunkwise/engine/blend/planning.py::plan_blend",
           "kept = kept_counts(params.recompute_ratio, n, num_layers)",
           "kept = tuple(k + len(pieces) for k in kept_counts(params.recompute_ratio, n, num_layers))",
           "a blend's check layers keep a place per piece on top of k(r_l): the recomputed total exceeds the budget r"),
    # issue #50 §3, the blend quality benchmark (benchmarks/bench_blend_quality.py and its parts)
    Mutant("quality_bootstrap_unpaired", "benchmarks/paired_bootstrap.py::paired_bootstrap",
           "    means = d[idx].mean(axis=1)\n",
           "    other = np.random.default_rng(seed + 1).integers(0, d.size, size=(resamples, d.size))\n"
           "    means = a[idx].mean(axis=1) - b[other].mean(axis=1)\n",
           "the bootstrap resamples the mode's tasks and exact's tasks independently (unpaired): the interval "
           "widens by the tasks' own spread and a 2-point difference can no longer be told from 0"),
    Mutant("quality_two_hop_answer_in_one_document", "benchmarks/quality_tasks.py::make_tasks",
           "two_hop_question(pool[record].key),\n                          manager_code(pool[profile])))",
           "two_hop_question(pool[record].key),\n                          pool[record].answer))",
           "a two-hop task's expected answer is the record's own access code: one document answers it, and the "
           "family no longer measures cross-chunk attention"),
    Mutant("quality_forcing_attends_padding", "benchmarks/padded_forcing.py::PaddedReference.attention",
           "allowed = j <= pos",
           "allowed = j < s",
           "batched teacher forcing lets every forced row attend the whole padded cache (later forced rows and "
           "the padding of shorter prompts): its log-probabilities are no longer the reference's extend"),
    # ---- h50ctx: chunks computed under a context (issue #50 §1) ----
    Mutant("conditioned_chunk_moved_by_its_start", "chunkwise/engine/blend/planning.py::plan_blend",
           "firsts[owner] - n_ctx[owner], layers, kept",
           "firsts[owner], layers, kept",
           "a chunk registered after a context is re-rotated by its new start, as an isolated chunk is, though its K "
           "already sit len(context) positions on: they land len(context) positions too far"),
    Mutant("reference_conditioned_chunk_moved_by_its_start", "chunkwise/reference/blend.py::blend_prefill",
           "placed_kv(model, k_var, v_var, start - n_ctx)",
           "placed_kv(model, k_var, v_var, start)",
           "the reference blend moves a conditioned chunk by its start instead of (start - context length)"),
    Mutant("variant_pages_looked_up_without_their_context", "chunkwise/engine/blend/blender.py::Blender._chain_pages",
           "ids = piece.context.token_ids + piece.chunk.token_ids",
           "ids = piece.chunk.token_ids",
           "blend mode looks a variant's pages up under the chunk's own ids alone: it places the isolated pages' "
           "K/V (or none) where the prompt's context asked for the conditioned ones"),
    Mutant("variant_chosen_without_matching_the_prompt", "chunkwise/chunks.py::ChunkRegistry.variant",
           "if n <= start and (best is None or n > len(best.token_ids)) and tuple(prompt_ids[:n]) == c.token_ids:",
           "if n <= start and (best is None or n > len(best.token_ids)):",
           "a chunk's variant is chosen by the longest registered context, whether or not the prompt opens with it: "
           "K/V computed after another context are placed as if after this one"),
    Mutant("register_chunk_computes_the_chunk_without_its_context", "chunkwise/engine/frontend.py::Frontend.chunk_job",
           "            request = self.requests([list(context.token_ids) + ids], PREFIX_PARAMS)[0]\n",
           "            request = self.requests([ids], PREFIX_PARAMS)[0]\n",
           "register_chunk(after=...) computes (and pins) the chunk alone: the pages of context + chunk are never "
           "cached, so neither exact nor blend mode finds the variant it names"),
    # ---- issue 48, one server driver (h48drv): the between-steps order, its transports, stop strings in the output
    # processor. Retired: serve_failed_submission_leaves_its_earlier_samples_queued (serve/engine_loop.py's
    # add_samples is gone: EngineClient.submit validates a whole submission before one Submit carries it, and the
    # core's add_requests queues all or none; its killing test, test_a_refused_sample_leaves_none_of_its_requests_
    # samples_queued, stays).
    Mutant("driver_aborts_after_submissions", "chunkwise/serve/driver.py::<module>",
           "_ORDER = {Stop: 0, Abort: 1, ComputeChunk: 2, Unpin: 2, Submit: 3}",
           "_ORDER = {Stop: 0, Abort: 4, ComputeChunk: 2, Unpin: 2, Submit: 3}",
           "between two steps the engine driver takes the server's aborts after its submissions, so new requests are "
           "fitted to a pool whose aborted requests still hold their pages"),
    Mutant("driver_waits_while_requests_run", "chunkwise/serve/driver.py::EngineDriver.run",
           "messages = self.transport.recv(wait=not self.core.has_unfinished())",
           "messages = self.transport.recv(wait=True)",
           "the engine driver waits for the server's next message even while requests run: every stream stalls "
           "until another request or abort arrives"),
    Mutant("thread_transport_keeps_one_message_per_take", "chunkwise/serve/engine_loop.py::_ThreadTransport.recv",
           "return list(_drained(self._inbox))",
           "return list(_drained(self._inbox))[-1:]",
           "the in-thread transport hands the engine driver only the last of the messages put since its last take: "
           "a submission, abort or chunk call arriving with another is lost and its client waits for ever"),
    Mutant("stop_string_aborts_one_step_late", "chunkwise/engine/llm_engine.py::Engine._step",
           "        self.outputs.process(self.core.step())\n        for rid in self.outputs.take_stopped():\n",
           "        stopped = self.outputs.take_stopped()\n        self.outputs.process(self.core.step())\n"
           "        for rid in stopped:\n",
           "a request a stop string ended is aborted in the core one step late: the core computes a token nobody "
           "receives, holding its pages a step longer"),
    # ---- h49graph: blend graphs (issue #49 §2: a blended prefill's whole step replays one CUDA graph) ----
    Mutant("blend_graph_stages_one_kept_row_too_many", "chunkwise/engine/blend_graphs.py::BlendGraphs.stage",
           "out[:len(segments)] = [n if k < 0 else k for _, n, k in segments]",
           "out[:len(segments)] = [n if k < 0 else k + 1 for _, n, k in segments]",
           "a blend graph stages each selecting segment's kept rows one too many: its check layers keep a row the "
           "eager step drops, and the rows after them attend to K/V the eager step never computed"),
    Mutant("blend_graph_stages_the_segments_shifted", "chunkwise/engine/blend_graphs.py::BlendGraphs.stage",
           "out[:before], out[before:] = np.repeat(np.arange(len(segments)), sizes)[:before], SEGMENTS - 1",
           "out[:before], out[before:] = np.repeat(np.arange(len(segments)), sizes)[1:before + 1], SEGMENTS - 1",
           "a blend graph stages each row's segment one row early: a segment's first row ranks in the one before it"),
    Mutant("blend_graph_holds_more_rows_than_its_budget", "chunkwise/engine/blend_graphs.py::BlendGraphs.key_for",
           "if real + d > self.max_rows or d > self.max_decodes:",
           "if real > self.max_rows or d > self.max_decodes:",
           "a blend graph takes a step whose prefill rows fit but whose decodes beside them do not: more rows than "
           "the graphs were sized for"),
    # (h49host: the chain's check became page generations, bumped where a page leaves the cache)
    Mutant("blend_chain_reused_while_its_pages_hold_other_tokens", "chunkwise/engine/page_pool.py::PagePool._take_page",
           "        del self.cached[page.key]\n        self.generation[page_id] += 1\n",
           "        del self.cached[page.key]\n",
           "evicting a page leaves its generation as it was, so a remembered chunk chain counts as still cached once "
           "its pages were evicted and taken by another prompt: a blend places that prompt's K/V as the chunk's"),
    # session 29, lead: a deviation that is rounding noise counts as 0 in both engines
    Mutant("blend_ranks_tokens_by_rounding_noise", "chunkwise/engine/model.py::Model._layers",
           "deviation = deviation.masked_fill(deviation <= noise, 0)",
           "deviation = deviation",
           "the fast engine ranks placed tokens by deviations that are rounding noise (a token past the sliding "
           "window has the same K/V computed twice): which of them an adaptive blend recomputes differs from the "
           "reference's choice"),
    # ---- h49host (issue #49 §2): a composed request's host work O(pieces): its ids as one array joined from its chunks'
    # arrays (killed by tests/test_chunks.py), chains checked by page generations (the mutant above, re-anchored)
    Mutant("composite_array_piece_one_token_off", "chunkwise/chunks.py::ChunkRegistry.ids_array",
           "parts.append(np.array(ids[start:start + p.num_tokens], np.int64))",
           "parts.append(np.array(ids[start + 1:start + 1 + p.num_tokens], np.int64))",
           "a composite prompt's id array takes each text or id piece one token late: the pool probes and caches, "
           "and the runner computes, ids the prompt does not hold"),
    Mutant("chunk_arrays_shared_by_length", "chunkwise/chunks.py::ChunkRegistry.ids_array",
           "a = self.arrays.get(p.chunk.chunk_id)\n                if a is None:\n"
           "                    a = self.arrays[p.chunk.chunk_id] = np.array(p.chunk.token_ids, np.int64)",
           "a = self.arrays.get(len(p.chunk))\n                if a is None:\n"
           "                    a = self.arrays[len(p.chunk)] = np.array(p.chunk.token_ids, np.int64)",
           "the chunks' id arrays are remembered by length: a prompt holding a chunk of the same length as one seen "
           "before computes (and caches under) that other chunk's ids"),
    Mutant("composite_array_admits_the_vocabulary_size", "chunkwise/tokenizer.py::encode_prompts",
           "            check_vocabulary(i, arrays[i], cfg)\n",
           "            pass\n",
           "a composite prompt's array is not checked against the vocabulary: an id piece holding vocab_size "
           "passes validation and fails inside a step"),
    Mutant("vocabulary_check_admits_the_vocabulary_size", "chunkwise/tokenizer.py::check_vocabulary",
           "PROMPT_TOKEN_ID.first_outside(ids, vocab_size=cfg.vocab_size)",
           "PROMPT_TOKEN_ID.first_outside(ids, vocab_size=cfg.vocab_size + 1)",
           "the prompt check takes a vocabulary one id larger: a prompt holding vocab_size passes validation and "
           "fails inside a step"),
    # ---- h48ci: CI under 15 minutes (issue #48): loadgroup keeps an xdist_group on one worker ----
    Mutant("xdist_groups_left_unsuffixed", "conftest.py::pytest_collection_modifyitems",
           "    _keep_xdist_groups(config, items)\n",
           "    pass\n",
           "the node ids are left without their @group suffix under pytest 9.2: --dist loadgroup schedules like "
           "load, the real checkpoints' tests run on both workers (two models in memory) and a group's module "
           "fixture runs once per worker"),
    # ---- session 30: a direct call on a served engine waits for the engine thread (EngineLoop.paused) ----
    Mutant("paused_takes_no_turn", "chunkwise/serve/engine_loop.py::EngineLoop.paused",
           "transport.take()\n            try:\n                yield self.engine\n            finally:\n"
           "                transport.give()",
           "transport.holder = threading.get_ident()\n            try:\n                yield self.engine\n"
           "            finally:\n                transport.holder = None",
           "paused() does not hold the engine thread: a direct generate steps the core beside it, with the server's "
           "request in flight, and each takes the other's outputs"),
    Mutant("served_engine_takes_a_direct_call", "chunkwise/engine/llm_engine.py::Engine._check_turn",
           "if self._turn_check is not None:",
           "if False:",
           "a served engine takes a direct generate from another thread while its engine thread steps it: the two "
           "step one core and each takes the other's outputs"),
    Mutant("stopped_loop_keeps_its_engine", "chunkwise/serve/engine_loop.py::EngineLoop.stop",
           "self.engine.hand_over(None)",
           "pass",
           "a stopped EngineLoop never gives its engine back: every later direct call is refused as if it were "
           "still served"),
]


def copy_tree(dest: Path, root: Path = ROOT) -> None:
    """The repository's files as git sees them (tracked, plus untracked ones not ignored) into dest."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


# ---- anchors: where a mutant lives, found again after the code around it moved on ----------------------------
MODULE = "<module>"
SEARCH_DIRS = ("chunkwise", "benchmarks", "tests", "scripts")   # where a function that left its file is looked for
_BLANK = re.compile(r"\s|\\\n")                                  # whitespace and line continuations


class AnchorError(ValueError):
    """A mutant whose anchor is gone: the message names the mutant and what is missing."""


def strip_comments(code: str) -> str:
    """`code` without its comments (and the spaces before them); a fragment may start or end inside a string."""
    out, quote, i = [], "", 0
    while i < len(code):
        c = code[i]
        if quote:
            if c == "\\":
                out.append(code[i:i + 2])
                i += 2
                continue
            if code.startswith(quote, i):
                out.append(quote)
                i += len(quote)
                quote = ""
                continue
            if c == "\n" and len(quote) == 1:
                quote = ""
        elif c in "'\"":
            quote = c * 3 if code.startswith(c * 3, i) else c
            out.append(quote)
            i += len(quote)
            continue
        elif c == "#":
            while out and out[-1] in " \t":
                out.pop()
            end = code.find("\n", i)
            i = len(code) if end < 0 else end
            continue
        out.append(c)
        i += 1
    return "".join(out)


class Source:
    """One file: its text, the span of every function, method and class by qualname, and the text with whitespace
    and comments left out (with each kept character's offset), where patterns are looked for. A file that is not
    Python (README.md) is one span, <module>, and its `#` is text."""

    def __init__(self, path: Path):
        self.path, self.python = path, path.suffix == ".py"
        self.text = path.read_text()
        starts = [0] + [n.end() for n in re.finditer("\n", self.text)] + [len(self.text)]   # of each line, as ast counts
        self.spans: dict[str, list[tuple[int, int]]] = {MODULE: [(0, len(self.text))]}
        blanked = list(self.text)
        if self.python:
            for qual, node in self._defs(ast.parse(self.text), ""):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                self.spans.setdefault(qual, []).append((starts[first - 1], starts[node.end_lineno]))
            for t in tokenize.generate_tokens(io.StringIO(self.text).readline):
                if t.type == tokenize.COMMENT:
                    start = starts[t.start[0] - 1] + t.start[1]
                    blanked[start:start + len(t.string)] = " " * len(t.string)
        kept = [c.start() for c in re.finditer(r"[^\s\\]|\\(?!\n)", "".join(blanked))]
        self.norm, self.offsets = "".join(self.text[i] for i in kept), kept

    @staticmethod
    def _defs(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield prefix + child.name, child
                yield from Source._defs(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):   # no def inside an expression
                yield from Source._defs(child, prefix)

    def code(self, pattern: str) -> str:
        """A pattern as it is matched in this file: without its comments, in Python."""
        return strip_comments(pattern) if self.python else pattern

    def find(self, pattern: str, qual: str = MODULE) -> list[tuple[int, int, int]]:
        """Every (start, end, at) where the normalised pattern occurs inside `qual`'s span(s): [start, end) in the
        text, from its first character of code to its last, and `at` in the normalised text."""
        needle, hits = _BLANK.sub("", self.code(pattern)), []
        for lo, hi in self.spans.get(qual, []):
            a, b = bisect.bisect_left(self.offsets, lo), bisect.bisect_left(self.offsets, hi)
            i = self.norm.find(needle, a, b)
            while needle and i >= 0:
                hits.append((self.offsets[i], self.offsets[i + len(needle) - 1] + 1, i))
                i = self.norm.find(needle, i + 1, b)
        return hits

    def levels(self, at: int, pattern: str) -> dict[int, int]:
        """Indentation in the (comment-free) pattern found at `at` -> indentation of the code there, from each
        pattern line that starts a line in both (the first one only when the pattern starts with indentation)."""
        found, k = {}, 0
        for j, line in enumerate(pattern.splitlines(keepends=True)):
            n, width = len(_BLANK.sub("", line)), len(line) - len(line.lstrip(" "))
            if n and (j or width):
                code = self.offsets[at + k]
                line_start = self.text.rfind("\n", 0, code) + 1
                if not self.text[line_start:code].strip():
                    found.setdefault(width, code - line_start)
            k += n
        return found

    def innermost(self, start: int, end: int) -> str:
        """The qualname of the smallest function, method or class holding [start, end), or <module>."""
        holding = [(hi - lo, q == MODULE, q) for q, spans in self.spans.items() for lo, hi in spans
                   if lo <= start and end <= hi]
        return min(holding)[2]     # a function as long as its file, rather than <module>


@dataclass(frozen=True)
class Resolved:
    """Where a mutant's pattern was found, and the file's text with the bug planted."""
    mutant: Mutant
    path: str          # the file it was found in (the mutant's own, or the one its function moved to)
    start: int         # the replaced span of the file's text
    end: int
    mutated: str

    @property
    def moved(self) -> bool:
        return self.path != self.mutant.path


class Sources:
    """Parsed files under one root, each parsed once."""

    def __init__(self, root: Path = ROOT):
        self.root, self._cache, self._files = root, {}, None

    def get(self, rel: str) -> Source:
        if rel not in self._cache:
            self._cache[rel] = Source(self.root / rel)
        return self._cache[rel]

    def defined(self, rel: str) -> set[str]:
        """The qualnames a file defines; none when it does not parse (a fixture, another Python's syntax)."""
        try:
            return set(self.get(rel).spans)
        except (SyntaxError, UnicodeDecodeError, tokenize.TokenError):
            return set()

    def others(self, rel: str) -> list[str]:
        """The Python files of SEARCH_DIRS and the root, but `rel`."""
        if self._files is None:
            files = [p for d in SEARCH_DIRS if (self.root / d).is_dir() for p in sorted((self.root / d).rglob("*.py"))]
            self._files = [p.relative_to(self.root).as_posix() for p in files + sorted(self.root.glob("*.py"))]
        return [r for r in self._files if r != rel]


def resolve(m: Mutant, sources: Sources | None = None) -> Resolved:
    """Find the mutant's pattern (exactly once) in its function and plant the bug, or raise AnchorError."""
    sources = sources or Sources()
    path, qual = m.path, m.function
    if "::" not in m.where:
        raise AnchorError(f"{m.name}: old format ({m.where!r} names no function): convert it with "
                          f"`python scripts/mutants.py --anchor`")
    if not _BLANK.sub("", m.old):
        raise AnchorError(f"{m.name}: its pattern is empty")
    exists = (sources.root / path).is_file()
    if not exists or qual not in sources.get(path).spans:     # moved? once elsewhere, with its pattern
        holders = [r for r in sources.others(path) if qual != MODULE and qual in sources.defined(r)]
        found = [r for r in holders if len(sources.get(r).find(m.old, qual)) == 1]
        if len(found) != 1:
            where = f"; it is in {len(holders)} other files ({', '.join(holders)}), holding its pattern once in " \
                    f"{len(found)}" if holders else ""
            gone = f"{path} has no function {qual}" if exists else f"{path} does not exist"
            raise AnchorError(f"{m.name}: {gone}{where}")
        path = found[0]
    src = sources.get(path)
    hits = src.find(m.old, qual)
    if len(hits) != 1:
        what = "no longer holds" if not hits else f"holds {len(hits)} times (needs exactly 1)"
        raise AnchorError(f"{m.name}: {qual} in {path} {what} its pattern {m.old!r}")
    start, end, new = _fit(src, *hits[0], src.code(m.old), m.new)
    mutated = src.text[:start] + new + src.text[end:]
    try:
        if src.python:
            compile(mutated, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise AnchorError(f"{m.name}: the edit leaves {path} invalid Python ({e.msg}, line {e.lineno})") from None
    return Resolved(m, path, start, end, mutated)


def _fit(src: Source, start: int, end: int, at: int, pattern: str, new: str) -> tuple[int, int, str]:
    """Widen the matched span [start, end) to the whitespace the pattern holds around its code, and fit `new` to
    it: a pattern that starts with indentation replaces from the start of its line; one that ends with a newline
    replaces through the end of its line (its comment too). `new`'s lines are re-indented as the pattern's lines
    were (8 -> 16 and 12 -> 24 in a file whose indentation doubled; a deeper line of `new` keeps its depth below
    the nearest level)."""
    text, levels = src.text, src.levels(at, pattern)
    lead = pattern[:len(pattern) - len(pattern.lstrip())]
    trail = pattern[len(pattern.rstrip()):]
    line_start = text.rfind("\n", 0, start) + 1
    if lead and "\n" not in lead and not text[line_start:start].strip():
        start, new = line_start, _reindent(new, levels)
    else:
        new = _reindent(new[len(lead):] if lead and new.startswith(lead) else new, levels, keep_first=True)
    if "\n" in trail:
        rest = text.find("\n", end)
        rest = len(text) if rest < 0 else rest
        if re.fullmatch(r"[ \t]*(#.*)?" if src.python else r"[ \t]*", text[end:rest]):
            return start, min(rest + 1, len(text)), new
    if trail and new.endswith(trail):
        new = new[:-len(trail)]
    return start, end, new


def _reindent(code: str, levels: dict[int, int], keep_first: bool = False) -> str:
    """`code` with each line's indentation mapped by `levels`: a width missing there keeps its distance above the
    nearest mapped width below it."""
    if all(a == b for a, b in levels.items()):
        return code
    out = []
    for j, line in enumerate(code.splitlines(keepends=True)):
        width = len(line) - len(line.lstrip(" "))
        if (j == 0 and keep_first) or not line.strip():
            out.append(line)
            continue
        base = max((w for w in levels if w <= width), default=min(levels))
        out.append(" " * max(0, levels[base] + width - base) + line[width:])
    return "".join(out)


def validate(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """One line per mutant whose anchor does not resolve exactly once in the tree at `root` (or whose edit would not
    compile), and per name used twice. A mutant whose function moved to another file resolves: see `moved`."""
    sources, problems = Sources(root), []
    for m in mutants:
        try:
            resolve(m, sources)
        except AnchorError as e:
            problems.append(str(e))
    names = [m.name for m in mutants]
    problems += [f"{n}: the name is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return problems


def moved(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """One line per mutant whose function is no longer in its file but, once, in another: update its path."""
    sources, notes = Sources(root), []
    for m in mutants:
        try:
            r = resolve(m, sources)
        except AnchorError:
            continue
        if r.moved:
            notes.append(f"{m.name}: moved: update path {m.path} -> {r.path} (`python scripts/mutants.py --anchor`)")
    return notes


def anchor(name: str, path: str, old: str, new: str, bug: str, sources: Sources | None = None) -> Mutant:
    """The anchored mutant for one written in the old format (`old` text in the file at `path`, found once there,
    or else once ignoring whitespace and comments): its innermost function, its pattern without comments (and
    with the lines before it where it needs them to be found once in that function). Raises AnchorError when the
    text is not found once, or when the anchored mutant would plant another file than the exact edit does."""
    sources = sources or Sources()
    src = sources.get(path)
    hits = src.find(old)
    exact = src.text.replace(old, new) if src.text.count(old) == 1 else None
    if exact is not None:
        at = src.text.index(old)
        hits = [h for h in hits if at <= h[0] and h[1] <= at + len(old)]
    if len(hits) != 1:
        raise AnchorError(f"{name}: {path} holds its old text {len(hits)} times (needs exactly 1): {old!r}")
    start, end, _ = hits[0]
    qual = src.innermost(start, end)
    pattern = src.code(old)
    line = src.text.rfind("\n", 0, start) + 1
    multi_line = "\n" in new.rstrip("\n")
    lead = pattern[:len(pattern) - len(pattern.lstrip())]
    if lead and not src.text[line:start].strip():       # it starts its line: at the line's own indentation
        new = _reindent(new, {len(lead): start - line})
        pattern, start = src.text[line:start] + pattern[len(lead):], line
        line = src.text.rfind("\n", 0, line - 1) + 1 if line else 0
    # A multi-line edit is re-indented from its first line's indentation, so it starts a line; a pattern found
    # more than once in its function (the exact text told them apart by indentation) takes the lines before it.
    while (multi_line and start > line) or len(src.find(pattern, qual)) > 1:
        if start == 0 or line < min(lo for lo, _ in src.spans[qual]):
            raise AnchorError(f"{name}: its old text is found more than once in {qual} whatever lines precede it")
        prefix = src.text[line:start]
        pattern, new, multi_line = src.code(prefix) + pattern, prefix + new, False
        start, line = line, src.text.rfind("\n", 0, line - 1) + 1 if line else 0
    m = Mutant(name, f"{path}::{qual}", pattern, new, bug)
    if exact is not None and resolve(m, sources).mutated != exact:
        raise AnchorError(f"{name}: anchored at {m.where}, it would plant another file than its exact edit")
    return m


def reanchor_catalogue(path: Path | None = None, root: Path = ROOT) -> list[str]:
    """Rewrite the catalogue file (this one) in place: every old-format entry of MUTANTS, `Mutant(name, path, old,
    new, bug)` with `old` an exact text of the file, becomes an anchored one (see `anchor`), and every mutant whose
    function moved to another file gets that file in its `where`. The other entries keep their text. Returns one
    line per entry rewritten and, after them, one per entry left as it was because it cannot be anchored (an
    old-format text not found once, an anchor lost: fix those by hand)."""
    path = path or Path(__file__).resolve()
    text = path.read_text()
    starts = [0] + [n.end() for n in re.finditer("\n", text)] + [len(text)]

    def offset(lineno: int, col: int) -> int:       # ast's columns count UTF-8 bytes
        line = text[starts[lineno - 1]:starts[lineno]]
        return starts[lineno - 1] + len(line.encode()[:col].decode())

    def span(node: ast.AST) -> tuple[int, int]:
        return offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset)

    def literal(s: str, node: ast.AST) -> str:
        return ("\n" + " " * node.col_offset).join(repr(part) for part in s.splitlines(keepends=True) or [""])

    def relocated(call: ast.Call, where: str) -> tuple[int, int, str]:    # the path argument, in its quotes,
        first, second = call.args[0], call.args[1]                        # on its own line when it is long
        start, end = span(second)
        quoted = text[start] + where + text[start]
        if offset(second.lineno, second.col_offset) - starts[second.lineno - 1] + len(quoted) + 1 <= 120:
            return start, end, quoted
        return span(first)[1], end, ",\n" + " " * first.col_offset + quoted

    (catalogue,) = [n.value for n in ast.parse(text).body if isinstance(n, ast.Assign)
                    and [getattr(t, "id", None) for t in n.targets] == ["MUTANTS"]]
    sources, edits, done, left = Sources(root), [], [], []
    for call in catalogue.elts:
        if len(call.args) != 5 or call.keywords:
            left.append(f"{ast.get_source_segment(text, call)[:60]}...: not five positional arguments: left as is")
            continue
        name, where, old, new, bug = (ast.literal_eval(a) for a in call.args)
        try:
            if "::" in where:
                r = resolve(Mutant(name, where, old, new, bug), sources)
                if r.moved:
                    edits.append(relocated(call, f"{r.path}::{r.mutant.function}"))
                    done.append(f"{name}: moved to {r.path}")
                continue
            m = anchor(name, where, old, new, bug, sources)
        except AnchorError as e:
            left.append(f"{e}: left as is")
            continue
        edits.append(relocated(call, m.where))
        edits += [(*span(call.args[i]), literal(v, call.args[i])) for i, v, was in ((2, m.old, old), (3, m.new, new))
                  if v != was]
        done.append(f"{name}: anchored at {m.where}")
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    path.write_text(text)
    return done + left


def apply(m: Mutant, tree: Path) -> None:
    """Plant mutant m in the copy of the repository at `tree`."""
    r = resolve(m, Sources(tree))
    (tree / r.path).write_text(r.mutated)


@dataclass
class Result:
    mutant: Mutant | None     # None: the baseline run
    verdict: str              # killed | SURVIVED | TIMEOUT | CRASHED
    first_failure: str        # the test that failed first (or what went wrong)
    seconds: float
    tail: str                 # the run's last lines, for a verdict other than killed
    stage: str = ""           # which run killed it: "pinned" (explicit examples only) or "full"
    message: str = ""         # the failing assertion's first line


# A pytest plugin for the pinned stage: loaded after conftest.py has chosen CI's profile and before the test
# modules are imported (their @settings inherit the phases), it keeps Hypothesis to the explicit examples.
PINNED_ONLY_PLUGIN = """
from hypothesis import Phase, settings

def pytest_configure(config):
    settings.register_profile("pinned-only", settings.get_profile("ci"), phases=[Phase.explicit])
    settings.load_profile("pinned-only")
"""


NAMED_FIRST_LIMIT = 40
# Each mutant's killing test from the runs so far (name -> node id), written after every run: run first next time.
KILLS = ROOT / "scripts" / "mutant_kills.json"


def mentions(item, names: list[str]) -> bool:
    """Whether a collected test's own code names one of `names` (as a whole word)."""
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, TypeError, OSError):
        return False
    return any(re.search(rf"\b{re.escape(n)}\b", source) for n in names)


def order_named_first(items: list, names: list[str], limit: int, first: tuple[str, ...] = ()) -> None:
    """The tests in `first` (node ids: the test that killed this mutant last time), then those whose code names
    what the mutant changes, run before the rest, which keep their order (the smoke tier first). Only the order
    changes, so only how soon a mutant dies; a name more than `limit` tests mention is too common to say where
    the bug would show, and moves nothing."""
    named = [item for item in items if mentions(item, names)] if names else []
    if len(named) > limit:
        named = []
    front, seen = [], set()
    # a recorded killer may be a parametrized test's base name (its id cut at "[": a parameter with a space in it)
    for item in [item for item in items if item.nodeid in first or item.nodeid.split("[")[0] in first] + named:
        if id(item) not in seen:
            seen.add(id(item))
            front.append(item)
    if front:
        items[:] = front + [item for item in items if id(item) not in seen]


# A pytest plugin for every stage: order_named_first over CHUNKWISE_MUTANT_FIRST's node ids (one a line) and the
# names in CHUNKWISE_MUTANT_NAMES (`named`), after conftest.py's own order.
NAMED_FIRST_PLUGIN = "\n\n".join([
    "import inspect\nimport os\nimport re\n\nimport pytest",
    inspect.getsource(mentions), inspect.getsource(order_named_first),
    "@pytest.hookimpl(trylast=True)\ndef pytest_collection_modifyitems(config, items):\n"
    "    names = [n for n in os.environ.get('CHUNKWISE_MUTANT_NAMES', '').split(',') if n]\n"
    "    first = tuple(n for n in os.environ.get('CHUNKWISE_MUTANT_FIRST', '').split('\\n') if n)\n"
    f"    order_named_first(items, names, {NAMED_FIRST_LIMIT}, first)\n"])


def load_kills() -> dict[str, str]:
    return json.loads(KILLS.read_text()) if KILLS.is_file() else {}


def record_kills(results: list) -> None:
    """Each killed mutant's first failing test into KILLS (kept for the mutants not run; a name the catalogue no
    longer holds is dropped)."""
    catalogued = {m.name for m in MUTANTS}
    kills = {name: test for name, test in load_kills().items() if name in catalogued}
    kills.update({r.mutant.name: r.first_failure for r in results if r.verdict == "killed"})
    KILLS.write_text(json.dumps(dict(sorted(kills.items())), indent=0) + "\n")


def named(m: Mutant) -> list[str]:
    """What a test would call to reach m's bug: its function's (or method's) name; for module-level code, the
    constants its pattern names."""
    owner, _, last = m.function.rpartition(".")
    if last == "<module>":
        return sorted(set(re.findall(r"\b[A-Z][A-Z0-9_]{3,}\b", m.old)))
    if last.startswith("__") and owner:               # a dunder: the class is what a test names
        return [owner.rpartition(".")[2]]
    bare = last.lstrip("_").removesuffix("_kernel")   # a Triton kernel is reached through its launcher
    return sorted({last, bare} - {""})


def failed_nodes(out: str) -> list[str]:
    """The node ids of a pytest -q summary's FAILED and ERROR lines, whole: a parametrized id may hold spaces, and
    the message follows " - "."""
    return re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, flags=re.M)


def run_selection(m: Mutant | None, timeout: float = DEFAULT_TIMEOUT, pinned_only: bool = False,
                  deselect: tuple[str, ...] = (), stop_first: bool = True, python: str = sys.executable,
                  smoke_only: bool = False) -> Result:
    """One pytest run of the CI selection on a copy of the tree with mutant m planted (None: as it is)."""
    name = m.name if m is not None else "baseline"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        if m is not None:
            apply(m, tree)
        env = dict(os.environ, CI="true", PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        env.pop("CHUNKWISE_HYPOTHESIS_PROFILE", None)    # CI's own profile, as in CI
        if m is not None:
            env["CHUNKWISE_MUTANT_NAMES"] = ",".join(named(m))
            env["CHUNKWISE_MUTANT_FIRST"] = load_kills().get(m.name, "")
        marks = f"{SMOKE_MARKER} and not gpu and not slow" if smoke_only else "not gpu and not slow"
        cmd = [python, "-m", "pytest", *SELECTION, "-q", "-p", "no:cacheprovider", "-m", marks]
        cmd += ["-x"] if stop_first else []
        cmd += [arg for node in deselect for arg in ("--deselect", node)]
        if pinned_only:
            (tree / "_mutants_pinned_only.py").write_text(PINNED_ONLY_PLUGIN)
            cmd += ["-p", "_mutants_pinned_only"]
        (tree / "_mutants_named_first.py").write_text(NAMED_FIRST_PLUGIN)
        cmd += ["-p", "_mutants_named_first"]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)     # pytest and anything it started
            out, _ = proc.communicate()
            return Result(m, "TIMEOUT", f"no failure within {timeout:.0f} s", time.monotonic() - start, out[-3000:])
        seconds = time.monotonic() - start
    stage = "smoke" if smoke_only else "pinned" if pinned_only else "full"
    failed = failed_nodes(out)
    if proc.returncode == 1 and failed:
        message = next(iter(re.findall(r"^E +(.+)$", out, flags=re.M)), "")
        return Result(m, "killed", " ".join(failed) if m is None else failed[0], seconds, "", stage, message[:300])
    if proc.returncode == 0:
        return Result(m, "SURVIVED", "", seconds, out[-3000:], stage)
    return Result(m, "CRASHED", f"pytest exit status {proc.returncode}", seconds, out[-3000:], stage)


def run_one(m: Mutant, timeout: float = DEFAULT_TIMEOUT, pinned_only: bool = False,
            deselect: tuple[str, ...] = (), smoke_only: bool = False) -> Result:
    """The pinned examples of the whole selection first (the smoke tier's first of all); the full selection (random
    draws too) only for a mutant they miss, unless pinned_only or smoke_only (the smoke tier's pinned examples
    alone). Seconds add up over both runs."""
    if smoke_only:
        return run_selection(m, timeout, pinned_only=True, deselect=deselect, smoke_only=True)
    first = run_selection(m, timeout, pinned_only=True, deselect=deselect)
    if pinned_only or first.verdict != "SURVIVED":
        return first
    full = run_selection(m, timeout, deselect=deselect)
    full.seconds += first.seconds
    return full


def table(results: list[Result]) -> str:
    rows = [("mutant", "verdict", "by", "first failing test", "seconds")]
    rows += [(r.mutant.name, r.verdict, r.stage if r.verdict == "killed" else "", r.first_failure, f"{r.seconds:.0f}")
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the catalogue and exit")
    ap.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]", help="run only these mutants")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (each is one pytest process)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per mutant")
    ap.add_argument("--pinned-only", action="store_true",
                    help="only the first stage: Hypothesis runs the @example-pinned cases (stateful tests none)")
    ap.add_argument("--smoke-only", action="store_true",
                    help="only the smoke tier's pinned examples (the first minute of the first stage)")
    ap.add_argument("--baseline", action="store_true",
                    help="first run the unmutated selection; deselect the tests that fail there")
    ap.add_argument("--deselect", action="append", default=[], metavar="NODEID",
                    help="a test left out of every run (e.g. one known to fail on this machine)")
    ap.add_argument("--anchor", action="store_true",
                    help="rewrite this file: anchor its old-format entries (name, path, exact old text, new, bug), "
                         "and give moved functions their new file; then exit")
    args = ap.parse_args(argv)
    if args.anchor:
        lines = reanchor_catalogue()
        print("\n".join(lines) if lines else "every entry is anchored already")
        return 2 if any(line.endswith(": left as is") for line in lines) else 0
    chosen = MUTANTS
    if args.only:
        names = [n for arg in args.only for n in arg.split(",") if n]
        unknown = sorted(set(names) - {m.name for m in MUTANTS})
        if unknown:
            ap.error(f"unknown mutants {unknown}; --list shows the catalogue")
        chosen = [m for m in MUTANTS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name:50} {m.where:70} {m.bug}")
        return 0
    problems = validate(chosen)
    if problems:
        print(f"{len(problems)} mutants have lost their anchor in this tree; update them in {__file__} (an "
              f"old-format one: --anchor):", file=sys.stderr)
        print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 2
    for note in moved(chosen):
        print(note, file=sys.stderr)
    deselect = tuple(args.deselect)
    if args.baseline:
        base = run_selection(None, args.timeout, pinned_only=args.pinned_only or args.smoke_only, deselect=deselect,
                             stop_first=False, smoke_only=args.smoke_only)
        if base.verdict == "killed":
            print(f"the unmutated tree fails {base.first_failure}: deselected from every mutant run", flush=True)
            deselect += tuple(base.first_failure.split())
        elif base.verdict != "SURVIVED":
            print(f"the unmutated tree's run ended {base.verdict}:\n{base.tail}", file=sys.stderr)
            return 1
        print(f"baseline: {base.seconds:.0f} s", flush=True)
    results = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:   # each verdict printed as it comes (a run cut short keeps them)
        runs = [pool.submit(run_one, m, args.timeout, pinned_only=args.pinned_only, deselect=deselect,
                            smoke_only=args.smoke_only) for m in chosen]
        for done in as_completed(runs):
            r = done.result()
            print(f"{r.mutant.name}: {r.verdict} {r.first_failure} ({r.seconds:.0f} s)", flush=True)
            if r.message:
                print(f"    {r.message}", flush=True)
            if r.verdict != "killed":
                print("    " + r.tail.replace("\n", "\n    ")[-2000:], flush=True)
            results.append(r)
    record_kills(results)
    print()
    print(table(results))
    alive = [r.mutant.name for r in results if r.verdict != "killed"]
    print(f"\n{len(results) - len(alive)} of {len(results)} killed" + (f"; not killed: {alive}" if alive else ""))
    return 1 if alive else 0


if __name__ == "__main__":
    sys.exit(main())
