"""Kernel benchmarks on the GPU: paged decode / chunked prefill against torch SDPA on a contiguous cache.

bf16, 32 query / 8 KV heads, head_dim 128, page size 16, random data, pages in random order. Each case times
our kernel and SDPA over a contiguous copy of the same K/V (same run) with triton.testing.do_bench (median)
and records ms, TB/s (bytes: K/V read once + q read + out written), TFLOP/s (4 * heads * head_dim per visible
query-key pair) and the ratio SDPA-time / our-time in benchmark.extra_info.

    pytest --benchmark-only benchmarks/bench_kernels.py -s      # prints the table at the end
"""
from dataclasses import dataclass, field

import pytest
import torch

from chunkwise.kernels import paged_attention, split_kv_decode
from chunkwise.kernels.split_kv import DEFAULT_SPLIT_SIZE, num_splits_for, split_workspace
from chunkwise.kernels.testing import query_start_loc

pytestmark = pytest.mark.gpu
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
ROWS: list[dict] = []


@dataclass
class Case:
    name: str
    seqs: list[tuple[int, int]]  # (cached prefix, new tokens) per sequence
    paths: list[str] = field(default_factory=lambda: ["paged"])

    @property
    def decode(self):
        return all(c == 1 for _, c in self.seqs)


CASES = [
    Case("decode B64xL4096", [(4095, 1)] * 64, ["paged", "split"]),
    Case("decode B8xL32768", [(32767, 1)] * 8, ["paged", "split"]),
    Case("decode B256xL1024", [(1023, 1)] * 256, ["paged", "split"]),
    Case("prefill 2048 after 4096", [(4096, 2048)]),
    Case("prefill 8x(1024 after 1024)", [(1024, 1024)] * 8),
    Case("prefill 8192 after 4096", [(4096, 8192)]),
    Case("prefill 2x(4096 after 2048)", [(2048, 4096)] * 2),
]


def build(case, gen):
    """Paged cache in random page order, the queries, and a contiguous [B, KV_HEADS, L, D] copy for SDPA."""
    lens = [p + c for p, c in case.seqs]
    pages = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages)
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(pages):
        table[s, :n] = order[start:start + n]
        start += n
    q = torch.randn(sum(c for _, c in case.seqs), HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=DTYPE)
    return dict(k_cache=k_cache, v_cache=v_cache, page_tables=table, q=q,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                qsl=query_start_loc([c for _, c in case.seqs], "cuda"))


def ours(t, path):
    out = torch.empty_like(t["q"])
    if path == "split":
        # Scratch made once and reused, as an engine step shares it between its layers.
        workspace = split_workspace(t["q"].shape[0], HEADS, KV_HEADS, HEAD_DIM,
                                    num_splits_for(t["page_tables"].shape[1], PAGE, DEFAULT_SPLIT_SIZE), "cuda")
        return lambda: split_kv_decode(t["q"], t["k_cache"], t["v_cache"], t["page_tables"], t["seq_lens"],
                                       SCALE, out=out, workspace=workspace)
    return lambda: paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_tables"], t["seq_lens"], t["qsl"],
                                   SCALE, out=out)


def sdpa(case, t):
    """SDPA over contiguous K/V of the same shape (all sequences here have equal lengths)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention
    b = len(case.seqs)
    length = case.seqs[0][0] + case.seqs[0][1]
    n_new = case.seqs[0][1]
    pages = t["page_tables"].long()[:, :-(-length // PAGE)]

    def contiguous(cache):
        return cache[pages].reshape(b, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()

    k, v = contiguous(t["k_cache"]), contiguous(t["v_cache"])
    q = t["q"].view(b, n_new, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    if case.decode:
        return lambda: scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)
    # Chunked prefill: queries are the last n_new positions, so the causal mask is aligned bottom-right.
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    mask = causal_lower_right(n_new, length)
    return lambda: scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)


def work(case):
    """(bytes moved at least, FLOPs) for a case."""
    pairs = sum(c * p + c * (c + 1) // 2 for p, c in case.seqs)
    kv_bytes = sum(p + c for p, c in case.seqs) * KV_HEADS * HEAD_DIM * 2 * 2
    q_out_bytes = sum(c for _, c in case.seqs) * HEADS * HEAD_DIM * 2 * 2
    return kv_bytes + q_out_bytes, 4 * HEADS * HEAD_DIM * pairs


def median_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


_SDPA_MS: dict[str, float] = {}


@pytest.mark.parametrize("case, path", [(c, p) for c in CASES for p in c.paths], ids=lambda x: getattr(x, "name", x))
def test_kernel_vs_sdpa(benchmark, case, path):
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = build(case, gen)
    fn = ours(tensors, path)
    baseline = sdpa(case, tensors)
    # Same function as the baseline, or the ratio means nothing (bf16: a loose bound on the max difference).
    expected = baseline().transpose(1, 2).reshape(fn().shape)
    assert (fn().float() - expected.float()).abs().max().item() < 3e-2
    if case.name not in _SDPA_MS:
        _SDPA_MS[case.name] = median_ms(baseline)
    ms = median_ms(fn)
    nbytes, flops = work(case)
    row = dict(case=case.name, path=path, ms=ms, tbps=nbytes / ms / 1e9, tflops=flops / ms / 1e9,
               sdpa_ms=_SDPA_MS[case.name], sdpa_tbps=nbytes / _SDPA_MS[case.name] / 1e9,
               sdpa_tflops=flops / _SDPA_MS[case.name] / 1e9, ratio=_SDPA_MS[case.name] / ms)
    benchmark.extra_info.update(row)
    ROWS.append(row)
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=10, warmup_rounds=2)


@pytest.fixture(scope="module", autouse=True)
def _print_table():
    yield
    print("\n| case | path | ms | TB/s | TFLOP/s | SDPA ms | SDPA TB/s | SDPA TFLOP/s | ratio (SDPA time / ours) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ROWS:
        print(f"| {r['case']} | {r['path']} | {r['ms']:.3f} | {r['tbps']:.2f} | {r['tflops']:.1f} | "
              f"{r['sdpa_ms']:.3f} | {r['sdpa_tbps']:.2f} | {r['sdpa_tflops']:.1f} | {r['ratio']:.2f} |")
