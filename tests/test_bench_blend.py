"""benchmarks/bench_blend.py's CPU-side parts: its task generator is seeded and every answer lies in exactly one
document; its prompts are the pieces it says; and its metrics, run end to end on a tiny model through the reference
engine, hold their anchors (exact against itself and r = 1 agree fully, r = 0 recomputes no chunk token); and
benchmarks/blend_ceiling.py recomputes the tokens its oracle picks, a full recompute at ratio 1."""
import pytest
import torch

from benchmarks.bench_blend import (DOCS_PER_TASK, POOL_SIZE, SEPARATOR, ByteTokenizer, Framing, build_prompts,
                                    make_pool, make_tasks, run, without_last_token)
from chunkwise.chunks import Blend, Chunk
from chunkwise.reference import Engine


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_generator_is_seeded_and_seeds_differ(seed):
    assert make_pool(seed) == make_pool(seed)
    assert make_tasks(seed, 12) == make_tasks(seed, 12)
    assert make_pool(seed) != make_pool(seed + 100)
    assert make_tasks(seed, 12) != make_tasks(seed + 100, 12)


@pytest.mark.parametrize("seed", range(6))
def test_every_answer_is_in_exactly_one_document_of_the_pool_and_of_its_task(seed):
    pool = make_pool(seed)
    assert len(pool) == POOL_SIZE
    assert len({d.answer for d in pool}) == POOL_SIZE and len({d.question for d in pool}) == POOL_SIZE
    for task in make_tasks(seed, 30, pool):
        assert DOCS_PER_TASK[0] <= len(task.documents) <= DOCS_PER_TASK[1]
        assert len(set(task.documents)) == len(task.documents) and task.target in task.documents
        holding = [d for d in task.documents if task.answer.lower() in pool[d].text.lower()]
        assert holding == [task.target]
        assert (task.question, task.answer) == (pool[task.target].question, pool[task.target].answer)
        assert task.answer == task.answer.upper()


def test_documents_are_of_every_kind_and_tasks_vary_in_size_and_order():
    pool = make_pool(0)
    kinds = [next(k for k in ("access code", "passkey", "constant") if k in d.question) for d in pool]
    assert {k: kinds.count(k) for k in set(kinds)} == {"access code": 7, "passkey": 7, "constant": 6}
    tasks = make_tasks(0, 40, pool)
    assert {len(t.documents) for t in tasks} == set(range(DOCS_PER_TASK[0], DOCS_PER_TASK[1] + 1))
    assert any(list(t.documents) != sorted(t.documents) for t in tasks)


def test_a_prompt_is_the_framing_the_system_chunk_and_the_documents_between_separators(reference_engine):
    eng = reference_engine("qwen3")
    tok = ByteTokenizer()
    pool, tasks = make_pool(3), make_tasks(3, 2)
    prompts, answers = build_prompts(eng, tok, pool, tasks)
    framing = Framing(tok, eng.model_config.bos_token_id)
    for prompt, answer, task in zip(prompts, answers, tasks):
        chunks = [p for p in prompt if isinstance(p, Chunk)]
        assert [tok.decode(c.token_ids) for c in chunks[1:]] == [pool[d].text for d in task.documents]
        assert prompt[0] == [eng.model_config.bos_token_id] and prompt[2] == framing.encode(SEPARATOR)
        assert tok.decode(prompt[-1]).endswith(f"Question: {task.question}\nAnswer:")
        assert tok.decode(answer) == task.answer
        head, last = without_last_token(prompt)
        assert head[:-1] == prompt[:-1] and head[-1] + [last] == prompt[-1]


def test_metrics_hold_their_anchors_end_to_end_on_a_tiny_model(tiny_ckpt):
    # page size 1: every chunk token is stored, so r = 0 recomputes none of them (with pages, a chunk's tail would be)
    eng = Engine(tiny_ckpt("llama", max_position_embeddings=4096), dtype="float32", device="cpu", page_size=1)
    tok = ByteTokenizer()
    pool, tasks = make_pool(0), make_tasks(0, 1)
    prompts, answers = build_prompts(eng, tok, pool, tasks)
    seen = []
    results = run(eng, eng.model, tok, tasks, prompts, answers, [Blend(0.0), Blend(1.0, "chunk-heads"), "exact"],
                  on_mode=lambda r: seen.append(list(r)))
    # once, with every mode's metrics: agreement needs exact mode's cache, computed after every blend (on the fast
    # engine exact mode's pages enter the prefix cache, and a blend after it would find the whole prompt there)
    assert seen == [["kv-deviation r=0", "chunk-heads r=1", "exact"]]
    exact, full, none = results["exact"], results["chunk-heads r=1"], results["kv-deviation r=0"]
    assert exact["top1_agreement"] == 1 and exact["mean_kl"] == 0 and exact["max_abs_delta_logprob"] == 0
    assert full["top1_agreement"] == 1 and full["mean_kl"] < 1e-9 and full["max_abs_delta_logprob"] < 1e-4
    assert full["outputs"] == exact["outputs"] and full["accuracy"] == exact["accuracy"]
    assert none["recomputed_share"] == 0 and full["recomputed_share"] == 1
    assert none["mean_kl"] > 1e-6, "composing chunks without recompute changed nothing on a random model"


def test_the_selection_ceiling_recomputes_what_its_oracle_picks_and_at_ratio_1_is_full_recompute(tiny_ckpt):
    from benchmarks.blend_ceiling import modes_for, oracle_selection, score_modes

    score = torch.tensor([9.0, 1.0, 5.0, 7.0, 3.0, 8.0])
    candidate = torch.tensor([False, True, True, True, True, False])
    assert oracle_selection(score, candidate, 0.5).tolist() == [False, False, True, True, False, False]
    eng = Engine(tiny_ckpt("llama", max_position_embeddings=4096), dtype="float32", device="cpu")
    pool, tasks = make_pool(0), make_tasks(0, 1)
    prompts, answers = build_prompts(eng, ByteTokenizer(), pool, tasks)
    got = score_modes(eng, prompts[0], answers[0], modes_for([1.0]))
    n = len(answers[0])
    for label in ("oracle-all r=1", "oracle-layer1 r=1", "kv-deviation r=1"):
        agree, kl, share = got[label]
        assert agree == n and kl < 1e-9 and share == 1, label
    agree, kl, share = got["r=0"]
    assert share == 0 and kl > 1e-6
