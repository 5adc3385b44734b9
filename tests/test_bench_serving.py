"""benchmarks/bench_serving.py, run end to end on CPU (a tiny Qwen3, 6 requests at one rate, both modes, the server
in this process over an engine process, its clients in two children): every request gets exactly its output length
in both modes, the reported numbers agree with each other and with each request's own, the greedy tokens over HTTP
are the engine run's, and the JSON, table and plot are written. Its summary's arithmetic and its workload are
checked on their own too."""
import importlib.util
import json

import numpy as np
import pytest

from benchmarks.bench_serving import Trace, Workload, main, parse_args, summarize

# One run of the benchmark (about 20 s on one core) serves the module: its tests stay on one xdist worker.
pytestmark = pytest.mark.xdist_group("bench_serving")

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
NUM, INPUT, OUTPUT, SEED = 6, (8, 24), (3, 4), 0
# A high rate: every request has arrived by the second step, so each run ends in decode-only steps.
ARGS = ["--device", "cpu", "--dtype", "float32", "--num-requests", str(NUM), "--input-len-range", "%d,%d" % INPUT,
        "--output-len-range", "%d,%d" % OUTPUT, "--rates", "200", "--seed", str(SEED), "--warmup-requests", "1",
        "--check-requests", str(NUM), "--decode-batches", "2", "--decode-steps", "2", "--client-processes", "2"]


