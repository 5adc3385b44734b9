"""Blend mode in plain PyTorch over dense K/V: the oracle of issue #28 §3's algorithm.

A composite prompt's chunk pieces reuse a variant's K/V (each chunk computed once after its piece's context, at
positions len(context)..: alone from 0 for the isolated variant, issue #50 §1) moved to their positions in the
prompt (K re-rotated by start - len(context), V unchanged); a piece with no variant (context None) is computed like
text. A share of the chunk tokens is recomputed, layer by layer, over a cache mixing fresh and moved K/V:

- rows below `c0` (the leading run the fast engine's prefix cache supplies exactly) hold exact K/V and are
  never computed;
- candidates (chunk tokens at positions >= c0, but the prompt's last token) are computed or not per layer by
  the policy; fixed rows (every other position >= c0) are computed at every layer;
- "chunk-heads" computes the first floor(r * len + 0.5) tokens of every chunk piece at every layer;
- "kv-deviation" computes every row at layer 0 and, at check layers 1..C (C = min(3, layers - 1)), keeps the
  k(r_l) candidates whose fresh K/V deviate most from their moved ones (r_l = min(1, r (1 + (C - l) / C)), ties
  to the lower position); only kept rows attend and go on. r = 0 computes no candidate at all.
- "adaptive" keeps the same k(r_l) at the same layers, shared out among the chunk pieces by how far each one's
  K/V moved: a piece's candidates still kept have deviation sum S (accumulated in float64, rounded to float32),
  its m-th most deviating one (m = 0, 1, ..; ties to the lower position) scores S / (2m + 1), and the k(r_l)
  highest scores are kept (ties to the lower position). That is Sainte-Laguë's apportionment: each piece gets
  about k(r_l) S / sum(S) places, rounded to nearest by one common divisor, never more than it has candidates,
  and the places add up to k(r_l) exactly; within a piece its most deviating candidates take them.

A computed row at position p attends to every position <= p (within the window) of the cache as it stands at
that layer: fresh K/V where computed there, moved ones otherwise. r = 1 (either policy) recomputes [c0, L)
whole: exact mode's output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkwise.chunks import DEVIATION_NOISE, Blend, ChunkReuse, Piece
from chunkwise.reference.model import ReferenceModel, rotate


@dataclass(frozen=True)
class BlendResult:
    logits: torch.Tensor                  # float32 [vocab]: the prompt's last row, for the first generated token
    k: torch.Tensor                       # [layers, L, K, D] the blended cache, in the model dtype
    v: torch.Tensor                       # [layers, L, K, D]
    chunk_reuse: tuple[ChunkReuse, ...]   # per piece


def num_kept(ratio: float, n: int) -> int:
    """k(ratio) = min(n, floor(ratio * n + 0.5))."""
    return min(n, int(ratio * n + 0.5))


def check_layers(num_layers: int) -> int:
    """C: the layers after layer 0 where kv-deviation filters its candidates."""
    return min(3, num_layers - 1)


def check_ratio(ratio: float, layer: int, num_checks: int) -> float:
    """r_l = min(1, r * (1 + (C - l) / C)) at check layer l in 1..C: 1.67r, 1.33r, r for C = 3."""
    return min(1.0, ratio * (1 + (num_checks - layer) / num_checks))


def top_candidates(deviation: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The positions [k] (ascending) of the k largest deviations; ties go to the lower position.
    deviation float32 [n], positions int64 [n] ascending."""
    order = torch.sort(deviation, descending=True, stable=True).indices   # stable: equal values keep position order
    return torch.sort(positions[order[:k]]).values


