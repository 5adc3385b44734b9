"""`pytest --benchmark-only` from the root runs benchmarks/ (and only benchmarks), while a plain test run
deselects them and says how to run them."""
from child_pytest import REPO, run_pytest


def collect(*args: str) -> list[str]:
    """pytest's --collect-only output from the repo root with `args`."""
    proc = run_pytest("--collect-only", "-q", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def test_benchmark_only_collects_the_benchmarks_and_nothing_else():
    ids = [line for line in collect("--benchmark-only") if "::" in line]     # no path: testpaths
    assert any(i.startswith("benchmarks/bench_host.py::") for i in ids)
    assert any(i.startswith("benchmarks/bench_kernels.py::") for i in ids)
    assert ids and all(i.startswith("benchmarks/") for i in ids), ids


def test_a_plain_test_run_deselects_the_benchmarks_and_says_so():
    lines = collect("-m", "not gpu and not slow", "benchmarks", "tests/test_config.py")
    ids = [line for line in lines if "::" in line]
    assert ids and not any(i.startswith("benchmarks/") for i in ids)
    assert any(line.startswith("benchmarks: ") and "deselected; run them with `pytest --benchmark-only`" in line
               for line in lines)


def test_ci_runs_the_cpu_tier_untimed_and_stops_on_its_failure_before_the_test_command():
    """.ci/run's pytest over benchmarks/bench_host.py (under set -e) selects its benchmarks: --benchmark-disable
    runs each body once, which a plain test run's deselection must not swallow."""
    script = (REPO / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in script
    runs = [line.split() for line in script if line.startswith(".venv/bin/python -m pytest")]
    tier = next(r for r in runs if "benchmarks/bench_host.py" in r)
    assert "--benchmark-disable" in tier and runs.index(tier) < len(runs) - 1
    ids = [line for line in collect(*(a for a in tier[3:] if a != "-q")) if "::" in line]
    assert ids and all(i.startswith("benchmarks/bench_host.py::") for i in ids), ids