@pytest.fixture(scope="module")
def bench(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_serving")
    results = main(["--model", str(ckpt), *ARGS, "--out", str(out), *([] if HAS_MATPLOTLIB else ["--no-plot"])])
    return results, out


def quantile_dicts(run: dict):
    return [run[k] for k in ("ttft_ms", "itl_ms", "e2e_ms")]


def test_every_request_gets_exactly_its_output_length_in_both_modes(bench):
    results, _ = bench
    expected = Workload.draw(NUM, INPUT, OUTPUT, 100, SEED).output_lens.tolist()   # lengths ignore the vocabulary
    assert [(r["mode"], r["rate"]) for r in results["runs"]] == [("engine", 200.0), ("http", 200.0)]
    for run in results["runs"]:
        assert [r["tokens"] for r in run["per_request"]] == expected, run["mode"]
        assert run["tokens"] == sum(expected) and run["requests"] == NUM


def test_percentiles_are_ordered_and_the_maxima_are_the_requests_own(bench):
    results, _ = bench
    for run in results["runs"]:
        for q in quantile_dicts(run):
            assert 0 < q["p50"] <= q["p90"] <= q["p99"] <= q["max"], (run["mode"], q)
        per = run["per_request"]
        assert run["ttft_ms"]["max"] == max(r["ttft_ms"] for r in per)
        assert run["e2e_ms"]["max"] == max(r["e2e_ms"] for r in per)
        assert run["itl_ms"]["max"] == max(r["itl_max_ms"] for r in per)
        assert all(r["ttft_ms"] < r["e2e_ms"] and r["itl_p99_ms"] <= r["itl_max_ms"] for r in per)


def test_throughput_is_tokens_over_the_time_from_the_first_arrival_to_the_last_token(bench):
    results, _ = bench
    for run in results["runs"]:
        assert run["output_tokens_per_s"] == pytest.approx(run["tokens"] / run["duration_s"])
        last = max(r["arrival_s"] + r["e2e_ms"] / 1e3 for r in run["per_request"])
        assert run["duration_s"] == pytest.approx(last)
        assert run["per_request"][0]["arrival_s"] == 0


def test_goodput_is_the_share_of_requests_meeting_both_targets(bench):
    results, _ = bench
    for run in results["runs"]:
        g = run["goodput"]
        good = sum(r["ttft_ms"] <= g["ttft_target_ms"] and r["itl_p99_ms"] <= g["itl_target_ms"]
                   for r in run["per_request"])
        assert 0 <= g["fraction"] <= 1 and g["fraction"] == good / NUM
        assert g["requests_per_s"] == pytest.approx(good / run["duration_s"])
        assert (g["ttft_target_ms"], g["itl_target_ms"]) == (200, 50)


def test_greedy_tokens_over_http_are_the_engine_runs(bench):
    results, _ = bench
    assert results["greedy_check"] == dict(requests=NUM, identical=NUM, differing=[])


def test_decode_only_step_time_is_measured_in_each_run_and_standalone(bench):
    """The HTTP run's from the engine process's own record, as the engine run's from this process's."""
    results, _ = bench
    for run in results["runs"]:
        assert run["decode_steps"] >= 1 and 0 < run["decode_step_ms"] <= run["decode_step_p99_ms"], run["mode"]
        assert 1 <= run["decode_batch_median"] <= NUM and run["compiles"] == 0
        # every step of the run, and only those: each request's first token needs a prefill step
        assert sum(run["launches"].values()) == run["steps"] and run["launches"].get("mixed eager", 0) >= 1
        # steps with prefill rows: the runner's "mixed" launches also count decodes through paged_attention's rows
        # (on CPU, decodes of fewer than split_kv_threshold tokens)
        mixed = sum(n for kind, n in run["launches"].items() if kind.startswith("mixed"))
        assert 1 <= run["mixed_steps"] <= mixed and 0 < run["mixed_step_ms"]["p50"] <= run["mixed_step_ms"]["p99"]
    [window] = results["decode_windows"]
    assert window["sequences"] == 2 and window["all_decode"] and window["step_ms"] > 0
    assert window["tokens_per_s"] == pytest.approx(2 / (window["step_ms"] / 1e3))


def test_the_http_runs_server_receipts_hold_every_gap_between_a_requests_tokens(bench):
    """One receipt per token at the server's receipt: a request of n tokens has n - 1 gaps there, as at its client."""
    results, out = bench
    [run] = [r for r in results["runs"] if r["mode"] == "http"]
    q = run["server_receipt_itl_ms"]
    assert q["gaps"] == run["tokens"] - run["requests"] == sum(r["tokens"] - 1 for r in run["per_request"])
    assert 0 < q["p50"] <= q["p90"] <= q["p99"] <= q["max"]
    assert "engine" not in {r["mode"] for r in results["runs"] if "server_receipt_itl_ms" in r}
    assert f"200 req/s p50 / p90 / p99 / max {q['p50']:.1f} / " in (out / "bench_serving.md").read_text()


def test_the_json_holds_what_main_returned_and_the_table_has_a_row_per_run(bench):
    results, out = bench
    assert json.loads((out / "bench_serving.json").read_text()) == json.loads(json.dumps(results))
    table = (out / "bench_serving.md").read_text()
    assert table.count("| engine | 200 |") == 1 and table.count("| http | 200 |") == 1
    assert results["config"]["max_prefill_tokens_with_decodes"] == 256   # chunkwise serve's default, as served
    for run in results["runs"]:   # the bar's ratio, from the run's own numbers
        assert f"| {run['itl_ms']['p99'] / run['decode_step_ms']:.2f}x |" in table
    assert f"Greedy check: {NUM} of {NUM} requests" in table


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the plot needs matplotlib (pip install -e '.[bench]')")
def test_the_plot_is_written_as_a_png(bench):
    _, out = bench
    assert (out / "bench_serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_of_known_traces():
    # Arrivals at 0: A has TTFT 100 ms and gaps of 20 ms; B TTFT 300 ms (one token, no gap); C TTFT 50 ms but a 100 ms
    # gap. Targets 200 / 50 ms: only A is good; with 301 / 100 ms all are (B's missing ITL meets any target).
    traces = [Trace(10.0, [10.1, 10.12, 10.14]), Trace(10.0, [10.3]), Trace(10.0, [10.05, 10.15, 10.16])]
    s = summarize(traces, 10.0, ttft_target_ms=200, itl_target_ms=50)
    assert s["goodput"]["fraction"] == pytest.approx(1 / 3) and s["duration_s"] == pytest.approx(0.3)
    assert s["tokens"] == 7 and s["output_tokens_per_s"] == pytest.approx(7 / 0.3)
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["ttft_ms"]["max"] == pytest.approx(300)
    assert s["itl_ms"]["max"] == pytest.approx(100) and s["itl_ms"]["p50"] == pytest.approx(20)
    assert s["per_request"][1]["itl_p99_ms"] is None
    assert [r["e2e_ms"] for r in s["per_request"]] == pytest.approx([140, 300, 160])
    loose = summarize(traces, 10.0, ttft_target_ms=301, itl_target_ms=100)
    assert loose["goodput"]["fraction"] == 1


def test_workload_is_seeded_and_runs_share_lengths_and_arrival_pattern_not_prompt_ids():
    w = Workload.draw(50, (4, 9), (2, 5), 1000, seed=3)
    assert np.array_equal(w.prompt_lens, Workload.draw(50, (4, 9), (2, 5), 1000, seed=3).prompt_lens)
    assert not np.array_equal(w.prompt_lens, Workload.draw(50, (4, 9), (2, 5), 1000, seed=4).prompt_lens)
    slow, fast, other = w.requests(2.0, run=1), w.requests(8.0, run=1), w.requests(2.0, run=2)
    assert [r.prompt for r in slow] == [r.prompt for r in fast] != [r.prompt for r in other]
    assert [len(r.prompt) for r in slow] == [len(r.prompt) for r in other] == w.prompt_lens.tolist()
    assert [r.output_len for r in other] == w.output_lens.tolist() and set(w.output_lens) == {2, 3, 4, 5}
    assert [4 * r.arrival for r in fast] == pytest.approx([r.arrival for r in slow])
    assert all(3 <= t < 1000 for r in other for t in r.prompt) and slow[0].arrival == 0
    gaps = np.diff([r.arrival for r in w.requests(1.0, run=1)])
    assert 0.6 < gaps.mean() < 1.5 and gaps.min() >= 0   # exponential gaps of mean 1 at 1 req/s


@pytest.mark.parametrize("args, message", [(["--rates", "8,0"], "'8,0'"), (["--input-len-range", "9,3"], "'9,3'"),
                                           (["--modes", "engine,grpc"], "'engine,grpc'"),
                                           (["--max-model-len", "100"], "--max-model-len 100"),
                                           (["--client-processes", "0"], "--client-processes must be >= 1, got 0")])
def test_a_bad_value_is_refused_before_anything_runs_naming_it(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args + ["--no-plot"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_one_client_process_is_allowed():
    assert parse_args(["--client-processes", "1", "--no-plot"]).client_processes == 1


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    text = capsys.readouterr().out
    assert exc.value.code == 0
    assert all(o in text for o in ("--rates", "--ttft-target-ms", "--max-num-batched-tokens", "Poisson"))
