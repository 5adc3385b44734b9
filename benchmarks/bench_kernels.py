"""Kernel benchmarks on the GPU: paged decode / chunked prefill against torch SDPA on a contiguous cache.

bf16, 32 query / 8 KV heads, head_dim 128, page size 16, random data, pages in random order. Each case times
our kernel and SDPA's backends over a contiguous copy of the same K/V (same run) with triton.testing.do_bench
(median) and records ms, TB/s (bytes: K/V read once + q read + out written), TFLOP/s (4 * heads * head_dim per
visible query-key pair) and, per baseline, its time and the ratio baseline-time / our-time in
benchmark.extra_info. Baselines: decodes against SDPA as it dispatches itself; prefill against each backend
forced (`sdpa_kernel`): flash, cuDNN and memory-efficient. Decodes run two paths: split-KV (the default mode's)
and the single pass (`paged_decode`, deterministic mode's). A backend that refuses a case is reported as such.
Where vLLM is installed (its `vllm.vllm_flash_attn` with the FA3 library) on a Hopper GPU, its FlashAttention-3
reads the same paged cache through the same page tables: the one baseline that pays for pages as ours does.
Plain causal cases (no cached prefix) take SDPA's `is_causal`, the fast path of every backend; after a cached
prefix the mask is aligned bottom-right (`causal_lower_right`).

    pytest --benchmark-only benchmarks/bench_kernels.py -s      # prints the table at the end
"""
from dataclasses import dataclass, field

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from chunkwise.kernels import paged_attention, paged_decode, split_kv_decode
from chunkwise.kernels.split_kv import DEFAULT_SPLIT_SIZE, num_splits_for, split_workspace
from chunkwise.kernels.fa3 import fa3_unavailable, library
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
    Case("decode B64xL4096", [(4095, 1)] * 64, ["single", "split"]),
    Case("decode B8xL32768", [(32767, 1)] * 8, ["single", "split"]),
    Case("decode B256xL1024", [(1023, 1)] * 256, ["single", "split"]),
    Case("causal 8192", [(0, 8192)]),
    Case("causal 4x2048", [(0, 2048)] * 4),
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
    if path == "single":   # deterministic mode's decodes: one pass, in the prefill's bits
        return lambda: paged_decode(t["q"], t["k_cache"], t["v_cache"], t["page_tables"], t["seq_lens"], SCALE,
                                    out=out, sum_by_dot=True)
    return lambda: paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_tables"], t["seq_lens"], t["qsl"],
                                   SCALE, out=out)


# Prefill's baselines: each SDPA backend forced.
PREFILL_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}


def fa3_paged(case, t):
    """vLLM's FlashAttention-3 over our paged cache as vLLM calls it (exact length bounds, its own split choice),
    or None where it cannot run. Its causal mask is aligned bottom-right, as ours: the queries are each
    sequence's last positions."""
    if fa3_unavailable(torch.device("cuda"), DTYPE, HEAD_DIM) is not None:
        return None
    max_q = max(c for _, c in case.seqs)
    max_k = max(p + c for p, c in case.seqs)
    return lambda: library()[0](t["q"], t["k_cache"], t["v_cache"], max_q, t["qsl"], max_k, seqused_k=t["seq_lens"],
                                softmax_scale=SCALE, causal=True, block_table=t["page_tables"], fa_version=3)


