"""The optimized model forward over the flat batch of one engine step, for every family of `ModelConfig`.

Independent of `reference/` on purpose: a bug shared by both would hide from the parity suite.
Per layer, the new tokens' K/V go into the paged cache first (`store_kv`); attention then reads pages only,
so prefill, chunked prefill and decode read K/V the same way (DESIGN.md, point 3).

Flat-batch layout (built by `ModelRunner`): tokens of the sequences that bring prompt chunks come first
(sequence s owns rows query_start_loc[s]:query_start_loc[s+1]), then one token per decoding sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkwise.config import ModelConfig
from kernels import paged_attention, split_kv_decode, store_kv
from kernels.split_kv import DEFAULT_SPLIT_SIZE


@dataclass
class StepInputs:
    """Device tensors of one step. T = tokens, P = prefill sequences, D = decoding sequences."""
    input_ids: torch.Tensor          # int64 [T]
    positions: torch.Tensor          # int64 [T], absolute positions in each sequence
    slot_mapping: torch.Tensor       # int64 [T], page_id * page_size + offset; -1 = padding, not stored
    block_tables: torch.Tensor       # int32 [P, max_pages] of the prefill sequences
    seq_lens: torch.Tensor           # int32 [P], tokens in the cache after this step, new ones included
    query_start_loc: torch.Tensor    # int32 [P + 1]
    decode_block_tables: torch.Tensor  # int32 [D, max_pages]
    decode_seq_lens: torch.Tensor      # int32 [D]
    logits_indices: torch.Tensor     # int64 [N], rows whose logits are sampled (each one's last new token)

    @property
    def num_prefill_tokens(self) -> int:
        return self.input_ids.shape[0] - self.decode_seq_lens.shape[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """RMSNorm over the last dim in float32; Gemma applies (1 + w) before casting back, Llama w after."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by half-split RoPE; cos/sin [T, head_dim] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Model:
    """Weights (HF names, fused where it saves launches) and the step forward; no cache of its own."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split_size: int = DEFAULT_SPLIT_SIZE):
        self.cfg = cfg
        self.split_size = split_size   # split-KV split length in tokens
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = [self._layer_weights(weights, i) for i in range(cfg.num_layers)]
        # RoPE depends only on the positions and the layer's RoPE config: one inv_freq per distinct config
        # (e.g. Gemma's local/global), and cos/sin built once per step for each, not once per layer.
        ropes = [cfg.rope_for(i) for i in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(ropes))
        self.rope_index = [distinct.index(r) for r in ropes]
        self.inv_freqs = [r.inv_freq(cfg.head_dim).to(self.embed.device) for r in distinct]
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=self.embed.dtype)
                            if cfg.embed_scale is not None else None)

    def _layer_weights(self, w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        out = {
            "qkv": torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "o": w[p + "self_attn.o_proj.weight"],
            "gate_up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            "down": w[p + "mlp.down_proj.weight"],
            "input_norm": w[p + "input_layernorm.weight"],
            "post_attn_norm": w[p + "post_attention_layernorm.weight"],
        }
        if self.cfg.attention_bias:
            out["qkv_bias"] = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        if self.cfg.o_proj_bias:
            out["o_bias"] = w[p + "self_attn.o_proj.bias"]
        if self.cfg.qk_norm:
            out["q_norm"], out["k_norm"] = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        if self.cfg.sandwich_norms:
            out["pre_ff_norm"] = w[p + "pre_feedforward_layernorm.weight"]
            out["post_ff_norm"] = w[p + "post_feedforward_layernorm.weight"]
        return out

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.norm_plus_one)

    def forward(self, inp: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows `inp.logits_indices`, after writing every layer's K/V."""
        x = F.embedding(inp.input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = [self._cos_sin(inp.positions, inv_freq, x.dtype) for inv_freq in self.inv_freqs]
        for i, lw in enumerate(self.layers):
            x = self._layer(i, lw, x, inp, kv_caches[i], rope[self.rope_index[i]])
        x = x[inp.logits_indices]
        logits = (self._norm(x, self.final_norm) @ self.lm_head.t()).float()
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    @staticmethod
    def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, head_dim] in dtype for half-split RoPE at the given positions."""
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _layer(self, i: int, lw: dict, x: torch.Tensor, inp: StepInputs, kv, rope) -> torch.Tensor:
        h = self._attention(i, lw, self._norm(x, lw["input_norm"]), inp, kv, rope)
        if self.cfg.sandwich_norms:
            x = x + self._norm(h, lw["post_attn_norm"])
            h = self._mlp(lw, self._norm(x, lw["pre_ff_norm"]))
            return x + self._norm(h, lw["post_ff_norm"])
        x = x + h
        return x + self._mlp(lw, self._norm(x, lw["post_attn_norm"]))

    def _mlp(self, lw: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ lw["gate_up"].t()).chunk(2, dim=-1)
        act = F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return (act * up) @ lw["down"].t()

    def _attention(self, i: int, lw: dict, x: torch.Tensor, inp: StepInputs, kv, rope) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        qkv = x @ lw["qkv"].t()
        if "qkv_bias" in lw:
            qkv = qkv + lw["qkv_bias"]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = qkv[:, :q_size].reshape(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(t, cfg.num_kv_heads, cfg.head_dim).contiguous()
        if cfg.qk_norm:
            q, k = self._norm(q, lw["q_norm"]), self._norm(k, lw["k_norm"])
        cos, sin = rope
        q, k = apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin).contiguous()

        k_cache, v_cache = kv
        store_kv(k, v, k_cache, v_cache, inp.slot_mapping)
        out = torch.empty_like(q)
        window, p = cfg.window(i), inp.num_prefill_tokens
        if p:
            paged_attention(q[:p], k_cache, v_cache, inp.block_tables, inp.seq_lens, inp.query_start_loc,
                            cfg.attn_scale, sliding_window=window, out=out[:p])
        if p < t:
            split_kv_decode(q[p:], k_cache, v_cache, inp.decode_block_tables, inp.decode_seq_lens,
                            cfg.attn_scale, sliding_window=window, split_size=self.split_size, out=out[p:])
        out = out.reshape(t, q_size) @ lw["o"].t()
        return out + lw["o_bias"] if "o_bias" in lw else out