def variant_forward(model: ReferenceModel, chunk, context) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V [layers, n, K, D] of a chunk's tokens computed after `context`'s ids (a ChunkContext), at positions
    len(context)..: one forward over the two."""
    ids = torch.tensor(context.token_ids + chunk.token_ids, device=model.w["model.embed_tokens.weight"].device)
    _, k, v = model.forward(ids)
    return k[:, len(context):], v[:, len(context):]


def apportioned(deviation: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """"adaptive"'s score of each candidate: S / (2m + 1), S its group's deviation sum (float64, then float32), m
    its rank in its group by deviation (0 the largest, ties to the lower position). deviation float32 [n], groups
    int64 [n] (a chunk piece's index), positions ascending."""
    score = torch.empty_like(deviation)
    for g in torch.unique(groups):
        idx = torch.nonzero(groups == g).squeeze(1)
        total = deviation[idx].double().sum().float()
        order = torch.sort(deviation[idx], descending=True, stable=True).indices
        score[idx[order]] = total / torch.arange(1, 2 * len(idx), 2, dtype=torch.float32, device=deviation.device)
    return score


def placed_kv(model: ReferenceModel, k: torch.Tensor, v: torch.Tensor, start: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's variant k, v [layers, n, K, D] moved `start` positions on (its new start less its context's
    length): K rotated by `start` with each layer's RoPE frequencies, V unchanged."""
    cfg = model.cfg
    delta = torch.full((k.shape[1],), start, dtype=torch.int64, device=k.device)
    moved = [rotate(k[i].transpose(0, 1), delta, model.inv_freq[cfg.layer_types[i]]).transpose(0, 1)
             for i in range(cfg.num_layers)]
    return torch.stack(moved), v


@torch.inference_mode()
def blend_prefill(model: ReferenceModel, token_ids: list[int], pieces: tuple[Piece, ...] | None, blend: Blend,
                  c0: int = 0, variant_kv=None, page_size: int | None = None,
                  selection: torch.Tensor | None = None) -> BlendResult:
    """The blended cache of a prompt (`pieces` as chunkwise.chunks.Piece, None for a plain prompt: nothing to
    blend) and its last row's logits. `c0`: the leading tokens whose K/V are exact (a prefix-cache hit), in
    [0, L - 1]. `variant_kv(chunk, context)` -> (k, v) [layers, n, K, D] of the chunk's tokens computed after the
    context's ids, default `variant_forward` (an engine may pass a memo: they depend on the two ids only).
    `page_size`: a variant's stored tokens are those in the full pages of context + chunk (the fast engine keeps
    them there; the chunk's tail is computed like text); None: all its tokens. `selection` (bool [L], for a
    diagnostic): the candidates computed at every layer, in place of the policy's choice."""
    cfg, n_tokens = model.cfg, len(token_ids)
    if not 0 <= c0 < n_tokens:
        raise ValueError(f"c0={c0!r} must be in [0, {n_tokens - 1}] for a prompt of {n_tokens} tokens")
    if not isinstance(blend, Blend):
        raise TypeError(f"blend must be a Blend, got {type(blend).__name__} {blend!r:.80}")
    device = model.w["model.embed_tokens.weight"].device
    if variant_kv is None:
        def variant_kv(chunk, context):
            return variant_forward(model, chunk, context)
    ids = torch.tensor(token_ids, device=device)
    pieces = pieces if pieces is not None else (Piece(None, n_tokens),)
    r = float(blend.recompute_ratio)

    # The cache at layer i starts as the moved chunks' K/V and the exact prefix's; computed rows overwrite it.
    shape = (cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim)
    k_cache = torch.zeros(shape, dtype=model.dtype, device=device)
    v_cache = torch.zeros(shape, dtype=model.dtype, device=device)
    candidate = torch.zeros(n_tokens, dtype=torch.bool, device=device)     # [L]
    heads = torch.zeros(n_tokens, dtype=torch.bool, device=device)         # [L] chunk-heads' selection
    group = torch.full((n_tokens,), -1, dtype=torch.int64, device=device)  # [L] each chunk token's piece
    start = 0
    for j, piece in enumerate(pieces):
        end = start + piece.num_tokens
        if piece.chunk is not None and piece.context is not None:
            group[start:end] = j
            n_ctx = len(piece.context)
            k_var, v_var = variant_kv(piece.chunk, piece.context)
            k_cache[:, start:end], v_cache[:, start:end] = placed_kv(model, k_var, v_var, start - n_ctx)
            full = (n_ctx + piece.num_tokens) // page_size * page_size - n_ctx if page_size else piece.num_tokens
            stored = start + max(0, full)
            candidate[max(start, c0):stored] = True
            heads[start:start + num_kept(r, piece.num_tokens)] = True
        start = end
    candidate[n_tokens - 1] = False
    if c0:
        _, k_cache[:, :c0], v_cache[:, :c0] = model.forward(ids[:c0])
    placed_k, placed_v = k_cache.clone(), v_cache.clone()

    fixed = torch.zeros(n_tokens, dtype=torch.bool, device=device)
    fixed[c0:] = ~candidate[c0:]
    if selection is not None:
        kept = candidate & selection.to(device)
    elif blend.policy == "chunk-heads":
        kept = candidate & heads
    elif r == 0:
        kept = torch.zeros_like(candidate)
    else:
        kept = candidate.clone()
    num_checks = (check_layers(cfg.num_layers) if blend.policy in ("kv-deviation", "adaptive") and r > 0
                  and selection is None else 0)

    x = model.embed(ids)                                                   # [L, hidden]; computed rows only
    for layer in range(cfg.num_layers):
        rows = torch.nonzero(fixed | kept).squeeze(1)                      # int64 [S] ascending
        q, k, v = model.layer_qkv(x[rows], layer, rows)                    # q [H, S, D], k, v [K, S, D]
        k_cache[layer, rows], v_cache[layer, rows] = k.transpose(0, 1), v.transpose(0, 1)
        if 1 <= layer <= num_checks:
            cand = torch.nonzero(kept).squeeze(1)                          # [n_kept] ascending
            fk, fv = k_cache[layer, cand].float(), v_cache[layer, cand].float()
            dev = ((fk - placed_k[layer, cand].float()) ** 2).sum((1, 2)) + \
                  ((fv - placed_v[layer, cand].float()) ** 2).sum((1, 2))
            dev[dev <= DEVIATION_NOISE * ((fk ** 2).sum((1, 2)) + (fv ** 2).sum((1, 2)))] = 0   # rounding noise
            keep = num_kept(check_ratio(r, layer, num_checks), int(candidate.sum()))
            score = apportioned(dev, group[cand]) if blend.policy == "adaptive" else dev
            kept = torch.zeros_like(kept)
            kept[top_candidates(score, cand, min(keep, cand.numel()))] = True
            attending = (fixed | kept)[rows]                               # [S] which computed rows go on
            rows, q = rows[attending], q[:, attending]
        x[rows] = model.attend_rows(x[rows], q, k_cache[layer].transpose(0, 1), v_cache[layer].transpose(0, 1),
                                    layer, rows)

    recomputed = fixed | kept
    report, start = [], 0
    for piece in pieces:
        end = start + piece.num_tokens
        exact = max(0, min(end, c0) - start)
        done = int(recomputed[start:end].sum())
        report.append(ChunkReuse(piece.chunk, piece.num_tokens, exact, piece.num_tokens - exact - done, done,
                                 None if piece.chunk is None else piece.context))
        start = end
    return BlendResult(model.logits(x[n_tokens - 1:])[0], k_cache, v_cache, tuple(report))
