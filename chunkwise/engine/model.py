"""The optimized model forward over the flat batch of one engine step, for every family of `ModelConfig`.

Independent of `reference/` on purpose: a bug shared by both would hide from the parity suite.
Per layer, the new tokens' K/V go into the paged cache first (`rope_store`, fused with q/k-norm and RoPE);
attention then reads pages only, so prefill, chunked prefill and decode read K/V the same way
(docs/ARCHITECTURE.md, lesson 3). Each residual add is folded into the norm after it (`add_rms_norm`), so a
decode layer is: norm, QKV GEMM, rope_store, attention, O GEMM, norm, gate_up GEMM, act_and_mul, down GEMM.
A step with a row plan (`StepInputs.row_plan`, chunkwise/engine/row_plan.py) places K/V before its first layer, and its
check layers narrow its rows on the device, in fixed shapes where a blend graph replays the whole step
(chunkwise/engine/blend_graphs.py); the residual stream after them (`LayerState`) is all the later layers need.

Deterministic mode (`deterministic=True`): every op on a token's path gives that token the same bits whatever its
batch-mates, chunk boundaries or page size, and whether prefill, decode or a recompute computes it. The GEMMs take
`chunkwise.kernels.matmul` (no split-K, tiles that keep a row's MMA chain) instead of torch's M-dependent BLAS;
decodes take the single pass that prefill rows take (`paged_decode`), not split-KV, and every attention row sums
its probabilities by dot (`sum_by_dot`), so its bits do not depend on the tile either. Norms, RoPE+store and the
activation already keep a row's bits (their rows per program depend on the width only), and RoPE's cos/sin are
elementwise.

Tensor parallelism (`tp`, see chunkwise/engine/distributed/tensor_parallel.py): the weights are one rank's shard; the
embedding, o_proj and down_proj outputs are summed over the ranks (one all_reduce each; with the custom all-reduce,
inside the next norm's kernel), so every rank carries the same residual stream, and each ends with its slice of the
logits (`TensorParallel.argmax_logits` and `gather_logits` take it from there). Without `tp` the forward calls no
collective.

Flat-batch layout (built by `ModelRunner`): tokens of the sequences that bring prompt chunks come first
(sequence s owns rows query_start_loc[s]:query_start_loc[s+1]), then one token per decoding sequence.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from chunkwise.chunks import DEVIATION_NOISE
from chunkwise.model_config import ModelConfig
from chunkwise.kernels import (CascadeGroups, act_and_mul, add_rms_norm, cascade_decode, matmul, paged_attention,
                               paged_decode, rms_norm, rope_cos_sin, rope_store, split_kv_decode)
from chunkwise.kernels.fa3 import fa3_paged_attention
from chunkwise.kernels.matmul import config_changes
from chunkwise.kernels.paged_attention import paged_split_workspace
from chunkwise.kernels.split_kv import DEFAULT_SPLIT_SIZE, SplitWorkspace, num_splits_for, split_workspace
from chunkwise.engine.kv_cache import LayerCaches
from chunkwise.engine.distributed.tensor_parallel import TensorParallel
from chunkwise.engine.row_plan import RowInputs, padded_slots, select_padded, select_rows
from chunkwise.kernels.relocate import relocate_kv


@dataclass
class StepInputs:
    """Device tensors of one step. T = tokens, P = prefill sequences, D = decoding sequences."""
    input_ids: torch.Tensor          # int64 [T]
    positions: torch.Tensor          # int64 [T], absolute positions in each sequence
    slot_mapping: torch.Tensor       # int64 [T], page_id * page_size + offset; -1 = padding, not stored
    page_tables: torch.Tensor       # int32 [P, max_pages] of the prefill sequences
    seq_lens: torch.Tensor           # int32 [P], tokens in the cache after this step, new ones included
    query_start_loc: torch.Tensor    # int32 [P + 1]
    decode_page_tables: torch.Tensor  # int32 [D, max_pages]
    decode_seq_lens: torch.Tensor      # int32 [D]
    logits_indices: torch.Tensor     # int64 [N], rows whose logits are sampled (each one's last new token)
    cascade: CascadeGroups | None = None   # decodes' shared splits, read once per group (None: none shared)
    row_plan: RowInputs | None = None      # its row plan (chunkwise/engine/row_plan.py): rows above are layer 0's
    explicit_positions: bool = False       # prefill rows sit at `positions`, not at their sequences' ends (planned)

    @property
    def num_prefill_tokens(self) -> int:
        return self.input_ids.shape[0] - self.decode_seq_lens.shape[0]


@dataclass
class LayerState:
    """The residual stream of a step between two layers: what the layers from `layer` on need."""
    layer: int                         # the next layer to run
    h: torch.Tensor                    # [T, hidden]: the last sublayer's output (the embedding before layer 0)
    residual: torch.Tensor | None      # [T, hidden]: the residual stream before it (None before layer 0)
    inp: StepInputs                    # the step's inputs as of `layer` (a row plan's rows after its selections)


# A step of at most this many prefill rows splits their context across programs every PREFILL_SPLIT_SIZE positions,
# in PREFILL_SPLIT_TILE_ROWS-row tiles (paged_attention's split_size): such a chunk fills few programs, each
# sweeping the whole context.
# Chosen by benchmarks/attention_rows.py: docs/BENCHMARKS.md, "Behind the code: PREFILL_SPLIT_ROWS".
PREFILL_SPLIT_ROWS = 512
PREFILL_SPLIT_SIZE = 512
PREFILL_SPLIT_TILE_ROWS = 128   # the split launches' tile cap, and so their workspace's
# A row plan's rows (explicit positions) lie anywhere in the context, each query block spanning much of it: they
# take tiles of PLANNED_TILE_ROWS rows, and up to PLANNED_SPLIT_ROWS rows split every PLANNED_SPLIT_SIZE positions.
# Chosen by benchmarks/attention_planned.py: docs/BENCHMARKS.md, "Behind the code: PLANNED_SPLIT_SIZE".
PLANNED_SPLIT_ROWS = 1024
PLANNED_SPLIT_SIZE = 2048
PLANNED_TILE_ROWS = 128
# One-pass prefill tiles' rows (256 on Hopper, else 128: tile_config), in both modes (docs/BENCHMARKS.md,
# "Behind the code: PREFILL_TILE_ROWS"). Deterministic mode's decodes take 16-row tiles (paged_decode with
# sum_by_dot), whose rows get these tiles' bits.
PREFILL_TILE_ROWS = 256


class Model:
    """Weights (HF names, fused where it saves launches) and the step forward; no cache of its own."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split_size: int = DEFAULT_SPLIT_SIZE,
                 deterministic: bool = False, tp: TensorParallel | None = None, fa3_prefill: bool = False):
        self.cfg = cfg
        self.deterministic = deterministic
        # Prefill rows at their sequences' ends take vLLM's FA3 (EngineConfig.attention_backend="fa3"), split
        # where chunkwise's kernel would split them; a row plan's rows (explicit positions) keep chunkwise's kernel.
        self.fa3_prefill = fa3_prefill
        self.split_size = split_size   # split-KV split length in tokens
        self.tp = tp                   # None: the whole model on one device
        # With the custom all-reduce, a sublayer's output leaves as this rank's partial sum and is reduced in the
        # next norm's kernel: for every sublayer or none, so not with Gemma's sandwich norms or an o_proj bias, which
        # come between an attention's sum and its norm.
        self.reduce_in_norm = (tp is not None and tp.custom is not None and not cfg.sandwich_norms
                               and not cfg.o_proj_bias)
        self.embed = weights["model.embed_tokens.weight"]
        # A mixed step's decodes (memory-bound) run on this stream beside its prefill attention (compute-bound,
        # one 256-row program per SM), on the SMs the prefill's last wave leaves idle (docs/BENCHMARKS.md,
        # "Behind the code: side_stream"). Deterministic mode's too: which SM runs a
        # program, and when, changes none of its bits. None on the CPU.
        device = self.embed.device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        if tp is not None and self.lm_head.shape[0] < tp.vocab_rows:   # the last vocabulary slices: zero rows
            self.lm_head = F.pad(self.lm_head, (0, 0, 0, tp.vocab_rows - self.lm_head.shape[0]))
        self.layers = [self._layer_weights(weights, i) for i in range(cfg.num_layers)]
        # RoPE depends only on the positions and the layer's RoPE config: one inv_freq per distinct config
        # (e.g. Gemma's local/global), and cos/sin built once per step for each, not once per layer.
        ropes = [cfg.rope_for(i) for i in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(ropes))
        self.rope_index = [distinct.index(r) for r in ropes]
        self.inv_freqs = [r.inv_freq(cfg.head_dim).to(self.embed.device) for r in distinct]
        self.rope_layers = [torch.tensor([i for i, x in enumerate(self.rope_index) if x == r], dtype=torch.int64,
                                         device=self.embed.device) for r in range(len(distinct))]
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

    def _add_norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  pre_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) for the residual stream s = residual + h, or residual + norm_pre(h) when pre_weight is
        given; before the first layer there is no residual yet and s = h (the embedding, already reduced).
        With `reduce_in_norm`, h is summed over the ranks here first."""
        eps, plus_one = self.cfg.rms_norm_eps, self.cfg.norm_plus_one
        if residual is None:
            return rms_norm(h, weight, eps, plus_one), h
        if self.reduce_in_norm:   # h is a sublayer's partial sum
            if self.tp.custom.fits(h):
                return self.tp.custom.add_rms_norm(h, residual, weight, eps, plus_one)
            self.tp.all_reduce(h)
        return add_rms_norm(h, residual, weight, eps, plus_one, pre_weight=pre_weight)

    def forward(self, inp: StepInputs, kv_caches: LayerCaches, place: bool = True) -> torch.Tensor:
        """Logits [N, vocab] for the rows `inp.logits_indices` (the model's dtype; float32 when soft-capped), after
        writing every layer's K/V; under tensor parallelism, this rank's [N, P] slice of them (soft-capped alike).

        A step with a row plan places its K/V and runs its check layers here; from the first layer after them its
        rows are fixed. `place=False`: the plan's K/V are placed already (a blend graph places them before its
        replay, chunkwise/engine/blend_graphs.py)."""
        h = self._embed(inp.input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        state = LayerState(0, h, None, inp)
        plan = inp.row_plan
        if plan is not None:
            if place:
                self.place(plan, kv_caches)
            if plan.checks:
                state = self._layers(state, kv_caches, max(plan.checks) + 1, plan)
            else:   # every row goes on through every layer
                plan.kept = torch.arange(h.shape[0], device=h.device)
        return self.tail(state, kv_caches)

    def tail(self, state: LayerState, kv_caches: LayerCaches) -> torch.Tensor:
        """The logits after running the layers from `state.layer` on (no check layer among them)."""
        state = self._layers(state, kv_caches, len(self.layers))
        x, _ = self._add_norm(state.h, state.residual, self.final_norm, self._pending(state.layer))
        logits = self._linear(x[state.inp.logits_indices], self.lm_head)   # row-wise: norm all rows, then pick
        cap = self.cfg.final_logit_softcapping
        if cap:
            return torch.tanh(logits.float() / cap) * cap
        # Left in the model's dtype: its conversion to float32 is exact, so argmax sees the same values, and
        # sampling and logprobs convert the rows they read; converting all [N, vocab] here took about 2% of a
        # decode step on Qwen3's 152k vocabulary.
        return logits

    def _pending(self, layer: int) -> torch.Tensor | None:
        """Gemma's post-FF norm of the layer before `layer`, applied inside the next norm's kernel."""
        return self.layers[layer - 1]["post_ff_norm"] if self.cfg.sandwich_norms and layer > 0 else None

    def _layers(self, state: LayerState, kv_caches: LayerCaches, stop: int,
                plan: RowInputs | None = None) -> LayerState:
        """Runs layers state.layer..stop-1. With a row `plan` (from layer 0), its check layers select the rows that
        go on, and its `kept` becomes the rows (layer-0 layout) left after `stop`."""
        inp, h, residual = state.inp, state.h, state.residual
        # RoPE's cos/sin are elementwise in the positions: made once here for every layer (a selection narrows
        # them as it narrows the positions).
        rope = [rope_cos_sin(inp.positions, inv_freq) for inv_freq in self.inv_freqs]
        split_decodes = not self.deterministic and inp.decode_seq_lens.shape[0] > 0
        workspace = self._split_workspace(inp, kv_caches[0][0]) if split_decodes else None
        prefill_workspace = self._prefill_workspace(inp, kv_caches[0][0], selecting=plan is not None)
        if plan is not None:
            placed_rows, groups = plan.placed, plan.groups
            kept = torch.arange(placed_rows.shape[0], device=h.device)
        # A sublayer's output h joins the residual stream inside the next norm's kernel. Gemma normalizes h
        # first (post-attention / post-FF norm): that norm (`pending` for the post-FF one) goes in the same kernel.
        pending = self._pending(state.layer)
        for i in range(state.layer, stop):
            lw = self.layers[i]
            x, residual = self._add_norm(h, residual, lw["input_norm"], pending)
            check = plan.checks.get(i) if plan is not None else None
            placed = self._kv_rows(kv_caches[i], inp.slot_mapping) if check is not None else None
            q = self._qkv_store(lw, x, inp, kv_caches[i], rope[self.rope_index[i]])
            if check is not None:   # keep the rows that go on: unplaced ones and the most deviating placed ones
                fresh = self._kv_rows(kv_caches[i], inp.slot_mapping)
                (fk, fv), (pk, pv) = fresh, placed   # p promotes to float32 exactly: one launch fewer each
                fk, fv = fk.float(), fv.float()
                deviation = (fk - pk).square().sum((1, 2)) + (fv - pv).square().sum((1, 2))
                noise = DEVIATION_NOISE * (fk.square().sum((1, 2)) + fv.square().sum((1, 2)))
                deviation = deviation.masked_fill(deviation <= noise, 0)
                padded = check.padded
                keep = (select_rows(check, deviation, placed_rows, groups) if padded is None
                        else select_padded(padded, deviation, placed_rows))
                q, residual, placed_rows, kept = q[keep], residual[keep], placed_rows[keep], kept[keep]
                groups = groups[keep] if groups is not None else None
                rope = [(cos[keep], sin[keep]) for cos, sin in rope]
                slots = inp.slot_mapping[keep]
                inp = replace(inp, input_ids=inp.input_ids[keep], positions=inp.positions[keep],
                              slot_mapping=slots if padded is None else padded_slots(padded, slots),
                              query_start_loc=check.query_start_loc)
            h = self._attention(i, lw, q, inp, kv_caches[i], workspace, prefill_workspace)
            if self.cfg.sandwich_norms:
                x, residual = self._add_norm(h, residual, lw["pre_ff_norm"], lw["post_attn_norm"])
                pending = lw["post_ff_norm"]
            else:
                x, residual = self._add_norm(h, residual, lw["post_attn_norm"])
            h = self._mlp(lw, x)
        if plan is not None:
            plan.kept = kept
        return LayerState(stop, h, residual, inp)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.embed)
        local = ids - self.tp.vocab.start
        inside = (local >= 0) & (local < self.embed.shape[0])
        h = F.embedding(torch.where(inside, local, 0), self.embed)
        return self.tp.all_reduce(h.masked_fill_(~inside[:, None], 0))

    def _heads(self) -> tuple[int, int]:
        """(query heads, KV heads) of this rank."""
        if self.tp is not None:
            return len(self.tp.q_heads), len(self.tp.kv_heads)
        return self.cfg.num_heads, self.cfg.num_kv_heads

    def _split_workspace(self, inp: StepInputs, k_cache: torch.Tensor) -> SplitWorkspace:
        """The split-KV decodes' scratch, made once per step and shared by every layer (one stream)."""
        tables = inp.decode_page_tables
        heads, kv_heads = self._heads()
        return split_workspace(tables.shape[0], heads, kv_heads, self.cfg.head_dim,
                               num_splits_for(tables.shape[1], k_cache.shape[1], self.split_size), tables.device)

    def _fa3(self, inp: StepInputs) -> bool:
        """Whether the step's prefill rows take vLLM's FA3: with attention_backend="fa3", unless they are a row
        plan's (explicit positions, which FA3 does not take)."""
        return self.fa3_prefill and not inp.explicit_positions

    def _prefill_workspace(self, inp: StepInputs, k_cache: torch.Tensor, selecting: bool) -> SplitWorkspace | None:
        """The scratch of a step whose prefill rows split their context, made once per run of layers for each of
        them; None for one pass: larger steps, a row plan's layers up to its last check layer (`selecting`: its
        selection changes the rows' count per layer), and deterministic mode (where a token's bits must not depend
        on the step that computes it). A row plan's rows after its check layers split up to PLANNED_SPLIT_ROWS."""
        p = inp.num_prefill_tokens
        cap = PLANNED_SPLIT_ROWS if inp.explicit_positions else PREFILL_SPLIT_ROWS
        if self.deterministic or selecting or not 0 < p <= cap or self._fa3(inp):
            return None
        return paged_split_workspace(p, self._heads()[0], self.embed.dtype, k_cache, inp.page_tables,
                                     *self._prefill_split(inp, True))

    @staticmethod
    def _prefill_split(inp: StepInputs, split: bool) -> tuple[int | None, int]:
        """(split_size or None, tile rows) of a step's prefill attention."""
        if inp.explicit_positions:
            return (PLANNED_SPLIT_SIZE if split else None), PLANNED_TILE_ROWS
        return (PREFILL_SPLIT_SIZE, PREFILL_SPLIT_TILE_ROWS) if split else (None, PREFILL_TILE_ROWS)

    def warm_up_deterministic(self, max_rows: int) -> None:
        """Deterministic mode: compiles what the eager warm-up's small steps do not reach, so that none compiles
        inside a user's step: one product per tile that a step of up to max_rows rows takes (matmul_config grows
        its tiles with the rows). Each writes scratch."""
        if not self.deterministic:
            return
        lw = self.layers[0]
        for w in (lw["qkv"], lw["o"], lw["gate_up"], lw["down"], self.lm_head):
            for m in config_changes(w.shape[0], w.shape[1], w.dtype, w.device, max_rows):
                matmul(torch.zeros(m, w.shape[1], dtype=w.dtype, device=w.device), w)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T for a weight w [out, in]: batch-invariant in deterministic mode, torch's BLAS otherwise."""
        return matmul(x, w) if self.deterministic else x @ w.t()

    def _mlp(self, lw: dict, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(act_and_mul(self._linear(x, lw["gate_up"]), self.cfg.hidden_act), lw["down"])
        return out if self.tp is None or self.reduce_in_norm else self.tp.all_reduce(out)

    def _decode_attention(self, q: torch.Tensor, out: torch.Tensor, inp: StepInputs, kv, window: int | None,
                          workspace: SplitWorkspace | None) -> None:
        """The decodes' attention into out: single-pass in deterministic mode (paged_decode), else split-KV,
        reading shared prefixes once where the step has cascade groups."""
        k_cache, v_cache = kv
        args = (q, k_cache, v_cache, inp.decode_page_tables, inp.decode_seq_lens)
        if self.deterministic:
            paged_decode(*args, self.cfg.attn_scale, sliding_window=window, out=out, sum_by_dot=True)
        elif inp.cascade is not None:
            cascade_decode(*args, inp.cascade, self.cfg.attn_scale, sliding_window=window,
                           split_size=self.split_size, out=out, workspace=workspace)
        else:
            split_kv_decode(*args, self.cfg.attn_scale, sliding_window=window, split_size=self.split_size,
                            out=out, workspace=workspace)

    def place(self, plan: RowInputs, kv_caches: LayerCaches) -> None:
        """Every layer's K/V from the plan's source slots to its placed rows' slots, K re-rotated by its layer's RoPE:
        one launch per distinct RoPE config (e.g. Gemma's local and global), over the layers that share it."""
        for inv_freq, layers in zip(self.inv_freqs, self.rope_layers):
            relocate_kv(kv_caches.k, kv_caches.v, plan.src_slots, plan.dst_slots, plan.deltas, inv_freq,
                        layers=layers)

    @staticmethod
    def _kv_rows(kv, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V [rows, kv_heads, head_dim] at the cache slots."""
        k_cache, v_cache = kv
        slots = slots.clamp(min=0)   # a padding row (slot -1, a blend graph's) reads slot 0 and is never kept
        return tuple(c.view(-1, *c.shape[2:]).index_select(0, slots) for c in (k_cache, v_cache))

    def _qkv_store(self, lw: dict, x: torch.Tensor, inp: StepInputs, kv, rope) -> torch.Tensor:
        """The rows' rotated q; their K/V go into the cache."""
        cfg = self.cfg
        k_cache, v_cache = kv
        cos, sin = rope
        return rope_store(self._linear(x, lw["qkv"]), lw.get("qkv_bias"), lw.get("q_norm"), lw.get("k_norm"), cos,
                          sin, inp.slot_mapping, k_cache, v_cache, cfg.rms_norm_eps, cfg.norm_plus_one)

    def _attention(self, i: int, lw: dict, q: torch.Tensor, inp: StepInputs, kv, workspace: SplitWorkspace | None,
                   prefill_workspace: SplitWorkspace | None) -> torch.Tensor:
        cfg, t = self.cfg, q.shape[0]
        k_cache, v_cache = kv
        out = torch.empty_like(q)
        window, p = cfg.window(i), inp.num_prefill_tokens
        # Prefill and decodes write disjoint rows of out; the step's stream waits for the side stream before
        # out is read.
        side = self.side_stream if 0 < p < t else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(q.device))
        if p < t:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                self._decode_attention(q[p:], out[p:], inp, kv, window, workspace)
        if p and self._fa3(inp):
            fa3_paged_attention(q[:p], k_cache, v_cache, inp.page_tables, inp.seq_lens, inp.query_start_loc,
                                cfg.attn_scale, sliding_window=window, out=out[:p], split=p <= PREFILL_SPLIT_ROWS)
        elif p:
            split_size, tile_rows = self._prefill_split(inp, prefill_workspace is not None)
            paged_attention(q[:p], k_cache, v_cache, inp.page_tables, inp.seq_lens, inp.query_start_loc,
                            cfg.attn_scale, sliding_window=window, out=out[:p], max_rows=tile_rows,
                            positions=inp.positions[:p] if inp.explicit_positions else None,
                            split_size=split_size, workspace=prefill_workspace, sum_by_dot=self.deterministic)
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
        out = self._linear(out.reshape(t, -1), lw["o"])
        if self.tp is not None and not self.reduce_in_norm:
            self.tp.all_reduce(out)
        return out + lw["o_bias"] if "o_bias" in lw else out
