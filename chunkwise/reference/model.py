"""A textbook decoder-only transformer for every family, driven only by `ModelConfig` fields.

Full context, no cache: `forward(token_ids)` recomputes the whole sequence. Attention is an explicit
masked softmax in float32. Tensor names are HF's (`weights` is the dict `load_weights` returns). The same
layer code also computes chosen rows at chosen positions over given K/V (`qkv(..., positions)` then
`attend_rows`): `extend` decodes after a given cache, and blend mode (chunkwise/reference/blend.py) computes
row subsets.

Shapes: T tokens, H heads, K kv heads, D head_dim. Per layer:
  x [T, hidden] -> norm -> q [H, T, D], k/v [K, T, D] (bias, q/k norm, RoPE) -> scores [H, T, T]
  -> softmax (causal, sliding window) -> [T, H*D] -> o_proj -> (post norm) -> residual -> MLP likewise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from chunkwise.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32. HF rounds in different places per family
    (Llama: normalise, cast, then scale; Gemma: scale by 1 + w in float32, then cast); we follow each
    so low-precision outputs match too."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split convention: x [heads, T, D], positions [T], inv_freq [D/2] float32."""
    angles = positions.float()[:, None] * inv_freq[None, :]                    # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)                               # [T, D]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def attention_mask(num_tokens: int, window: int | None, device, positions: torch.Tensor | None = None,
                   num_keys: int | None = None) -> torch.Tensor:
    """[T, S] bool, True where query i (at positions[i], default i) may attend key j (at position j, S =
    num_keys, default T): j <= positions[i], and j > positions[i] - window when sliding."""
    i = (torch.arange(num_tokens, device=device) if positions is None else positions)[:, None]
    j = torch.arange(num_tokens if num_keys is None else num_keys, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


class ReferenceModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights
        self.dtype = weights["model.embed_tokens.weight"].dtype
        device = weights["model.embed_tokens.weight"].device
        self.inv_freq = {kind: rope.inv_freq(cfg.head_dim).to(device) for kind, rope in cfg.rope.items()}

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.cfg.rms_norm_eps, self.cfg.norm_plus_one)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.w["model.embed_tokens.weight"][token_ids]
        if self.cfg.embed_scale is not None:
            # Gemma multiplies by sqrt(hidden) rounded to the weights' dtype, as HF does.
            x = x * torch.tensor(self.cfg.embed_scale, dtype=self.dtype)
        return x

    def qkv(self, x: torch.Tensor, layer: int, positions: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [H, T, D], and k, v [K, T, D] as the cache holds them: after k-norm and RoPE at `positions` [T]
        (default 0..T-1)."""
        cfg, p = self.cfg, f"model.layers.{layer}.self_attn."
        t = x.shape[0]
        q = self.linear(x, p + "q_proj").view(t, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = self.linear(x, p + "k_proj").view(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = self.linear(x, p + "v_proj").view(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        if cfg.qk_norm:
            q, k = self.norm(q, p + "q_norm.weight"), self.norm(k, p + "k_norm.weight")
        positions = torch.arange(t, device=x.device) if positions is None else positions
        inv_freq = self.inv_freq[cfg.layer_types[layer]]
        return rotate(q, positions, inv_freq), rotate(k, positions, inv_freq), v

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v in float32, KV heads repeated for GQA; returns [T, H*D].
        q [H, T, D] at `positions` [T] (default 0..T-1); k, v [K, S, D] at positions 0..S-1."""
        group = self.cfg.num_queries_per_kv
        k = k.repeat_interleave(group, dim=0).float()
        v = v.repeat_interleave(group, dim=0).float()
        scores = torch.matmul(q.float(), k.transpose(1, 2)) * self.cfg.attn_scale        # [H, T, S]
        mask = attention_mask(q.shape[1], self.cfg.window(layer), q.device, positions, k.shape[1])
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.matmul(probs, v).to(q.dtype)                                         # [H, T, D]
        return out.transpose(0, 1).reshape(q.shape[1], -1)

    def mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp."
        gate = self.linear(x, p + "gate_proj")
        act = F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return self.linear(act * self.linear(x, p + "up_proj"), p + "down_proj")

    def layer_qkv(self, x: torch.Tensor, layer: int, positions: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's first half for rows x [T, hidden] at `positions` [T]: q [H, T, D], k, v [K, T, D]."""
        return self.qkv(self.norm(x, f"model.layers.{layer}.input_layernorm.weight"), layer, positions)

    def attend_rows(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's second half for rows x [T, hidden] with queries q [H, T, D] at `positions` [T] (default
        0..T-1), over the layer's k, v [K, S, D] at positions 0..S-1: attention, o_proj, residuals, MLP."""
        p = f"model.layers.{layer}."
        h = self.linear(self.attention(q, k, v, layer, positions), p + "self_attn.o_proj")
        if self.cfg.sandwich_norms:
            h = self.norm(h, p + "post_attention_layernorm.weight")
            x = x + h
            h = self.mlp(self.norm(x, p + "pre_feedforward_layernorm.weight"), layer)
            return x + self.norm(h, p + "post_feedforward_layernorm.weight")
        x = x + h
        return x + self.mlp(self.norm(x, p + "post_attention_layernorm.weight"), layer)

    def layer(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer; also returns the layer's cached k, v [K, T, D]."""
        q, k, v = self.layer_qkv(x, layer)
        return self.attend_rows(x, q, k, v, layer), k, v

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and soft-capping: x [T, hidden] -> logits [T, vocab] float32."""
        x = self.norm(x, "model.norm.weight")
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        logits = F.linear(x, head).float()
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids [T] -> (logits [T, vocab] float32, k, v [layers, T, K, D] in the model dtype)."""
        x = self.embed(token_ids)
        ks, vs = [], []
        for i in range(self.cfg.num_layers):
            x, k, v = self.layer(x, i)
            ks.append(k.transpose(0, 1))
            vs.append(v.transpose(0, 1))
        return self.logits(x), torch.stack(ks), torch.stack(vs)

    @torch.inference_mode()
    def extend(self, token_ids: torch.Tensor, start: int, past_k: torch.Tensor, past_v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids [T] at positions start.. after a given cache past_k, past_v [layers, >= start, K, D] (its
        first `start` rows are used) -> (logits [T, vocab] float32, k, v [layers, start + T, K, D]: the cache
        with the new rows appended). With the prompt's own K/V as the cache this equals `forward`'s rows."""
        if not 0 <= start <= past_k.shape[1] or past_k.shape != past_v.shape:
            raise ValueError(f"extend: start={start} with a cache of shapes {tuple(past_k.shape)} and "
                             f"{tuple(past_v.shape)}")
        positions = torch.arange(start, start + token_ids.shape[0], device=token_ids.device)
        x = self.embed(token_ids)
        ks, vs = [], []
        for i in range(self.cfg.num_layers):
            q, k, v = self.layer_qkv(x, i, positions)
            k = torch.cat([past_k[i, :start].transpose(0, 1), k], dim=1)                     # [K, start + T, D]
            v = torch.cat([past_v[i, :start].transpose(0, 1), v], dim=1)
            x = self.attend_rows(x, q, k, v, i, positions)
            ks.append(k.transpose(0, 1))
            vs.append(v.transpose(0, 1))
        return self.logits(x), torch.stack(ks), torch.stack(vs)
