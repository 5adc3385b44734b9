"""Cascade attention in the engine: decodes that share prefix splits are grouped each step, read the shared
splits once, and produce exactly what split-KV alone produces (and what the reference produces)."""
import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import chunkwise.reference
from benchmarks.bench_host import stage_blend_graphs
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.chunks import Blend
from chunkwise.kernels import CascadeGroups
from chunkwise.engine import Engine, SamplingParams
from tests.draws import costly

pytestmark = pytest.mark.correctness
SPLIT = 64          # small splits: a prefix of a few hundred tokens spans several
MAX_MODEL_LEN = 320


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("qwen3", num_hidden_layers=1, num_key_value_heads=2, num_attention_heads=4,
                           head_dim=16, hidden_size=96)


@pytest.fixture(scope="module")
def ref(ckpt):
    return chunkwise.reference.Engine(ckpt, max_model_len=MAX_MODEL_LEN)


def cascade_engine(ckpt, page_size: int, cascade: bool, **kw) -> Engine:
    """An engine whose decodes all take split-KV over SPLIT-token splits, grouped when `cascade` is on."""
    return Engine(ckpt, page_size=page_size, num_pages=256, max_model_len=MAX_MODEL_LEN, split_size=SPLIT,
                  split_kv_threshold=0, cascade_attention=cascade, **kw)


def run(ckpt, prompts, page_size, chunks, cascade):
    eng = cascade_engine(ckpt, page_size, cascade)
    grouped = []
    real = eng.executor.runner._cascade

    def spy(*args):
        groups = real(*args)
        grouped.append(0 if groups is None else groups.num_shared)
        return groups
    eng.executor.runner._cascade = spy
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # The first request caches the shared prompt (a system prompt); the others then arrive together, take
    # its pages and decode side by side.
    rids = [eng.add_request(prompts[0], params, chunks)]
    first, outs = eng.scheduler.seqs[rids[0]], {}
    while first.num_computed_tokens < len(prompts[0]):
        outs.update({r.request_id: r.output for r in eng.step() if r.finished})
    # Under overlap scheduling (on with CUDA) a step's pages are committed to the prefix cache when it is
    # postprocessed, during the next step: one more step, or the others would miss the prompt's last pages.
    outs.update({r.request_id: r.output for r in eng.step() if r.finished})
    rids += [eng.add_request(p, params, chunks) for p in prompts[1:]]
    while eng.has_unfinished():
        outs.update({r.request_id: r.output for r in eng.step() if r.finished})
    kv = eng.prefill_kv(prompts[-1])
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages
    return [outs[r].token_ids for r in rids], [outs[r].num_cached_tokens for r in rids], kv, grouped, \
        eng.executor.runner.launches


@costly(max_examples=max(1, settings().max_examples // 10))
@example(shared=2 * SPLIT, tails=(1, 9, 30), page_size=16, chunk=None)        # prefix ends on a split boundary
@example(shared=2 * SPLIT + 37, tails=(5, 5, 12), page_size=5, chunk=50)      # inside a split, odd pages
@given(shared=st.integers(SPLIT - 10, 3 * SPLIT), tails=st.lists(st.integers(1, 40), min_size=2, max_size=4),
       page_size=st.sampled_from([1, 5, 16, 64]), chunk=st.one_of(st.none(), st.integers(17, 90)))
def test_cascade_decodes_equal_split_kv_and_the_reference(ckpt, ref, shared, tails, page_size, chunk):
    base = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(shared)]
    prompts = [base + [(11 * j + 5 * i) % (VOCAB - 3) + 3 for i in range(t)] for j, t in enumerate(tails)]
    path = "graph" if torch.cuda.is_available() else "eager"   # of decode-only steps
    on_tokens, on_cached, (k_on, v_on), grouped, launches = run(ckpt, prompts, page_size, chunk, True)
    off_tokens, off_cached, (k_off, v_off), *_ = run(ckpt, prompts, page_size, chunk, False)
    assert on_tokens == off_tokens
    assert on_cached == off_cached
    assert torch.equal(k_on, k_off) and torch.equal(v_on, v_off)
    want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))]
    assert on_tokens == want
    # The shared prompt's full pages are cached by the first request: the later ones take them and decode
    # together, so steps group them once a whole split lies in those pages.
    if shared // page_size * page_size >= SPLIT and len(tails) > 2:
        assert max(grouped) > 0, f"no step grouped decodes sharing {shared} prompt tokens"
        assert launches["cascade decode", path] > 0
    # On a GPU every decode-only cascade step replays a cascade graph (the batch fits the largest bucket).
    assert launches["cascade decode", "eager" if path == "graph" else "graph"] == 0


