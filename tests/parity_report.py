"""Comparisons of the optimized engine against the reference whose failure messages say where they diverge
(first line), then what ran (the model and workload, after "in").

Tokens: the first diverging request and generated-token position, with the reference's top-2 margin there
(a small margin means a near-tie that any rounding change may flip; a large one means a real bug).
K/V: the first layer, then position, head and dim beyond tolerance, and the worst error of every layer, so a
bug that starts in layer 1 (or at the first position past a tile or page) shows where it starts.
Logprobs: the first generated token whose logprob of the sampled token differs from the reference's
log-softmax at that position.
"""
from __future__ import annotations

import torch

KV_RTOL = 1e-4            # float32, different summation orders: measured errors are ~1e-6
# A logprob is logit - logsumexp(logits): its float32 error scales with the row's largest |logit| (measured
# ~1.5e-7 of it, both for logits ~27 and ~340); the tolerance is 4e-6 of it.
LOGPROB_RTOL = 4e-6


def first_divergence(a, b) -> int:
    """The first index where sequences a and b differ (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_margin(ref, tokens: list[int]) -> float:
    """The reference's gap between its two most likely next tokens after `tokens` (logit units)."""
    top = torch.topk(ref.logits(list(tokens))[-1], 2).values
    return float(top[0] - top[1])


def assert_same_tokens(ref, prompts, got, want, label: str) -> None:
    """Every request's tokens equal; else the first diverging request and position, with the margin there."""
    for i, (p, g, w) in enumerate(zip(prompts, got, want)):
        if list(g) == list(w):
            continue
        pos = first_divergence(g, w)
        margin = top2_margin(ref, list(p) + list(w[:pos]))
        raise AssertionError(
            f"request {i} (prompt of {len(p)} tokens) diverges at generated token {pos}: "
            f"optimized {list(g[pos:pos + 3])} vs reference {list(w[pos:pos + 3])} "
            f"({len(g)} vs {len(w)} tokens); reference top-2 margin there {margin:.4g}\n  in {label}")


def kv_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-element error relative to the layer's scale: |got - want| / (|want| + max |want| of the layer).

    got, want: [layers, tokens, kv_heads, head_dim]. The layer's max keeps near-zero elements from reading
    as huge relative errors; an element fails when this exceeds KV_RTOL.
    """
    scale = want.abs().amax(dim=(1, 2, 3), keepdim=True)
    return (got.float() - want.float()).abs() / (want.abs().float() + scale.float())


def kv_mismatch(got: torch.Tensor, want: torch.Tensor, name: str, rtol: float = KV_RTOL) -> str | None:
    """None if got is within rtol of want everywhere; else where it first is not, and each layer's worst error."""
    if got.shape != want.shape:
        return f"{name} shape {tuple(got.shape)} vs reference {tuple(want.shape)}"
    err = kv_errors(got, want)
    bad = ~(err <= rtol)                      # NaN counts as bad
    if not bad.any():
        return None
    layer, pos, head, dim = (int(x) for x in torch.nonzero(bad)[0])   # lexicographic: lowest layer, then position
    worst = [float(e.nan_to_num(float("inf")).max()) for e in err]
    return (f"{name} first beyond tolerance {rtol:g} at layer {layer}, position {pos}, head {head}, dim {dim}: "
            f"{float(got[layer, pos, head, dim]):.6g} vs reference {float(want[layer, pos, head, dim]):.6g}; "
            f"{int(bad[layer].any(dim=(1, 2)).sum())} of {want.shape[1]} positions bad in that layer; "
            f"worst relative error per layer: {', '.join(f'{w:.3g}' for w in worst)}")


def assert_kv_close(ref, prompt, got, want, label: str) -> None:
    """got, want: (K, V) pairs [layers, tokens, kv_heads, head_dim]; the reference's margin at the first bad
    position says whether a token there could flip."""
    for name, a, b in (("K", got[0], want[0]), ("V", got[1], want[1])):
        msg = kv_mismatch(a, b, name)
        if msg is not None:
            pos = int(torch.nonzero(~(kv_errors(a, b) <= KV_RTOL))[0, 1]) if a.shape == b.shape else 0
            margin = top2_margin(ref, list(prompt[:pos + 1]))
            raise AssertionError(f"{msg}; reference top-2 margin after position {pos}: {margin:.4g}\n  in {label}")


def assert_logprobs_match_reference(ref, prompts, outs, label: str, rtol: float = LOGPROB_RTOL) -> None:
    """Each output's logprob dicts hold its sampled token, and every value equals the reference's
    log-softmax at that position (computed here from the reference's logits, not by the shared sampler),
    within rtol of the row's largest |logit|."""
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids), \
            f"request {i} has {None if o.logprobs is None else len(o.logprobs)} logprob dicts " \
            f"for {len(o.token_ids)} tokens\n  in {label}"
        logits = ref.logits(list(p) + list(o.token_ids))[len(p) - 1:-1]       # the row before each token
        want = torch.log_softmax(logits.float(), dim=-1)
        tols = rtol * logits.abs().amax(dim=-1).clamp(min=1.0)
        for j, (token, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            if token not in lp:
                raise AssertionError(f"request {i}, generated token {j}: sampled token {token} is not "
                                     f"in its logprobs {lp}\n  in {label}")
            bad = {t: v for t, v in lp.items() if not abs(v - float(want[j, t])) <= float(tols[j])}
            if bad:
                t = next(iter(bad))
                raise AssertionError(
                    f"request {i}, generated token {j} (sampled {token}): logprob of {t} is {bad[t]:.6g}, "
                    f"the reference's log-softmax there is {float(want[j, t]):.6g} (tolerance {float(tols[j]):.3g})"
                    f"\n  in {label}")
