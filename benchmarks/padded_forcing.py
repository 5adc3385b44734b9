"""Teacher forcing of many prompts at once: the reference model's `extend`, batched over padded caches.

`forced_logprobs(model, tokens, kvs)` gives, per prompt, the log-probabilities of the forced tokens after that
prompt's cache (K/V [layers, S_i, kv_heads, head_dim], from an engine's `prefill_kv`): the rows `model.extend`
computes for one prompt, for B prompts in one pass per layer. The caches are padded to the longest; a query at
position p attends keys j <= p (and inside its sliding window), so padding (at positions past every real query)
is never attended, and a prompt's rows do not depend on the others'. Forced token lists are padded likewise at
their ends (later rows, never attended by earlier ones)."""
from __future__ import annotations

import torch

from chunkwise.reference.model import ReferenceModel


class PaddedReference(ReferenceModel):
    """The reference model whose `attention` takes a batch: q [H, B*T, D] at positions [B*T] over k, v
    [B, K, S, D] (prompt b's rows are q[:, b*T:(b+1)*T]); everything else is the reference's own code."""

    @classmethod
    def of(cls, model: ReferenceModel) -> "PaddedReference":
        return cls(model.cfg, model.w)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
        b, _, s, d = k.shape
        h, t = q.shape[0], q.shape[1] // b
        group = self.cfg.num_queries_per_kv
        qb = q.view(h, b, t, d).transpose(0, 1).float()                                  # [B, H, T, D]
        kb = k.repeat_interleave(group, dim=1).float()                                   # [B, H, S, D]
        vb = v.repeat_interleave(group, dim=1).float()
        scores = torch.matmul(qb, kb.transpose(2, 3)) * self.cfg.attn_scale              # [B, H, T, S]
        pos = positions.view(b, t, 1)
        j = torch.arange(s, device=q.device).view(1, 1, s)
        allowed = j <= pos
        window = self.cfg.window(layer)
        if window is not None:
            allowed &= j > pos - window
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        out = torch.matmul(probs, vb).to(q.dtype)                                        # [B, H, T, D]
        return out.transpose(1, 2).reshape(b * t, h * d)


@torch.inference_mode()
def forced_logprobs(model: ReferenceModel, tokens: list[list[int]], kvs: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> list[torch.Tensor]:
    """Per prompt i, log-probabilities [len(tokens[i]), vocab] float32 of tokens[i] fed after its cache kvs[i]
    (the whole cache: the tokens sit at positions len(cache)..)."""
    if len(tokens) != len(kvs) or not tokens or min(map(len, tokens)) == 0:
        raise ValueError(f"forced_logprobs needs one non-empty token list per cache, got {len(tokens)} lists "
                         f"for {len(kvs)} caches")
    padded = PaddedReference.of(model)
    cfg, device = model.cfg, model.w["model.embed_tokens.weight"].device
    b, t = len(tokens), max(map(len, tokens))
    starts = torch.tensor([k.shape[1] for k, _ in kvs], device=device)
    s = int(starts.max()) + t
    ids = torch.tensor([x + [x[-1]] * (t - len(x)) for x in tokens], device=device).view(-1)
    positions = (starts[:, None] + torch.arange(t, device=device)[None, :])             # [B, T]
    rows = torch.arange(b, device=device)[:, None]
    x = padded.embed(ids)
    for layer in range(cfg.num_layers):
        q, k_new, v_new = padded.layer_qkv(x, layer, positions.view(-1))                # k_new [K, B*T, D]
        k = torch.zeros(b, cfg.num_kv_heads, s, cfg.head_dim, dtype=model.dtype, device=device)
        v = torch.zeros_like(k)
        for i, (pk, pv) in enumerate(kvs):
            k[i, :, :pk.shape[1]] = pk[layer].transpose(0, 1).to(device, model.dtype)
            v[i, :, :pv.shape[1]] = pv[layer].transpose(0, 1).to(device, model.dtype)
        k[rows, :, positions] = k_new.view(cfg.num_kv_heads, b, t, cfg.head_dim).permute(1, 2, 0, 3)
        v[rows, :, positions] = v_new.view(cfg.num_kv_heads, b, t, cfg.head_dim).permute(1, 2, 0, 3)
        x = padded.attend_rows(x, q, k, v, layer, positions.view(-1))
    logprobs = torch.log_softmax(padded.logits(x).float(), dim=-1).view(b, t, -1)
    # copies, so that one kept prompt's rows do not hold the whole padded batch (a 262k vocabulary's) alive
    return [logprobs[i, :len(x_)].clone() for i, x_ in enumerate(tokens)]
