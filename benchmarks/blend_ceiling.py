"""How much of blend mode's loss could any choice of recomputed tokens win back? A diagnostic for issue #28 §4.

CacheBlend's premise: a few chunk tokens carry most of the K/V deviation that composing isolated chunks causes, and
recomputing them restores the cross-chunk attention. This measures the premise on bench_blend.py's tasks with the
reference model: besides r = 0 and both policies at each ratio r, it recomputes (at every layer) the r share of
chunk tokens chosen by an *oracle* that knows the full recompute's K/V: the tokens whose moved K/V deviate most from
the exact ones, summed over every layer ("oracle-all") or at layer 1, where kv-deviation first filters
("oracle-layer1"). Each mode is scored as bench_blend.py scores it: teacher-forced over the answer's tokens against
full recompute (top-1 agreement, mean KL(full || mode)).

If the oracle's rows are no closer to full recompute than r = 0's, no selection of that size reaches full
recompute's quality on that model: its loss is spread over the prompt, not held by a few tokens.

    PYTHONPATH=$PWD python benchmarks/blend_ceiling.py --model qwen2.5-coder-0.5b --tasks 16 --ratios 0.15,0.3
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench_blend import (ByteTokenizer, build_prompts, make_pool, make_tasks, ratios,
                                    without_last_token)
from chunkwise.chunks import Blend
from chunkwise.reference.blend import BlendResult, blend_prefill


def deviation(full_k: torch.Tensor, full_v: torch.Tensor, moved: BlendResult) -> torch.Tensor:
    """float32 [layers, L]: each position's squared distance between the exact K/V and those of `moved` (r = 0:
    the chunks' moved K/V where nothing was computed)."""
    return sum(((f.float() - m.float()) ** 2).sum((2, 3)) for f, m in ((full_k, moved.k), (full_v, moved.v)))


def oracle_selection(score: torch.Tensor, candidate: torch.Tensor, ratio: float) -> torch.Tensor:
    """bool [L]: the round(ratio * n) candidates (bool [L], n of them) of highest score (float32 [L])."""
    n = int(candidate.sum())
    chosen = torch.topk(torch.where(candidate, score, -torch.inf), int(ratio * n + 0.5)).indices
    mask = torch.zeros_like(candidate)
    mask[chosen] = True
    return mask


def score_modes(engine, prompt: list, answer: list[int], modes: dict) -> dict[str, tuple[int, float, float]]:
    """Per mode label: (top-1 agreements, summed KL, recomputed share of chunk tokens) over the answer's tokens,
    teacher-forced on each mode's cache of the prompt less its last token. `modes`: label -> Blend, or (Blend,
    which oracle score, ratio) for an oracle row."""
    model = engine.model
    head, last = without_last_token(prompt)
    ids, pieces = engine.chunks.pieces(head, engine.tokenizer, 0)
    device = model.w["model.embed_tokens.weight"].device
    _, full_k, full_v = model.forward(torch.tensor(ids, device=device))
    forced = torch.tensor([last] + answer[:-1], device=device)

    def answer_logprobs(k, v):
        return torch.log_softmax(model.extend(forced, len(ids), k, v)[0].float(), dim=-1)

    full = answer_logprobs(full_k, full_v)
    def blend(b: Blend, selection=None) -> BlendResult:   # the chunks' variants' K/V memoised by the engine
        return blend_prefill(model, ids, pieces, b, variant_kv=engine._variant_kv, selection=selection)

    moved = blend(Blend(0.0))
    dev = deviation(full_k, full_v, moved)
    scores = {"all": dev.sum(0), "layer1": dev[min(1, dev.shape[0] - 1)]}
    candidate = torch.tensor([p.chunk is not None for p in pieces for _ in range(p.num_tokens)], device=device)
    candidate[-1] = False   # the prompt's last token is always computed
    chunk_tokens = sum(p.num_tokens for p in pieces if p.chunk is not None)
    out = {}
    for label, mode in modes.items():
        if isinstance(mode, tuple):
            b, which, r = mode
            result = blend(b, oracle_selection(scores[which], candidate, r))
        else:
            result = moved if mode == Blend(0.0) else blend(mode)
        lp = answer_logprobs(result.k, result.v)
        recomputed = sum(c.recomputed for c in result.chunk_reuse if c.chunk is not None)
        out[label] = (int((lp.argmax(-1) == full.argmax(-1)).sum()),
                      float((full.exp() * (full - lp)).sum(-1).clamp_min(0).sum()), recomputed / chunk_tokens)
    return out


def modes_for(ratio_list: list[float]) -> dict:
    modes = {"r=0": Blend(0.0)}
    for r in ratio_list:
        modes[f"kv-deviation r={r:g}"] = Blend(r)
        modes[f"chunk-heads r={r:g}"] = Blend(r, "chunk-heads")
        modes[f"oracle-all r={r:g}"] = (Blend(r), "all", r)
        modes[f"oracle-layer1 r={r:g}"] = (Blend(r), "layer1", r)
    return modes


def main(argv=None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a real checkpoint name, a tiny one or a path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", type=ratios, default=[0.15, 0.3], help="comma-separated")
    args = ap.parse_args(argv)

    from chunkwise.checkpoints import resolve_model
    from chunkwise.reference import Engine

    engine = Engine(resolve_model(args.model), dtype=args.dtype, device=args.device, max_model_len=4096)
    tokenizer = engine.tokenizer or ByteTokenizer()
    pool = make_pool(args.seed)
    tasks = make_tasks(args.seed, args.tasks, pool)
    prompts, answers = build_prompts(engine, tokenizer, pool, tasks)
    modes = modes_for(args.ratios)
    totals = {label: [0, 0.0, 0.0] for label in modes}
    count, began = 0, time.perf_counter()
    for prompt, answer in zip(prompts, answers):
        for label, (agree, kl, share) in score_modes(engine, prompt, answer, modes).items():
            totals[label][0] += agree
            totals[label][1] += kl
            totals[label][2] += share / len(prompts)
        count += len(answer)
    results = {label: dict(top1_agreement=a / count, mean_kl=kl / count, recomputed_share=share)
               for label, (a, kl, share) in totals.items()}
    print(f"Selection ceiling: {args.model}, reference engine, {args.dtype} on {args.device}, {len(tasks)} tasks "
          f"(seed {args.seed}), {count} answer tokens, {time.perf_counter() - began:.0f} s\n")
    print("| mode | recomputed | top-1 agreement | mean KL(full‖mode) |\n|---|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r['recomputed_share']:.1%} | {r['top1_agreement']:.1%} | {r['mean_kl']:.4f} |")
    return results


if __name__ == "__main__":
    main()
