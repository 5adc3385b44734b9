"""benchmarks/bench_blend_quality.py and its parts (issue #50 §3), on the CPU: the paired bootstrap gives the
interval a known paired difference implies; the task families hold what they claim (a two-hop answer needs both
its documents, the easy family's answers are well formed, every answer is in one document); the configuration
table and its modes; batched teacher forcing equals the reference's `extend`; and the whole pipeline, on a tiny
model through the reference engine, holds its anchors (r = 1 is exact, r = 0 recomputes no chunk token, the
reference check agrees with itself) and writes its table, JSON and plot with the speed bench's TTFTs."""
import json
import random

import pytest
import torch

from benchmarks.bench_blend_quality import (CONFIGURATIONS, CONTEXTS, POLICIES, Configuration, main, missing,
                                            modes_for, speed_points, speed_ttft)
from benchmarks.padded_forcing import forced_logprobs
from benchmarks.paired_bootstrap import paired_bootstrap
from benchmarks.quality_tasks import (EASY_FAMILY, FAMILIES, POOL, SINGLE_HOP, make_pool, make_tasks,
                                      manager_code)
from chunkwise.reference import Engine


def test_a_known_paired_difference_gives_a_known_interval_side():
    exact = [i % 2 for i in range(100)]                        # half right, spread over the tasks
    mode = list(exact)
    for i in (1, 11, 21, 31, 41, 51):                           # six tasks right in exact, wrong in the mode
        mode[i] = 0
    got = paired_bootstrap(mode, exact, seed=3, resamples=2000)
    assert got.difference == pytest.approx(-0.06)
    # every paired difference is 0 or -1, so a resample's mean is <= 0, and < 0 unless it drew none of the six
    # (probability 0.94**100 < 0.3%): the whole interval lies below 0, and near the observed difference
    assert got.high < 0 and got.low > -0.13
    assert paired_bootstrap(mode, exact, seed=3, resamples=2000) == got
    same = paired_bootstrap(exact, exact, seed=3)              # paired: a mode equal to exact has no spread at all
    assert (same.difference, same.low, same.high) == (0, 0, 0)