def baselines(case, t):
    """{name: (fn, to_rows)}: SDPA over contiguous K/V of the same shape (all sequences here have equal
    lengths), and FA3 over the paged cache; to_rows puts a baseline's output in ours' [tokens, heads, dim]."""
    b = len(case.seqs)
    prefix, n_new = case.seqs[0]
    length = prefix + n_new
    pages = t["page_tables"].long()[:, :-(-length // PAGE)]

    def contiguous(cache):
        return cache[pages].reshape(b, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()

    def sdpa_rows(out):
        return out.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)

    k, v = contiguous(t["k_cache"]), contiguous(t["v_cache"])
    q = t["q"].view(b, n_new, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    fa3 = fa3_paged(case, t)
    extra = {} if fa3 is None else {"fa3": (fa3, lambda out: out)}
    if case.decode:
        return {"sdpa": (lambda: scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True), sdpa_rows),
                **extra}
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    # Queries are the last n_new positions: without a prefix that is plain causal attention.
    mask = dict(is_causal=True) if prefix == 0 else dict(attn_mask=causal_lower_right(n_new, length))

    def forced(backend):
        def fn():
            with sdpa_kernel([backend]):
                return scaled_dot_product_attention(q, k, v, scale=SCALE, **mask)
        return fn
    return {**{name: (forced(backend), sdpa_rows) for name, backend in PREFILL_BACKENDS.items()}, **extra}


def work(case):
    """(bytes moved at least, FLOPs) for a case."""
    pairs = sum(c * p + c * (c + 1) // 2 for p, c in case.seqs)
    kv_bytes = sum(p + c for p, c in case.seqs) * KV_HEADS * HEAD_DIM * 2 * 2
    q_out_bytes = sum(c for _, c in case.seqs) * HEADS * HEAD_DIM * 2 * 2
    return kv_bytes + q_out_bytes, 4 * HEADS * HEAD_DIM * pairs


def median_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


_BASELINE_MS: dict[tuple[str, str], float | None] = {}   # (case, baseline) -> ms; None: the backend refused


def _time_baseline(name, fn, to_rows, ours_out):
    """The baseline's median ms, after checking it computes what ours does; None if the backend refuses."""
    try:
        expected = to_rows(fn())
    except RuntimeError as e:   # e.g. no cuDNN, or a backend that does not take the mask
        print(f"\n{name}: refused ({str(e).splitlines()[0][:120]})")
        return None
    # Same function as ours, or the ratio means nothing (bf16: a loose bound on the max difference).
    assert (ours_out.float() - expected.float()).abs().max().item() < 3e-2, name
    return median_ms(fn)


@pytest.mark.parametrize("case, path", [(c, p) for c in CASES for p in c.paths], ids=lambda x: getattr(x, "name", x))
def test_kernel_vs_sdpa(benchmark, case, path):
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = build(case, gen)
    fn = ours(tensors, path)
    out = fn().clone()
    for name, (base, to_rows) in baselines(case, tensors).items():
        if (case.name, name) not in _BASELINE_MS:
            _BASELINE_MS[case.name, name] = _time_baseline(name, base, to_rows, out)
    ms = median_ms(fn)
    nbytes, flops = work(case)
    row = dict(case=case.name, path=path, ms=ms, tbps=nbytes / ms / 1e9, tflops=flops / ms / 1e9)
    for (c, name), base_ms in _BASELINE_MS.items():
        if c == case.name and base_ms is not None:
            row.update({f"{name}_ms": base_ms, f"{name}_tbps": nbytes / base_ms / 1e9,
                        f"{name}_tflops": flops / base_ms / 1e9, f"{name}_ratio": base_ms / ms})
    benchmark.extra_info.update(row)
    ROWS.append(row)
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=10, warmup_rounds=2)


def _baseline_cell(row, name, unit):
    if f"{name}_ms" not in row:
        return "-"
    return f"{row[f'{name}_{unit}']:.{2 if unit == 'tbps' else 1}f} ({row[f'{name}_ratio']:.2f})"


@pytest.fixture(scope="module", autouse=True)
def _print_table():
    yield
    print("\nEach baseline: its TB/s (decode) or TFLOP/s (prefill), and in brackets its time / ours (> 1: ours faster)")
    print("| case | path | ms | TB/s | TFLOP/s | SDPA | flash | cuDNN | efficient | vLLM FA3 (paged) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ROWS:
        unit = "tbps" if r["case"].startswith("decode") else "tflops"
        cells = " | ".join(_baseline_cell(r, name, unit) for name in ("sdpa", *PREFILL_BACKENDS, "fa3"))
        print(f"| {r['case']} | {r['path']} | {r['ms']:.3f} | {r['tbps']:.2f} | {r['tflops']:.1f} | {cells} |")
