"""Mixed and prefill-only steps over the CUDA graphs' static inputs (chunkwise/engine/cuda_graphs.py).

No graph is captured on the CPU; what a replay computes is run eagerly over the same padded static inputs
(`StepGraphs.static_forward`). In deterministic mode (batch-invariant GEMMs, tiles fixed per weight) padding
changes no real row, so each step's logits must equal the eager step's bit for bit, and the engine, going on
with them, must generate the reference's tokens. The bucket arithmetic is checked on its own: every step within
the budget has a graph, whose padding is bounded."""
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.engine import Engine, SamplingParams
from chunkwise.chunks import Blend
from chunkwise.engine.cuda_graphs import (PREFILL_SEQS, ROWS_STEP, STEPS_PER_OCTAVE, TAIL_FINE_ROWS, TAIL_ROWS_STEP,
                                         StepGraphs, head_bucket, tail_bucket)
from chunkwise.engine.host_step import synthetic_step
from tests.draws import costly

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


def test_a_blend_graph_holds_a_row_planned_step_of_up_to_its_rows_prefills_and_decodes_and_no_more():
    """BlendGraphs.key_for at its limits: max_rows rows (decodes included) run and one more is refused, PREFILL_SEQS
    prefills run and one more is refused, as many decodes as the runner's sequences run and one more is refused, a
    step with cascade groups takes the key it has without them, a step with no row plan is refused, and max_rows 0
    is off; each check layer's kept rows are bucketed and never more than the rows before it; decodes are padded to
    a share of the prefill rows."""
    from chunkwise.engine.blend_graphs import BlendGraphs
    from chunkwise.engine.row_plan import HostRows

    graphs = BlendGraphs(None, None, max_pages_per_seq=4, max_decodes=4, device=torch.device("cpu"))
    graphs.max_rows = 100

    def step(rows, prefills=1, decodes=0, kept=(70, 40, 20)):
        host = synthetic_step([rows // prefills] * (prefills - 1) + [rows - rows // prefills * (prefills - 1)],
                              decodes)
        checks = {i + 1: ([], np.array([0, k], np.int32)) for i, k in enumerate(kept)}
        empty = np.zeros(0, np.int64)
        host.row_plan = HostRows(empty, empty, empty, np.zeros(rows + decodes, bool), checks)
        return host

    assert graphs.key_for(step(100)) == (tail_bucket(100), 0, (1, 2, 3), (tail_bucket(70), 64, 32))
    assert graphs.key_for(step(101)) is None and graphs.key_for(step(99, decodes=2)) is None
    assert graphs.key_for(step(96, decodes=3)) == (tail_bucket(96), 4, (1, 2, 3), (tail_bucket(70), 64, 32))
    assert graphs.key_for(step(40, PREFILL_SEQS, kept=())) == (64, 0, (), ())
    assert graphs.key_for(step(40, PREFILL_SEQS + 1)) is None
    assert graphs.key_for(step(40, decodes=4))[1] == 4 and graphs.key_for(step(40, decodes=5)) is None
    for rows in range(1, 101):
        (r, _, _, kept) = graphs.key_for(step(rows, kept=(rows, max(1, rows // 2), 1)))
        assert r >= rows and r >= kept[0] >= kept[1] >= kept[2] >= 1
    graphs.max_rows = 10_000   # above 2,048 rows the layers up to the last check coarser, the later ones not
    assert graphs.key_for(step(9000, kept=(6000, 5000, 4200))) == (9216, 0, (1, 2, 3), (6144, 5120, 4352))
    graphs.max_decodes = 1000   # decodes padded to a 64th of the prefill rows, a power of two, at most the runner's
    assert [graphs.key_for(step(9000, decodes=d))[1] for d in (0, 3, 200, 300)] == [0, 256, 256, 512]
    assert graphs.key_for(step(9000 - 900, decodes=900))[1] == 1024
    graphs.max_decodes = 200
    assert graphs.key_for(step(9000, decodes=3))[1] == 256 and graphs.key_for(step(640, decodes=3))[1] == 16
    graphs.max_rows, graphs.max_decodes = 100, 4
    cascade = step(40, decodes=2)
    cascade.cascade = object()   # its decodes share splits: the graph reads them as split-KV does
    assert graphs.key_for(cascade) == graphs.key_for(step(40, decodes=2)) is not None
    plain = step(40)
    plain.row_plan = None
    assert graphs.key_for(plain) is None
    graphs.max_rows = 0   # graphs off
    assert graphs.key_for(step(40)) is None


BLENDS = [Blend(0.3), Blend(1.0), Blend(0.0), Blend(0.25, "chunk-heads")]


@costly(max_examples=max(1, settings().max_examples // 10), deadline=None, report_multiple_bugs=False)
@example(family="qwen3", page_size=4, blend=Blend(0.3), docs=[9, 6], requests=2, decoding=False)
@example(family="llama", page_size=2, blend=Blend(0.3), docs=[8, 8, 8], requests=3, decoding=True)
@example(family="gemma3_text", page_size=1, blend=Blend(0.25, "chunk-heads"), docs=[20, 5], requests=1,
         decoding=True)
@given(family=st.sampled_from(["qwen3", "gemma3_text", "llama", "mistral"]), page_size=st.sampled_from([1, 2, 4, 8]),
       blend=st.sampled_from(BLENDS), docs=st.lists(st.integers(1, 24), min_size=1, max_size=4),
       requests=st.integers(1, PREFILL_SEQS + 1), decoding=st.booleans())
def test_blended_steps_over_a_blend_graphs_static_inputs_give_the_eager_steps_bits_in_deterministic_mode(
        tiny_ckpt, family, page_size, blend, docs, requests, decoding):
    """A whole blended step (layer 0, the check layers selecting on the device, the later layers), staged into its
    blend graph's static inputs (rows padded to the key's buckets, decodes beside the prefills moved past them) and
    run eagerly, gives the eager step's logits and its last layer's rows bit for bit, with and without decodes in
    the step; steps no blend graph holds (more prefills than PREFILL_SEQS) stay eager."""
    path = str(tiny_ckpt(family, num_hidden_layers=6))   # check layers 1..3, then a tail of two
    eng = Engine(path, dtype="float32", device="cpu", page_size=page_size, num_pages=400, max_model_len=192,
                 max_num_batched_tokens=512, deterministic=True, split_kv_threshold=0)
    runner = eng.executor.runner
    blend_graphs, eager, staged = runner.blend_graphs, runner.forward, []

    def forward(host):
        blend_graphs.max_rows = 0
        logits, _ = eager(host)
        blend_graphs.max_rows = 512
        if host.row_plan is None or blend_graphs.key_for(host) is None:
            return logits, None
        rows, eager_kept = runner._upload_rows(host.row_plan), runner.last_row_plan.kept
        static, kept = blend_graphs.static_forward(host, runner.tables.table, runner.last_tokens,
                                                   lambda: runner.model.place(rows, runner.kv.layers))
        key = blend_graphs.key_for(host)
        assert torch.equal(static, logits), key
        assert torch.equal(kept, eager_kept[:len(kept)]), key
        staged.append((key, len(host.rows) - host.num_prefill))
        return static, None
    runner.forward = forward
    chunks = [eng.register_chunk([(5 * i + 7 * n) % (VOCAB - 3) + 3 for i in range(n)]) for n in docs]
    prompts = [[[3 + j], *chunks[j % len(chunks):], *chunks[:j % len(chunks)], [4, 5 + j]] for j in range(requests)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = []
    if decoding:   # a plain request decodes while the blended ones prefill: its decode rides in their step
        first.append(eng.add_request([9, 10, 11], SamplingParams(max_tokens=8, ignore_eos=True)))
        eng.step()
    ids = first + [eng.add_request(p, params, reuse=blend) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.output for o in eng.step() if o.finished})
    assert not any(done[i].error for i in ids), [done[i].error for i in ids]
    if requests <= PREFILL_SEQS:
        assert staged, "no blended step was staged"
        assert any(d for _, d in staged) == decoding, staged
    else:
        assert not staged, staged


CHUNKS = dict(max_num_seqs=st.integers(1, 5), budget=st.integers(3, 24), graph_tokens=st.integers(1, 40),
              page_size=st.integers(1, 8), lens=st.lists(st.integers(1, 30), min_size=1, max_size=5),
              overlap=st.booleans())


@costly(max_examples=max(1, settings().max_examples // 10))
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
    if graph_tokens >= budget:   # every prefill step fits a graph (with fewer, a draw may have none that does)
        assert staged, "no mixed step was staged"
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages


def test_every_head_bucket_holds_its_rows_with_an_eighth_of_padding_at_most_and_no_less_than_the_tail_bucket():
    for n in list(range(1, 5000)) + list(range(5000, 70_000, 37)):
        rows = head_bucket(n)
        assert tail_bucket(n) <= rows and rows % 16 == 0
        assert rows == tail_bucket(n) if n <= TAIL_FINE_ROWS else rows - n < max(TAIL_ROWS_STEP, n / STEPS_PER_OCTAVE)
    # 2,048 to 4,096 by 256, then 8 buckets an octave: 8 + 3 * 8 up to 32,768
    assert len({head_bucket(n) for n in range(TAIL_FINE_ROWS + 1, 32_769)}) == 8 + 3 * 8


def test_every_tail_bucket_holds_its_rows_with_bounded_padding():
    for n in range(1, 3000):
        rows = tail_bucket(n)
        assert n <= rows < n + (ROWS_STEP if n <= TAIL_FINE_ROWS else TAIL_ROWS_STEP) and (rows % 16 == 0)
    # 16, 32, 64..2048 by 64, then by 256 up to 8192
    assert len({tail_bucket(n) for n in range(1, 8193)}) == 2 + 32 + 24


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


@pytest.mark.gpu
@pytest.mark.parametrize("blend", [Blend(0.3), Blend(0.25, "chunk-heads")], ids=["kv-deviation", "chunk-heads"])
def test_blended_prefills_replay_blend_graphs_with_the_eager_engines_bits_in_deterministic_mode(blend):
    """On the GPU, a blended prefill's whole step goes through a blend graph (counted in the runner's launches): a
    key's first step eagerly over its static inputs while its graph is captured, its later steps replayed (a second
    round of prompts of the same lengths). A deterministic bf16 engine's tokens, K/V and chunk_reuse reports equal an
    eager one's bit for bit in both rounds. Each launched blended step hands the host its kept rows as a pinned copy
    made at launch: reading them from the device at postprocess would wait for the step launched after it."""
    from chunkwise.checkpoints import tiny_checkpoint

    path = tiny_checkpoint("qwen3", num_hidden_layers=6)
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (40, 77, 16, 130)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=4, page_size=16, num_pages=128)
    runs = {}
    for eager in (False, True):
        with Engine(path, dtype="bfloat16", deterministic=True, enforce_eager=eager, **kw) as eng:
            runner, kept = eng.executor.runner, []
            run = runner.run

            def launch(*args, **kwargs):
                launched = run(*args, **kwargs)
                if launched.row_plan is not None:
                    kept.append(launched.row_plan[1])
                return launched
            runner.run = launch
            chunks = [eng.register_chunk(d, pin=True) for d in docs]
            prompts = [[[5, 6], *chunks, [7, 8, 9]], [[10], chunks[2], chunks[0], [11]]]
            again = [[[6, 5], *chunks, [9, 8, 7]], [[12], chunks[2], chunks[0], [13]]]   # the same keys
            outs = [(o.token_ids, [(r.num_tokens, r.exact, r.blended, r.recomputed) for r in o.chunk_reuse])
                    for p in (prompts, again) for o in eng.generate(p, params, use_tqdm=False, reuse=blend)]
            captured = sum(static.graph is not None for static in runner.blend_graphs.statics.values())
            runs[eager] = outs, eng.prefill_kv(prompts[0], reuse=blend), runner.launches, captured
            assert kept and all(k.device.type == "cpu" and k.is_pinned() for k in kept), [k.device for k in kept]
    (outs, kv, launches, captured), (eager_outs, eager_kv, eager_launches, _) = runs[False], runs[True]
    assert launches["blend", "graph"] > captured > 0 and not eager_launches["blend", "graph"], (launches, captured)
    assert outs == eager_outs
    assert all(torch.equal(a, b) for a, b in zip(kv, eager_kv))