def test_cascade_steps_over_the_graphs_static_inputs_equal_eager_and_split_kv_steps(ckpt, ref):
    """What a cascade decode graph replays, run eagerly over the same padded static inputs (no capture on
    CPU): its logits equal the static split-KV step's bit for bit, padded or not, and the eager cascade
    step's where no padding changes the matmuls' row count; the eager cascade step equals the eager split-KV
    one; and an engine whose decode steps all take the static inputs still generates the reference's tokens.
    Every step is counted in the runner's `launches`."""
    max_seqs, shared, tails = 8, 2 * SPLIT + 21, (3, 9, 14, 30)
    base = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(shared)]
    prompts = [base + [(11 * j + 5 * i) % (VOCAB - 3) + 3 for i in range(t)] for j, t in enumerate(tails)]
    # Eager (no graphs to replace on a GPU): the static path runs by hand.
    eng = cascade_engine(ckpt, 16, True, max_num_seqs=max_seqs, enforce_eager=True,
                         async_scheduling=False)   # the schedule the row counts below are planned for, on any device
    runner = eng.executor.runner
    graphs = runner.graphs
    graphs.allocate(max_seqs)
    eager_forward, rows_seen, kinds = runner.forward, [], Counter()

    def forward(host):
        logits, _ = eager_forward(host)
        kinds["mixed" if host.num_prefill else "cascade decode" if host.cascade is not None else "decode"] += 1
        if host.num_prefill or len(host.logits_indices) != len(host.rows):
            return logits, None
        static = graphs.static_forward(host, runner.tables.table, runner.last_tokens)
        if host.cascade is not None:
            # The graph's groups hold the step's (their results alone cannot tell: no sharing is split-KV too),
            # and padding rows share nothing.
            d, bs = len(host.rows), min(b for b in graphs.buckets if b >= len(host.rows))
            staged = graphs.static_inputs(bs, cascade=True).cascade
            for name, t in zip(CascadeGroups.TENSORS, host.cascade.tensors()):
                assert torch.equal(getattr(staged, name)[:len(t)].cpu(), t.cpu()), name   # staged on the device
            assert not staged.shared_splits[d:].any() and staged.shared_splits.shape == (bs,)
            plain = dataclasses.replace(host, cascade=None)
            assert torch.equal(static, graphs.static_forward(plain, runner.tables.table, runner.last_tokens))
            assert torch.equal(logits, runner.model.forward(runner._upload(plain), runner.kv.layers))
            if len(host.rows) in graphs.buckets:
                assert torch.equal(static, logits)
            rows_seen.append(len(host.rows))
        return static, None   # the engine goes on with what the replay would give
    runner.forward = forward
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = eng.add_request(prompts[0], params)
    while eng.scheduler.seqs[first].num_computed_tokens < len(prompts[0]):
        eng.step()
    eng.step()   # its prompt's pages committed under overlap scheduling too (see `run`)
    outs = eng.generate(prompts[1:], params, use_tqdm=False)

    assert not any(o.error for o in outs), [o.error for o in outs]   # a check above failed inside a step
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts[1:], params)]
    assert any(d in graphs.buckets for d in rows_seen) and any(d not in graphs.buckets for d in rows_seen), \
        f"cascade decode steps of {rows_seen} rows: a padded and an unpadded bucket are both needed"
    assert runner.launches == Counter({(kind, "eager"): n for kind, n in kinds.items()})


def test_a_blend_graph_holds_a_blended_step_whose_decodes_share_a_prefix_and_tokens_stay_cascades(ckpt):
    """Decodes sharing a pinned system chunk group into cascade steps, also beside a blended prefill: that step still
    goes to its blend graph (staged, then run eagerly over the graph's static inputs: no capture on CPU), whose
    decodes read their splits as split-KV does, so every request's tokens equal those of the same run with cascade
    off."""
    def blend_beside_decodes(cascade: bool):
        eng = cascade_engine(ckpt, 16, cascade)
        stage_blend_graphs(eng)
        runner = eng.executor.runner
        system = eng.register_chunk([(7 * i + 3) % (VOCAB - 3) + 3 for i in range(2 * SPLIT)], pin=True)
        docs = [eng.register_chunk([(13 * i + d) % (VOCAB - 3) + 3 for i in range(24)], pin=True) for d in range(2)]
        steps, prepare = [], runner.prepare

        def spy(batch):
            host, sampled = prepare(batch)
            if host.row_plan is not None:
                steps.append((len(host.rows) - host.num_prefill, host.cascade is not None))
            return host, sampled
        runner.prepare = spy
        long = SamplingParams(max_tokens=12, ignore_eos=True)
        rids = [eng.add_request([system, [5 + j, 6, 7]], long) for j in range(3)]
        for _ in range(4):   # their prefills, then decodes side by side
            eng.step()
        rids.append(eng.add_request([system, docs[1], docs[0], [9, 10]], SamplingParams(max_tokens=3, ignore_eos=True),
                                    reuse=Blend(0.3)))
        outs = {}
        while eng.has_unfinished():
            outs.update({r.request_id: r.output.token_ids for r in eng.step() if r.finished})
        eng.close()
        return [outs[r] for r in rids], steps, runner.launches

    on, steps, launches = blend_beside_decodes(True)
    off, _, _ = blend_beside_decodes(False)
    assert on == off
    assert steps and all(decodes >= 2 and cascade for decodes, cascade in steps), steps   # beside grouped decodes
    assert launches["blend", "graph"] == len(steps), launches   # every row-planned step: none ran eagerly