def test_the_bootstrap_refuses_vectors_that_do_not_pair():
    with pytest.raises(ValueError, match=r"\(3,\), \(2,\)"):
        paired_bootstrap([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap([1], [0], level=1.5)


@pytest.mark.parametrize("seed", [0, 5])
def test_a_two_hop_answer_needs_both_its_documents(seed):
    pool = make_pool(seed)
    tasks = make_tasks(seed, 0, 40, pool)
    for t in tasks:
        record, profile = (pool[i] for i in t.sources)
        assert t.family == "two-hop" and set(t.sources) <= set(t.documents)
        assert (record.kind, profile.kind) == ("record", "manager")
        assert t.answer == manager_code(profile) and t.answer not in t.question
        assert t.answer not in record.text and t.answer in profile.text           # the code: only in the profile
        assert record.key in t.question and record.key not in profile.text        # the record: only in the record
        assert f"manager: {profile.key}\n" in record.text + "\n"                  # the link between them
        holding = [d for d in t.documents if t.answer.lower() in pool[d].text.lower()]
        assert holding == [t.sources[1]]
        named = [d for d in t.documents if pool[d].kind == "manager" and pool[d].key == profile.key]
        assert named == [t.sources[1]]
    assert len({t.sources for t in tasks}) > 20


@pytest.mark.parametrize("seed", [0, 2])
def test_every_single_hop_answer_is_in_exactly_one_document_and_the_easy_family_is_well_formed(seed):
    pool = make_pool(seed)
    assert [sum(d.kind == k for d in pool) for k in POOL] == list(POOL.values())
    tasks = make_tasks(seed, 30, 0, pool)
    assert [t.family for t in tasks] == [SINGLE_HOP[i % 3] for i in range(30)]
    for t in tasks:
        (target,) = t.sources
        assert target in t.documents and pool[target].kind == t.family
        holding = [d for d in t.documents if t.answer.lower() in pool[d].text.lower()]
        assert holding == [target]
        if t.family == EASY_FAMILY:   # five digits, no case to get wrong; the question names the sentence's vault
            assert t.answer.isdigit() and len(t.answer) == 5
            assert f"The passkey of the vault {pool[target].key} is {t.answer}." in pool[target].text
            assert t.question == f"What is the passkey of the vault {pool[target].key}?"
        elif t.family == "record":
            assert f"access code: {t.answer.lower()}" in pool[target].text and t.answer == t.answer.upper()


def test_tasks_are_seeded_and_vary():
    pool = make_pool(1)
    assert make_pool(1) == pool and make_pool(2) != pool
    tasks = make_tasks(1, 12, 6, pool)
    assert make_tasks(1, 12, 6, pool) == tasks and make_tasks(3, 12, 6, pool) != tasks
    assert {t.family for t in tasks} == set(FAMILIES)
    assert len({len(t.documents) for t in tasks}) > 2


def test_the_configuration_table_and_its_modes():
    assert {(c.context, c.policy) for c in CONFIGURATIONS} == {(c, p) for c in CONTEXTS for p in POLICIES}
    modes = modes_for(list(CONFIGURATIONS), [0, 0.15, 0.5])
    labels = [m.label for m in modes]
    assert labels[0] == "isolated r=0" and labels.index("conditioned r=0") == 1 + 2 * len(POLICIES)
    assert len(labels) == len(set(labels)) == 2 * (1 + 2 * len(POLICIES))
    assert [m.reuse.recompute_ratio for m in modes if m.ratio == 0] == [0, 0]

    class Registers:
        def register_chunk(self, prompt, pin=False):
            ...
    assert "no after=" in missing(Registers(), Configuration("conditioned", "kv-deviation"))
    assert missing(Registers(), Configuration("isolated", "kv-deviation")) is None
    assert "'no-such-policy'" in missing(Registers(), Configuration("isolated", "no-such-policy"))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_forcing_equals_the_reference_extend_per_prompt(tiny_ckpt, family):
    eng = Engine(tiny_ckpt(family, max_position_embeddings=4096), dtype="float32", device="cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 40, 17)]   # gemma's window is 8: it slides
    forced = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 1, 6)]
    kvs = [eng.prefill_kv(p) for p in prompts]
    for tokens, kv, got in zip(forced, kvs, forced_logprobs(eng.model, forced, kvs)):
        logits = eng.model.extend(torch.tensor(tokens), kv[0].shape[1], *kv)[0]
        torch.testing.assert_close(got, torch.log_softmax(logits.float(), -1), atol=1e-4, rtol=0)


def test_the_pipeline_holds_its_anchors_end_to_end_on_a_tiny_model(tiny_ckpt, tmp_path):
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"ttft": {"plain": {"ttft_ms": 16.0}, "exact": {"ttft_ms": 29.0},
                                          "blend r=0.15": {"ttft_ms": 16.3}, "chunk-heads r=0.15": {"ttft_ms": 10.9},
                                          "blend r=0.15, eager tail": {"ttft_ms": 20.0},
                                          "blend r=0.5, eager": {"ttft_ms": 21.0}}}))
    ckpt = tiny_ckpt("llama", max_position_embeddings=4096)
    got = main(["--model", str(ckpt), "--engine", "reference", "--device", "cpu", "--dtype", "float32",
                "--tasks", "3", "--two-hop-tasks", "1", "--docs", "2,2", "--ratios", "0,1", "--page-size", "1",
                "--configs", "isolated kv-deviation,isolated chunk-heads,conditioned adaptive", "--reference-tasks", "1",
                "--resamples", "200", "--speed-json", str(speed), "--out", str(tmp_path / "out")])
    results, summary = got["results"], got["summary"]
    assert list(results) == ["exact", "isolated r=0", "isolated kv-deviation r=1", "isolated chunk-heads r=1",
                             "conditioned r=0", "conditioned adaptive r=1"]
    exact = results["exact"]
    for label in ("isolated kv-deviation r=1", "isolated chunk-heads r=1", "conditioned adaptive r=1"):   # exact
        r = results[label]
        assert r["outputs"] == exact["outputs"] and r["recomputed_share"] == 1
        assert r["agree"] == r["answer_tokens"] and max(r["kl"]) < 1e-9
    none = results["isolated r=0"]
    assert none["recomputed_share"] == 0 and sum(none["kl"]) > 1e-6
    # documents computed after the real context and placed with no recompute: approximate past the first document
    conditioned = results["conditioned r=0"]
    assert conditioned["recomputed_share"] == 0 and sum(conditioned["kl"]) > 1e-6
    assert set(summary) == {"single-hop", *FAMILIES}
    assert summary["two-hop"]["exact"]["tasks"] == 1 and summary["single-hop"]["exact"]["tasks"] == 3
    assert summary["single-hop"]["exact"]["any_case_vs_exact"] == dict(difference=0, low=0, high=0)
    # the reference check against a reference engine of the same dtype: the same numbers
    assert all(a["top1_agreement"] == 1 and a["mean_kl"] < 1e-6 for a in got["agreement"]["modes"].values())
    assert set(got["agreement"]["modes"]) == {"exact", "isolated r=0", "conditioned r=0"}
    out = tmp_path / "out"
    table = (out / "bench_blend_quality.md").read_text()
    assert "### two-hop: 1 tasks" in table and "(the family exact mode should solve at >= 80%)" in table
    data = json.loads((out / "bench_blend_quality.json").read_text())
    assert len(data["results"]["exact"]["forced_right"]) == 4 and data["ttft_ms"]["exact"] == 29.0
    assert (out / "bench_blend_quality.png").stat().st_size > 0
    assert speed_points(speed_ttft(speed)) == {"kv-deviation": [(0.15, 16.3)], "chunk-heads": [(0.15, 10.9)]}
