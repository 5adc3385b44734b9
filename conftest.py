"""Shared pytest set-up: the device, Triton's interpreter on CPU, Hypothesis profiles, the `gpu` marker,
and benchmarks/ running only under `--benchmark-only` (or `--benchmark-enable`, or `--benchmark-disable`: each
benchmark's body once, untimed, as CI runs the CPU tier)."""
import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported, so this must run before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_BENCHMARKS_DESELECTED = pytest.StashKey[int]()

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: derandomized and bounded so the suite fits CI's 15 minutes on 2 cores; tests scale it with their own
# max_examples, and properties whose examples take seconds run their @examples alone there (tests/draws.py's
# `costly`). Every property's @examples run besides the draws (and alone under scripts/mutants.py).
settings.register_profile("ci", derandomize=True, max_examples=4, print_blob=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("CHUNKWISE_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _benchmarks_wanted(config) -> bool:
    return any(config.getoption(name, False) for name in ("benchmark_only", "benchmark_enable", "benchmark_disable"))


def _deselect(config, items, drop) -> int:
    dropped = [item for item in items if drop(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not drop(item)]
    return len(dropped)


def _is_benchmark(config, item) -> bool:
    return item.path.is_relative_to(config.rootpath / "benchmarks")


# The smoke tier: the tests that kill the most realistic bugs soonest (every limit, streamed text, the pool and
# scheduler, every kernel in every dtype, parity's pinned edges, overlap, deterministic mode, cascade), cheapest
# first. They run first in any selection, so under -x most bugs fail in the first minute (their pinned examples
# take about 65 s on one core, and a minute more for the blend tail graphs' staging test); `-m smoke` runs them
# alone, as scripts/mutants.py --smoke-only does.
SMOKE = (
    # blend's plans and row selections on the host, no model, milliseconds: the adaptive policy's budget and shares
    "tests/test_blend_policy.py",
    "tests/test_row_plan.py",
    # blend mode's two planted bugs die here in seconds: a wrong re-rotation, rows attending past their position
    "tests/test_kernels_relocate.py::test_relocating_a_rotated_key_by_delta_rotates_it_to_its_new_position",
    "tests/test_kernels_positions.py::test_explicit_positions_match_reference_and_the_implicit_pass_bitwise_in_pinned_cases",
    # a split launch's arrival counts left behind: only a second launch on the same workspace shows it (3 s)
    "tests/test_kernels.py::test_a_split_launch_leaves_its_arrival_counts_at_zero_so_the_next_launch_on_its_workspace_merges",
    "tests/test_blend.py::test_a_remembered_chunk_chain_is_reused_while_cached_and_resolved_again_once_evicted",   # no model
    "tests/test_blend.py::test_a_token_not_recomputed_carries_its_chunks_own_kv_with_k_rotated_to_its_new_position",
    # a composite prompt's id array (the pool's bytes, the runner's ids): no model, milliseconds
    "tests/test_chunks.py::test_a_composite_prompts_id_array_is_its_ids_and_is_checked_against_the_vocabulary",
    # the README's Python blocks define every name they use (parsed, not run: milliseconds)
    "tests/test_readme.py::test_python_block_uses_only_names_it_or_its_section_defines",
    # whole files of unit tests against outside oracles (transformers' configs, warpers and models), milliseconds each
    "tests/test_config.py",
    "tests/test_sampling.py",
    "tests/test_checkpoints.py",
    "tests/test_reference_engine.py",
    "tests/test_reference_vs_hf.py",
    "tests/test_layers.py",   # the import graph against docs/ARCHITECTURE.md's layers: no engine runs
    "tests/test_engine_config.py",   # a config is a description; opening it builds the checkpoint
    "tests/test_cli.py::test_a_reference_output_that_is_a_strict_prefix_is_reported_different",
    "tests/test_serve.py::test_top_k_minus_one_and_zero_keep_every_token",
    # every request field the server parses, every EngineConfig limit, every CLI option: no model runs, milliseconds
    "tests/test_serve.py::test_each_sampling_field_reaches_the_engines_params_and_defaults_are_openais",
    "tests/test_serve.py::test_openai_fields_are_accepted_at_what_is_implemented_and_refused_past_it_naming_the_field",
    "tests/test_serve.py::test_a_completion_prompt_is_one_prompt_or_a_batch_as_openai_reads_it",
    "tests/test_serve.py::test_a_prompt_of_any_other_shape_is_a_400_naming_prompt",
    "tests/test_serve.py::test_a_field_of_the_wrong_type_is_a_400_naming_its_path",
    "tests/test_serve.py::test_chat_content_parts_join_and_a_part_other_than_text_is_named",
    "tests/test_limits_table.py::test_the_table_declares_exactly_the_specified_limits",
    "tests/test_limits_table.py::test_no_validator_compares_against_a_bound_outside_the_table",
    "tests/test_limits.py::test_each_engine_config_value_inside_its_limits_is_accepted_and_outside_refused_naming_it",
    "tests/test_limits.py::test_engine_config_defaults_resolve_as_documented_on_the_cpu",
    "tests/test_limits.py::test_the_default_cpu_pool_holds_every_running_sequence_at_full_length_below_the_cap",
    "tests/test_cli.py::test_each_sampling_option_reaches_both_engines_params",
    "tests/test_cli.py::test_serve_passes_every_engine_option_under_its_engine_config_name",
    "tests/test_cli.py::test_serve_passes_only_the_engine_options_given_its_serving_defaults_and_the_server_options",
    "tests/test_cli.py::test_a_bad_argument_is_one_line_naming_it_and_exit_status_1",
    # the benchmarks' CPU tier on tiny counts (a stand-in forward: no kernel runs), seconds
    "tests/test_bench_host.py",
    "tests/test_text.py::test_a_text_prompt_is_the_tokenizers_own_ids_with_the_special_tokens_it_adds",
    "tests/test_text.py::test_a_text_piece_or_chunk_is_the_tokenizers_ids_without_special_tokens",
    "tests/test_limits.py::test_the_kv_pool_of_every_dtype_holds_the_pages_its_memory_holds_and_refuses_one_more",
    "tests/test_text.py::test_special_tokens_decode_to_no_text_whole_or_streamed",
    "tests/test_limits.py::test_token_ids_inside_the_vocabulary_are_served_and_outside_refused",
    "tests/test_limits.py::test_a_stop_token_drawn_as_the_last_allowed_token_finishes_with_stop_on_both_engines",
    "tests/test_limits.py::test_logprobs_up_to_the_vocabulary_size_are_served_and_one_more_refused",
    "tests/test_limits.py::test_each_engine_argument_at_its_lower_bound_serves_and_one_below_is_refused",
    "tests/test_limits.py::test_a_request_of_exactly_max_model_len_runs_whatever_the_page_and_split_sizes",
    "tests/test_text.py::test_streamed_pieces_join_to_the_decoded_text_and_split_characters_arrive_whole",
    "tests/test_engine.py::test_bad_request_raises_value_error_naming_the_value",
    "tests/test_text.py::test_a_request_stopping_on_eos_has_no_eos_text_whole_or_streamed",
    # the server (one module-scoped server, about 2 s to start): logprobs at its max, a refused batched request
    "tests/test_serve.py::test_logprobs_up_to_the_servers_max_are_served_and_one_more_refused",
    "tests/test_serve.py::test_a_refused_sample_leaves_none_of_its_requests_samples_queued",
    # ... and what the server makes of a request: its defaults, a stop string's held-back text, logprobs' offsets
    "tests/test_serve.py::test_without_a_tokenizer_text_prompts_and_stop_strings_are_refused_and_tokens_named_by_id",
    "tests/test_serve.py::test_completion_logprobs_streamed_equal_whole_and_offsets_count_the_token_text",
    "tests/test_serve.py::test_chat_logprobs_without_top_logprobs_hold_each_tokens_own_and_no_top_list",
    "tests/test_serve.py::test_a_stop_string_alone_is_a_list_of_one_and_held_back_text_is_sent_when_the_request_ends",
    "tests/test_serve.py::test_temperature_defaults_to_one_and_top_k_and_top_p_reach_the_sampler",
    "tests/test_serve_chat_chunks.py::test_a_chunk_whose_edges_the_tokenizer_splits_anyway_gives_the_inlined_conversations_ids",
    "tests/test_page_pool.py",
    "tests/test_chunks.py::test_pieces_do_not_set_chunk_sizes_but_explicit_chunk_sizes_win",
    "tests/test_chunks.py::test_a_composite_whose_leading_chunk_is_cached_starts_where_the_cache_ends",
    "tests/test_chunks.py::test_a_pinned_system_chunk_is_reused_exactly_after_pressure_and_a_document_after_it",
    "tests/test_chunks.py::test_the_pin_cap_counts_pages_once_and_a_pin_leaving_a_queued_request_no_room_is_refused",
    "tests/test_blend.py::test_blended_kv_and_tokens_equal_the_reference_engines_blend",
    "tests/test_blend.py::test_a_blended_requests_pages_never_serve_an_exact_request",
    "tests/test_blend.py::test_blended_prefills_join_overlapped_decodes_and_every_request_gets_its_own_tokens",
    "tests/test_step_graphs.py::test_blended_steps_over_a_blend_graphs_static_inputs_give_the_eager_steps_bits_in_deterministic_mode",
    "tests/test_scheduler.py::test_every_request_produces_what_it_produces_alone",
    "tests/test_kernels_fused.py::test_rms_norm_matches_reference_with_and_without_residual",
    "tests/test_kernels_fused.py::test_rope_store_matches_reference_and_skips_padding_slots",
    "tests/test_kernels_fused.py::test_act_and_mul_matches_reference",
    "tests/test_deterministic.py::test_matmul_matches_reference_and_a_rows_bits_ignore_the_other_rows",
    "tests/test_kernels.py::test_paged_attention_matches_reference",
    "tests/test_kernels_split.py::test_split_kv_decode_matches_reference_and_single_pass",
    "tests/test_kernels_cascade.py::test_cascade_decode_is_bitwise_equal_to_split_kv_decode",
    "tests/test_parity.py::test_greedy_tokens_and_cached_kv_match_reference",
    "tests/test_parity.py::test_soft_capped_logits_give_hfs_logprobs_and_the_references_samples",
    "tests/test_async_scheduling.py::test_async_outputs_equal_sync_outputs",
    "tests/test_text.py::test_both_engines_decode_the_same_nonempty_text_and_streamed_text_joins_to_it",
    "tests/test_deterministic.py::test_deterministic_tokens_and_kv_are_bitwise_whatever_the_chunks_pages_batch_arrivals_and_preemption",
    "tests/test_deterministic.py::test_long_decodes_round_like_prefill",
    "tests/test_deterministic.py::test_attention_tiles_and_context_splits_by_mode_and_step",
    "tests/test_cascade_engine.py::test_cascade_decodes_equal_split_kv_and_the_reference",
)


# The tests that took over 40 s in a --durations run of the suite on a 2-core machine (2026-11-29), longest first:
# after the smoke tier they go to the xdist workers before the rest, so that no minute-long test starts last while
# the other worker idles.
HEAVY = (
    "tests/test_chunks.py::test_composites_equal_the_concatenated_ids_and_pinned_chunks_survive_pressure",
    "tests/test_real_checkpoints.py::test_engine_greedy_tokens_and_logprobs_match_hf",
    "tests/test_bench_serving.py",
    "tests/test_chunk_contexts.py::test_the_fast_engines_conditioned_blend_equals_the_references",
    "tests/test_parity.py::test_prefix_cache_reuses_exactly_the_full_pages_shared_with_an_earlier_request",
    "tests/test_parity.py::test_tokens_do_not_depend_on_chunking_or_page_size",
    "tests/test_limits.py::test_graph_buckets_from_any_max_num_seqs_stage_every_decode_batch_as_eager_steps_compute_it",
    "tests/test_serve_process.py::test_concurrent_clients_get_the_outputs_of_an_engine_of_this_process",
    "tests/test_step_graphs.py::test_mixed_steps_over_the_static_inputs_give_the_eager_steps_bits_in_deterministic_mode",
    "tests/test_serve.py::test_32_concurrent_clients_get_the_engines_own_outputs",
    "tests/test_chunk_contexts.py::test_a_prompt_opening_with_context_and_chunk_reuses_their_pages_exactly",
    "tests/test_chunks.py::test_a_composite_is_scheduled_as_the_plain_prompt_of_its_ids",
    "tests/test_kernels_positions.py::test_explicit_positions_match_reference_and_the_implicit_pass_bitwise",
)


def _tiers(item) -> tuple[int, int]:
    """An item's sort key: its place in SMOKE, then in HEAVY (the rest keep their order: the sort is stable)."""
    return _smoke_rank(item), _heavy_rank(item)


def _heavy_rank(item) -> int:
    """The item's place in HEAVY, or len(HEAVY) if it is not listed."""
    return _rank(item, HEAVY)


def _rank(item, tier: tuple[str, ...]) -> int:
    node = item.nodeid.split("[")[0]
    return next((i for i, s in enumerate(tier) if node == s or node.startswith(s + "::")), len(tier))


def _smoke_rank(item) -> int:
    """The item's place in SMOKE (cheapest first), or len(SMOKE) if it is not a smoke test."""
    return _rank(item, SMOKE)


def _keep_xdist_groups(config, items) -> None:
    """Under `--dist loadgroup`, suffix each node id with `@` and its xdist_group, where this pytest keeps the id.

    pytest-xdist's workers mark a group by setting `item._nodeid`; pytest 9.2 keeps the id in `item._id`, so
    that assignment is lost and loadgroup schedules like load: the real checkpoints' tests ran on both workers
    (two of their models in memory at once) and a module-scoped fixture of a group ran once per worker."""
    # a worker's own --dist is "no"; xdist sets its option `loadgroup` when the run's --dist is loadgroup
    if not getattr(config.option, "loadgroup", False) or not items or not hasattr(items[0], "_id"):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _smoke_rank(item) < len(SMOKE):
            item.add_marker(pytest.mark.smoke)
    # stable: the smoke tier first, in SMOKE's order; then the heaviest tests, longest first; the rest in
    # collection order
    items.sort(key=_tiers)
    _keep_xdist_groups(config, items)
    # benchmarks/ is collected (testpaths) so that `pytest --benchmark-only` finds it, but its items run
    # only when benchmarks are asked for: a plain test run stays the test suite.
    if not _benchmarks_wanted(config):
        config.stash[_BENCHMARKS_DESELECTED] = _deselect(config, items, lambda item: _is_benchmark(config, item))
    elif config.getoption("benchmark_only", False):
        # pytest-benchmark would skip each test without a benchmark, one summary line per file
        _deselect(config, items, lambda item: "benchmark" not in getattr(item, "fixturenames", ()))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    """Say what the benchmarks did: deselected in a test run; on a machine without a GPU, which tier ran
    and that it is not a performance figure; if none ran, why."""
    write = terminalreporter.write_line
    if config.stash.get(_BENCHMARKS_DESELECTED, 0):
        write(f"benchmarks: {config.stash[_BENCHMARKS_DESELECTED]} deselected; run them with "
              f"`pytest --benchmark-only`")
    if not _benchmarks_wanted(config):
        return
    ran = [r for r in terminalreporter.stats.get("passed", []) if r.nodeid.startswith("benchmarks/")]
    if not torch.cuda.is_available():
        write("benchmarks: no CUDA GPU here, so the GPU benchmarks (kernels, engine throughput) were skipped; "
              "what ran is the CPU tier (bench_host.py: host-side step overhead with the forward stubbed "
              "out), which is NOT a performance figure", yellow=True)
    if not ran:
        write("benchmarks: none ran (see the skip reasons above); this is not a benchmark result",
              red=True, bold=True)
