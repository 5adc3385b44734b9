"""Mixed and prefill-only steps over the CUDA graphs' static inputs (chunkwise/engine/cuda_graphs.py).

No graph is captured on the CPU; what a replay computes is run eagerly over the same padded static inputs
(`StepGraphs.static_forward`). In deterministic mode (batch-invariant GEMMs, tiles fixed per weight) padding
changes no real row, so each step's logits must equal the eager step's bit for bit, and the engine, going on
with them, must generate the reference's tokens. The bucket arithmetic is checked on its own: every step within
the budget has a graph, whose padding is bounded."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.cuda_graphs import ROWS_STEP, StepGraphs
from chunkwise.engine.host_step import synthetic_step

pytestmark = pytest.mark.correctness


def graphs_for(max_graph_tokens: int, max_num_seqs: int, budget: int) -> StepGraphs:
    graphs = StepGraphs(None, None, None, max_pages_per_seq=4, page_size=16, split_size=64, cascade_item_size=1,
                        num_kv_heads=1, device=torch.device("cpu"), max_graph_tokens=max_graph_tokens)
    graphs.allocate(max_num_seqs, budget)
    return graphs


@pytest.mark.smoke
@example(max_graph_tokens=512, n=64, budget=512, prefill=496, decodes=16)    # the default budget, filled exactly
@example(max_graph_tokens=512, n=64, budget=512, prefill=492, decodes=20)    # decodes padded past the budget
@example(max_graph_tokens=512, n=256, budget=512, prefill=383, decodes=129)  # the most decode padding
@example(max_graph_tokens=512, n=64, budget=512, prefill=513, decodes=0)     # one past: eager
@example(max_graph_tokens=8, n=64, budget=512, prefill=7, decodes=1)         # max_graph_tokens caps the budget
@example(max_graph_tokens=0, n=4, budget=512, prefill=1, decodes=1)          # off
@example(max_graph_tokens=3, n=1, budget=3, prefill=1, decodes=2)           # more decodes than sequences: eager
@given(max_graph_tokens=st.integers(0, 700), n=st.integers(1, 300), budget=st.integers(1, 700),
       prefill=st.integers(1, 800), decodes=st.integers(0, 300))
def test_every_mixed_step_within_the_budget_has_a_graph_that_holds_it_with_bounded_padding(
        max_graph_tokens, n, budget, prefill, decodes):
    graphs = graphs_for(max_graph_tokens, n, budget)
    host = synthetic_step([prefill], decodes)
    key = graphs.key_for(host)
    within = prefill + decodes <= min(max_graph_tokens, budget) and decodes <= n
    assert (key is not None) == within, (key, prefill + decodes)
    if key is None:
        return
    cascade, rows, dp = key
    assert not cascade and (rows, dp) in graphs.mixed_keys
    assert rows >= prefill and decodes <= dp <= n and (dp < 2 * decodes or dp == decodes)
    assert rows + dp < max(prefill + dp + ROWS_STEP, 33), "more than one row step of padding"
    assert graphs.seg >= rows + dp and graphs.seg >= graphs.prefill_seqs + dp
    more = synthetic_step([1] * (graphs.prefill_seqs + 1), min(decodes, n))   # too many prefilling sequences
    assert graphs.key_for(more) is None


CHUNKS = dict(max_num_seqs=st.integers(1, 5), budget=st.integers(3, 24), graph_tokens=st.integers(1, 40),
              page_size=st.integers(1, 8), lens=st.lists(st.integers(1, 30), min_size=1, max_size=5),
              overlap=st.booleans())


@settings(max_examples=max(1, settings().max_examples // 10))
@example(max_num_seqs=4, budget=12, graph_tokens=40, page_size=4, lens=[9, 20, 3, 14], overlap=True)
@example(max_num_seqs=2, budget=7, graph_tokens=7, page_size=3, lens=[5, 17], overlap=False)
@example(max_num_seqs=5, budget=24, graph_tokens=10, page_size=8, lens=[1, 2, 30, 6, 11], overlap=False)
@given(**CHUNKS)
def test_mixed_steps_over_the_static_inputs_give_the_eager_steps_bits_in_deterministic_mode(
        ckpt, reference_engine, max_num_seqs, budget, graph_tokens, page_size, lens, overlap):
    """Every step a mixed graph holds, staged into its key's static inputs (real rows moved past the prefill
    padding, pending ids filled in under overlap scheduling) and run eagerly, gives the eager step's logits bit
    for bit; the engine goes on with them and generates the reference's tokens."""
    eng = Engine(ckpt, page_size=page_size, max_model_len=64, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=budget, max_graph_tokens=graph_tokens, deterministic=True,
                 split_kv_threshold=0, enforce_eager=True, async_scheduling=overlap)
    runner = eng.executor.runner
    graphs = runner.graphs
    graphs.allocate(max_num_seqs, budget)
    eager, staged = runner.forward, []

    def forward(host):
        logits, _ = eager(host)
        if not host.num_prefill or graphs.key_for(host) is None:
            return logits, None
        static = graphs.static_forward(host, runner.tables.table, runner.last_tokens)
        assert torch.equal(static, logits), graphs.key_for(host)
        staged.append((host.num_prefill, len(host.rows) - host.num_prefill))
        return static, None
    runner.forward = forward
    prompts = [[(7 * i + 13 * j) % (VOCAB - 3) + 3 for i in range(n)] for j, n in enumerate(lens)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = eng.generate(prompts, params, use_tqdm=False)
    assert not any(o.error for o in outs), [o.error for o in outs]
    ref = reference_engine("qwen3")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, params)]
    assert staged, "no mixed step was staged"
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_mixed_steps_replay_graphs_with_the_eager_engines_bits_in_deterministic_mode(family):
    """On the GPU, mixed and prefill steps replay captured graphs (counted in the runner's launches) and a
    deterministic bf16 engine's tokens and K/V equal an eager one's bit for bit; in the default float32 mode its
    tokens equal the reference's."""
    import chunkwise.reference
    from chunkwise.checkpoints import tiny_checkpoint

    path = tiny_checkpoint(family)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 70, 33, 130, 17, 2)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(max_model_len=256, max_num_batched_tokens=48, max_num_seqs=4, page_size=16, num_pages=64)
    runs = {}
    for eager in (False, True):
        with Engine(path, dtype="bfloat16", deterministic=True, enforce_eager=eager, **kw) as eng:
            runs[eager] = [o.token_ids for o in eng.generate(prompts, params, use_tqdm=False)], \
                eng.prefill_kv(prompts[3]), eng.executor.runner.launches
    (tokens, kv, launches), (eager_tokens, eager_kv, _) = runs[False], runs[True]
    assert launches["mixed", "graph"] > 0 and launches["decode", "graph"] > 0, launches
    assert tokens == eager_tokens
    assert all(torch.equal(a, b) for a, b in zip(kv, eager_kv))
    with Engine(path, dtype="float32", **kw) as eng:
        outs = eng.generate(prompts, params, use_tqdm=False)
        assert eng.executor.runner.launches["mixed", "graph"] > 0
    ref = chunkwise.reference.Engine(path, dtype="float32", max_model_len=256)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, params)]
