"""The fast engine's blend against the reference engine's, the oracle: the same composite prompt (each engine's own
chunk handles) gives K/V within float32 rounding and the same tokens. Shared by the blend and chunk-context tests."""
import torch


def blends_equal(eng, ref, prompt: list, ref_prompt: list, blend, params):
    """Asserts both engines' blended K/V close and their tokens equal; returns (fast output, reference output)."""
    k, v = eng.prefill_kv(prompt, reuse=blend)
    k_ref, v_ref = ref.prefill_kv(ref_prompt, reuse=blend)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)
    out = eng.generate([prompt], params, reuse=blend)[0]
    out_ref = ref.generate([ref_prompt], params, reuse=blend)[0]
    assert out.token_ids == out_ref.token_ids
    return out, out_ref
