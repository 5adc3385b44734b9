"""The low-precision tier's rule (vLLM's check_logprobs_close), shared by the bf16 tests on CPU and GPU.

Greedy tokens must agree up to the first divergence; there each side's token must be in the other's top-k
logprobs and the reference must have been nearly undecided between the two; the sequence is not compared
past that point, since the two engines then continue different texts.
"""
TOP_K = 5
# A divergence is accepted only where the reference's logprobs of the two tokens differ by less than this.
MAX_DIVERGENCE_GAP = 0.5
# At least this share of all generated tokens must agree before the divergences, so that a run in which every
# request diverges at once (flat logits, a near-tie at every step) cannot pass.
MIN_AGREED_SHARE = 1 / 3


def check_logprobs_close(opt, ref, label: str) -> int:
    """Compares two outputs with top-k logprobs; returns how many tokens agreed before any divergence."""
    for pos, (a, b) in enumerate(zip(opt.token_ids, ref.token_ids)):
        if a == b:
            continue
        lp_opt, lp_ref = opt.logprobs[pos], ref.logprobs[pos]
        assert a in lp_ref, f"{label}: at token {pos} optimized chose {a}, not in the reference's top-{TOP_K} {lp_ref}"
        assert b in lp_opt, f"{label}: at token {pos} reference chose {b}, not in optimized's top-{TOP_K} {lp_opt}"
        gap = lp_ref[b] - lp_ref[a]
        assert gap < MAX_DIVERGENCE_GAP, f"{label}: at token {pos} the reference preferred {b} over {a} by {gap:.3f}"
        return pos
    # No divergence: the two texts must also end together (one stopping early is no near-tie).
    assert len(opt.token_ids) == len(ref.token_ids), (
        f"{label}: agreed on all {min(len(opt.token_ids), len(ref.token_ids))} common tokens, but optimized made "
        f"{len(opt.token_ids)} and the reference {len(ref.token_ids)}")
    return len(opt.token_ids)
