"""Blend mode's quality against exact mode with the power to tell 2 points (issue #50 §3), for either engine.

    PYTHONPATH=$PWD python benchmarks/bench_blend_quality.py --model DIR --engine fast --dtype bfloat16 \\
        --device cuda --tasks 500 --two-hop-tasks 150 --out OUT [--speed-json ttft.json]

Tasks: benchmarks/quality_tasks.py (single-hop records, passkeys and functions; the two-hop family), framed as
benchmarks/bench_blend.py frames them (chat head, system chunk, documents between separators, the question).

Configurations (CONFIGURATIONS): (isolated | conditioned) x (kv-deviation | adaptive | chunk-heads), each at every
--ratios r, plus exact. "isolated" registers each document alone (`register_chunk(doc)`); "conditioned" registers
it after the context, everything before the first document (chat head + system chunk + the user turn's opening:
`register_chunk(doc, after=context)`). r = 0 recomputes no chunk token whatever the policy: it runs once per
context. A configuration the engine cannot run (no such policy, no `after`) is skipped and said so in every
output, or refused with --require-all. The isolated modes run before any conditioned registration (whose pages of
[context, document] would otherwise let an isolated request reuse its first document exactly); exact mode runs on
a second engine of the same checkpoint, so its pages never reach a blend's prefix cache.

Per mode and task, over one seeded task list:
- generated answer (greedy): right "as instructed" (the expected answer as written, upper case for the access
  codes) and "any case" (which separates retrieval from following the instruction);
- teacher forced over the expected answer (the K/V of the prompt less its last token from `prefill_kv`, batched;
  the reference model's rows over them, benchmarks/padded_forcing.py): "forced right" (every answer token the
  argmax: the issue's measure), top-1 agreement with exact mode's forcing and mean KL(exact || mode) per token;
- the share of the chunks' tokens recomputed (ChunkReuse.recomputed over the chunk pieces' tokens).
Accuracies get a paired bootstrap 95% interval of (mode - exact) over tasks (benchmarks/paired_bootstrap.py), per
family and for the single-hop families together. --reference-tasks N reruns the first N tasks on the reference
engine in --reference-dtype (float32) and reports its top-1 agreement and KL against this run's forcing, per mode.
Writes bench_blend_quality.md (also printed), .json (every per-task vector) and .png (accuracy with its interval
and KL against the recomputed share, one line per configuration; TTFT from --speed-json, written by
benchmarks/bench_blend_speed.py, on a second axis) into --out. Seconds per mode are wall time (generation and
forcing), indicative only on a shared CPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.bench_blend import (SYSTEM_PROMPT, ByteTokenizer, Framing, composite_prompt, stop_ids,
                                    without_last_token)
from benchmarks.padded_forcing import forced_logprobs
from benchmarks.paired_bootstrap import paired_bootstrap
from benchmarks.bench_blend import DOCS_PER_TASK
from benchmarks.quality_tasks import EASY_FAMILY, FAMILIES, POOL, SINGLE_HOP, Task, make_pool, make_tasks
from chunkwise.chunks import BLEND_POLICIES, Blend, Chunk
from chunkwise.sampling import SamplingParams

CONTEXTS = ("isolated", "conditioned")
POLICIES = ("kv-deviation", "adaptive", "chunk-heads")
DEFAULT_RATIOS = (0.0, 0.15, 0.3, 0.5)
GROUPS = {"single-hop": SINGLE_HOP, **{f: (f,) for f in FAMILIES}}   # the families each table covers
MEASURES = ("as_instructed", "any_case", "forced_right")


@dataclass(frozen=True)
class Configuration:
    """One line of the plot: how documents are registered and which policy picks the recomputed tokens."""
    context: str   # "isolated": register_chunk(doc); "conditioned": register_chunk(doc, after=context)
    policy: str    # a Blend policy

    @property
    def name(self) -> str:
        return f"{self.context} {self.policy}"


# The table of configurations: adding one is adding its row (its context must be in CONTEXTS).
CONFIGURATIONS = tuple(Configuration(c, p) for c in CONTEXTS for p in POLICIES)


def missing(engine, cfg: Configuration) -> str | None:
    """Why `engine` cannot run `cfg` (its policy or registration is not built), or None."""
    if cfg.policy not in BLEND_POLICIES:
        return f"Blend has no policy {cfg.policy!r} (policies: {list(BLEND_POLICIES)})"
    if cfg.context == "conditioned" and "after" not in inspect.signature(engine.register_chunk).parameters:
        return "register_chunk takes no after= (conditioned chunks)"
    return None


@dataclass(frozen=True)
class Mode:
    context: str          # "exact" for exact mode
    policy: str           # "exact"; "none" at r = 0 (no chunk token recomputed: every policy's r = 0)
    ratio: float

    @property
    def label(self) -> str:
        if self.context == "exact":
            return "exact"
        return f"{self.context} r=0" if self.policy == "none" else f"{self.context} {self.policy} r={self.ratio:g}"

    @property
    def reuse(self):
        if self.context == "exact":
            return "exact"
        return Blend(self.ratio, "kv-deviation" if self.policy == "none" else self.policy)


EXACT = Mode("exact", "exact", 1.0)


def modes_for(configurations: list[Configuration], ratios: list[float]) -> list[Mode]:
    """Every configuration's modes, contexts in CONTEXTS' order (isolated first), r = 0 once per context."""
    out = []
    for context in CONTEXTS:
        cfgs = [c for c in configurations if c.context == context]
        if cfgs and 0 in ratios:
            out.append(Mode(context, "none", 0.0))
        out += [Mode(context, c.policy, float(r)) for c in cfgs for r in ratios if r > 0]
    return out


class Prompts:
    """One engine's registered system chunk and documents per context, and the tasks' composite prompts."""

    def __init__(self, engine, tokenizer, pool, tasks: list[Task]):
        self.engine, self.pool, self.tasks = engine, pool, tasks
        self.framing = Framing(tokenizer, engine.model_config.bos_token_id)
        self.system = engine.register_chunk(self.framing.encode(SYSTEM_PROMPT))
        # everything before the first document: what a conditioned document is registered after
        self.context = [p for p in (self.framing.head, self.system, self.framing.middle) if p]
        self.answers = [self.framing.encode(t.answer) for t in tasks]
        self._prompts: dict[str, list] = {}

    def of(self, context: str) -> list:
        """The tasks' prompts with documents registered as `context` says ("exact": plain ids, no chunks)."""
        if context not in self._prompts:
            if context == "exact":
                self._prompts[context] = [flat(p) for p in self.of("isolated")]
            else:
                after = {} if context == "isolated" else {"after": self.context}
                docs = [self.engine.register_chunk(self.framing.encode(d.text), **after) for d in self.pool]
                self._prompts[context] = [composite_prompt(self.framing, self.system, docs, t) for t in self.tasks]
        return self._prompts[context]


def flat(prompt: list) -> list[int]:
    return [t for p in prompt for t in (p.token_ids if isinstance(p, Chunk) else p)]


def split_last(prompt: list) -> tuple[list, int]:
    """A prompt (composite, or plain ids) less its last token, and that token."""
    if prompt and isinstance(prompt[0], int):
        return prompt[:-1], prompt[-1]
    return without_last_token(prompt)


def prefill_many(engine, prompts: list, reuse) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`engine.prefill_kv` of each prompt; on the fast engine all queued at once, so the steps batch them."""
    if not hasattr(engine, "core"):
        return [engine.prefill_kv(p, reuse=reuse) for p in prompts]
    from chunkwise.engine.frontend import PREFIX_PARAMS
    with engine._lock:
        requests = engine.frontend.requests(prompts, PREFIX_PARAMS, None, reuse)
        sinks = []
        for request in requests:
            rid = engine.core.compute_prefix(request, gather_kv=True)
            sinks.append([])
            engine.outputs.add(rid, sink=sinks[-1])
    while not all(sinks):
        with engine._lock:
            engine.outputs.process(engine.core.step())
    for (done,) in sinks:
        if done.error is not None:
            raise RuntimeError(f"prefill_many: a request failed: {done.error}")
    return [done.kv for (done,) in sinks]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Measure:
    """Runs modes over the tasks: generation, batched teacher forcing, per-task vectors."""

    def __init__(self, model, tokenizer, tasks: list[Task], answers: list[list[int]], eos_token_ids,
                 batch: int, keep: int):
        self.model, self.tok, self.tasks, self.answers = model, tokenizer, tasks, answers
        self.stops = stop_ids(tokenizer, eos_token_ids)
        self.batch, self.keep = batch, keep
        self.full: list[torch.Tensor] | None = None      # exact mode's forced logprobs per task
        self.kept: dict[str, list[torch.Tensor]] = {}    # the first `keep` tasks' forced logprobs per mode

    def forced(self, engine, prompts: list, reuse):
        """(task index, its forced logprobs on the device), batch by batch: a run's whole set would not fit beside
        the engines (thousands of tasks × answer tokens × the vocabulary, in float32)."""
        for i in range(0, len(prompts), self.batch):
            heads, lasts = zip(*(split_last(p) for p in prompts[i:i + self.batch]))
            kvs = prefill_many(engine, list(heads), reuse)
            tokens = [[last] + a[:-1] for last, a in zip(lasts, self.answers[i:i + self.batch])]
            yield from enumerate(forced_logprobs(self.model, tokens, kvs), start=i)

    def run(self, engine, prompts: list, mode: Mode) -> dict:
        sync()
        began = time.perf_counter()
        params = [SamplingParams(max_tokens=len(a) + 4, stop_token_ids=self.stops) for a in self.answers]
        outs = engine.generate(prompts, params, reuse=mode.reuse, use_tqdm=False)
        texts = [self.tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        sync()
        generated = time.perf_counter() - began
        right, agree, kl, delta = [], [], [], 0.0
        full, kept = [], []
        for i, b in self.forced(engine, prompts, mode.reuse):
            a = self.answers[i]
            f = b if mode == EXACT else self.full[i].to(b.device, non_blocking=True)
            target = torch.tensor(a, device=b.device)
            right.append(int(bool((b.argmax(-1) == target).all())))
            agree.append(int((b.argmax(-1) == f.argmax(-1)).sum()))
            kl.append(float((f.exp() * (f - b)).sum(-1).clamp_min(0).sum()))
            delta = max(delta, float((b.gather(1, target[:, None]) - f.gather(1, target[:, None])).abs().max()))
            if mode == EXACT:
                full.append(b.cpu())   # exact's, for every later mode, in host memory
            if i < self.keep:
                kept.append(b)
        if mode == EXACT:
            self.full = full
        self.kept[mode.label] = kept
        sync()
        chunk = [sum(r.num_tokens for r in o.chunk_reuse or () if r.chunk is not None) for o in outs]
        recomputed = [sum(r.recomputed for r in o.chunk_reuse or () if r.chunk is not None) for o in outs]
        return dict(context=mode.context, policy=mode.policy, ratio=mode.ratio,
                    seconds=time.perf_counter() - began, seconds_generation=generated,
                    recomputed_share=sum(recomputed) / sum(chunk) if sum(chunk) else 1.0,
                    max_abs_delta_logprob=delta, outputs=texts,
                    as_instructed=[int(t.answer in x) for t, x in zip(self.tasks, texts)],
                    any_case=[int(t.answer.lower() in x.lower()) for t, x in zip(self.tasks, texts)],
                    forced_right=right, agree=agree, kl=kl, answer_tokens=[len(a) for a in self.answers])


def warm_up(engine, exact_engine, prompts: Prompts, measure: Measure) -> None:
    """Two prompts through each engine's generation and forcing first, so compilation is not timed."""
    if not hasattr(engine, "core"):   # the reference engine compiles nothing
        return
    few = slice(0, 2)
    params = SamplingParams(max_tokens=2)
    exact_engine.generate(prompts.of("exact")[few], params, use_tqdm=False)
    engine.generate(prompts.of("isolated")[few], params, reuse=Blend(0.15), use_tqdm=False)
    list(measure.forced(engine, prompts.of("isolated")[few], Blend(0.15)))


def summarize(results: dict[str, dict], tasks: list[Task], seed: int, resamples: int) -> dict[str, dict[str, dict]]:
    """Per group of families, per mode: accuracies, their paired interval against exact, agreement, KL."""
    out = {}
    for group, families in GROUPS.items():
        idx = [i for i, t in enumerate(tasks) if t.family in families]
        if not idx:
            continue
        rows = {}
        for label, r in results.items():
            pick = lambda key: [r[key][i] for i in idx]                                      # noqa: E731
            base = lambda key: [results["exact"][key][i] for i in idx]                       # noqa: E731
            row = dict(tasks=len(idx), recomputed_share=r["recomputed_share"], seconds=r["seconds"],
                       top1_agreement=sum(pick("agree")) / sum(pick("answer_tokens")),
                       mean_kl=sum(pick("kl")) / sum(pick("answer_tokens")))
            for m in MEASURES:
                row[m] = sum(pick(m)) / len(idx)
                row[f"{m}_vs_exact"] = asdict(paired_bootstrap(pick(m), base(m), seed, resamples))
            rows[label] = row
        out[group] = rows
    return out


def markdown(summary: dict, header: str, skipped: dict[str, str], agreement: dict | None) -> str:
    def ci(c: dict) -> str:
        return f"{100 * c['difference']:+.1f} [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"
    lines = [header, ""]
    for group, rows in summary.items():
        n = next(iter(rows.values()))["tasks"]
        note = " (the family exact mode should solve at >= 80%)" if group == EASY_FAMILY else ""
        lines += [f"### {group}: {n} tasks{note}", "",
                  "| mode | recomputed | as instructed | Δ vs exact [95% CI] | any case | Δ vs exact [95% CI] "
                  "| forced right | Δ vs exact [95% CI] | top-1 agreement | mean KL(exact‖mode) | seconds |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for label, r in rows.items():
            lines.append(f"| {label} | {r['recomputed_share']:.1%} | {r['as_instructed']:.1%} "
                         f"| {ci(r['as_instructed_vs_exact'])} | {r['any_case']:.1%} | {ci(r['any_case_vs_exact'])} "
                         f"| {r['forced_right']:.1%} | {ci(r['forced_right_vs_exact'])} | {r['top1_agreement']:.1%} "
                         f"| {r['mean_kl']:.4f} | {r['seconds']:.1f} |")
        lines.append("")
    if agreement:
        lines += [f"### reference engine ({agreement['dtype']}) against this run, first {agreement['tasks']} tasks",
                  "", "| mode | top-1 agreement | mean KL(reference‖this) | forced right: reference / this |",
                  "|---|---:|---:|---:|"]
        for label, a in agreement["modes"].items():
            lines.append(f"| {label} | {a['top1_agreement']:.1%} | {a['mean_kl']:.4f} "
                         f"| {a['forced_right_reference']} / {a['forced_right_this']} |")
        lines.append("")
    for name, why in skipped.items():
        lines.append(f"- skipped {name}: {why}")
    return "\n".join(lines) + "\n"


def speed_ttft(path: Path) -> dict[str, float]:
    """TTFT in ms per mode name of benchmarks/bench_blend_speed.py's ttft case, from its JSON (its own
    `{"ttft": {...}}` or pytest-benchmark's --benchmark-json, where the case's extra_info holds the same)."""
    data = json.loads(Path(path).read_text())
    if "benchmarks" in data:
        data = {b["name"].split("[")[0].removeprefix("test_"): b["extra_info"] for b in data["benchmarks"]}
        data = {"ttft": data.get("ttft_of_a_composed_request", {})}
    return {name: r["ttft_ms"] for name, r in data.get("ttft", {}).items() if "ttft_ms" in r}


def speed_points(ttft: dict[str, float]) -> dict[str, list[tuple[float, float]]]:
    """(r, TTFT ms) per policy from the speed bench's mode names ("blend r=0.15" is kv-deviation); its eager
    baselines ("blend r=0.15, eager") are left out."""
    points: dict[str, list[tuple[float, float]]] = {}
    for name, ms in ttft.items():
        if "eager" in name or "r=" not in name:
            continue
        policy, r = name.split(" r=")
        points.setdefault("kv-deviation" if policy == "blend" else policy, []).append((float(r), ms))
    return {p: sorted(v) for p, v in points.items()}


def plot(summary: dict, path: Path, title: str, ttft: dict[str, float] | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in ("single-hop", "two-hop") if g in summary]
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(6 * (len(groups) + 1), 4.6))
    colors = {p: f"C{i}" for i, p in enumerate(POLICIES)}
    for ax, group in zip(axes, groups):
        rows = summary[group]
        exact = rows["exact"]["any_case"]
        for cfg in CONFIGURATIONS:
            pts = sorted((r["recomputed_share"], r) for label, r in rows.items()
                         if label.startswith(cfg.context + " ") and (f" {cfg.policy} " in label or label.endswith("r=0")))
            if not any(f" {cfg.policy} " in label for label in rows if label.startswith(cfg.context + " ")):
                continue
            x = [p for p, _ in pts]
            y = [r["any_case"] for _, r in pts]
            err = [[r["any_case"] - (exact + r["any_case_vs_exact"]["low"]) for _, r in pts],
                   [exact + r["any_case_vs_exact"]["high"] - r["any_case"] for _, r in pts]]
            ax.errorbar(x, y, yerr=err, color=colors.get(cfg.policy), capsize=3, marker="o",
                        linestyle="-" if cfg.context == "conditioned" else "--", label=cfg.name)
            axes[-1].plot(x, [max(r["mean_kl"], 1e-6) for _, r in pts], color=colors.get(cfg.policy), marker=".",
                          linestyle="-" if cfg.context == "conditioned" else "--",
                          label=f"{cfg.name} ({group})", alpha=1.0 if group == "single-hop" else 0.5)
        ax.axhline(exact, color="grey", linestyle=":", label="exact")
        ax.set(xlabel="recomputed share of the chunks' tokens", ylabel="accuracy, any case",
               ylim=(-0.05, 1.05), title=f"{group}: accuracy (bars: paired 95% CI of Δ vs exact)")
        if ttft and group == "single-hop":
            twin = ax.twinx()
            for policy, pts in speed_points(ttft).items():
                twin.plot(*zip(*pts), color=colors.get(policy, "k"), marker="x", linestyle="none", markersize=9,
                          label=f"TTFT {policy} (speed bench, at r)")
            for name, style in (("exact", "-."), ("plain", ":")):
                if name in ttft:
                    twin.axhline(ttft[name], color="black", linestyle=style, alpha=0.4, label=f"TTFT {name}")
            twin.set(ylabel="TTFT ms (bench_blend_speed.py)", ylim=(0, None))
            twin.legend(fontsize=6, loc="lower right")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    axes[-1].set(xlabel="recomputed share of the chunks' tokens", yscale="log",
                 title="mean KL(exact ‖ mode) per answer token (floor 1e-6)")
    axes[-1].grid(alpha=0.3)
    axes[-1].legend(fontsize=5)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reference_agreement(path, args, pool, tasks: list[Task], measure: Measure, modes: list[Mode],
                        tokenizer) -> dict:
    """The reference engine in args.reference_dtype over the first tasks: its forcing against this run's."""
    from chunkwise.reference import Engine as Reference
    kw = {} if args.page_size is None else dict(page_size=args.page_size)
    ref = Reference(path, dtype=args.reference_dtype, device=args.device, max_model_len=args.max_model_len, **kw)
    subset = tasks[:args.reference_tasks]
    prompts = Prompts(ref, tokenizer, pool, subset)
    sub = Measure(ref.model, tokenizer, subset, prompts.answers, ref.model_config.eos_token_ids, measure.batch, 0)
    out = {}
    for mode in [EXACT] + [m for m in modes if m.ratio in args.reference_ratios]:
        mine = measure.kept[mode.label]
        theirs = (f for _, f in sub.forced(ref, prompts.of("exact" if mode == EXACT else mode.context),
                                           mode.reuse))
        agree = kl = right_ref = right_this = count = 0
        for a, f, b in zip(prompts.answers, theirs, mine):
            f, b = f.float(), b.to(f.device).float()
            target = torch.tensor(a, device=f.device)
            agree += int((b.argmax(-1) == f.argmax(-1)).sum())
            kl += float((f.exp() * (f - b)).sum(-1).clamp_min(0).sum())
            right_ref += int(bool((f.argmax(-1) == target).all()))
            right_this += int(bool((b.argmax(-1) == target).all()))
            count += len(a)
        out[mode.label] = dict(top1_agreement=agree / count, mean_kl=kl / count, forced_right_reference=right_ref,
                               forced_right_this=right_this)
    return dict(dtype=args.reference_dtype, tasks=len(subset), modes=out)


def ratios(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a real checkpoint name, a tiny one or a directory")
    ap.add_argument("--engine", choices=("fast", "reference"), default="fast")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tasks", type=int, default=500, help="single-hop tasks (the three families in turn)")
    ap.add_argument("--two-hop-tasks", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=ratios, default=list(POOL.values()),
                    help="documents per kind in the pool: records,passkeys,functions,managers")
    ap.add_argument("--docs", type=ratios, default=list(DOCS_PER_TASK), help="least,most documents per task")
    ap.add_argument("--ratios", type=ratios, default=list(DEFAULT_RATIOS))
    ap.add_argument("--configs", default="all",
                    help="comma-separated configuration names (e.g. 'isolated kv-deviation') or 'all'")
    ap.add_argument("--require-all", action="store_true", help="refuse to run when a configuration is unsupported")
    ap.add_argument("--batch", type=int, default=32, help="prompts per teacher-forcing pass")
    ap.add_argument("--reference-tasks", type=int, default=16, help="0: no reference engine check")
    ap.add_argument("--reference-dtype", default="float32")
    ap.add_argument("--speed-json", type=Path, default=None, help="bench_blend_speed.py's JSON (TTFT axis)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=None, help="the engines' (default: the engine's default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35,
                    help="the blend engine's share; the exact engine, made after it, fills up to twice that")
    ap.add_argument("--reference-ratios", type=ratios, default=[0, 0.15],
                    help="the modes at these r (and exact) are checked against the reference engine")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: modes not started by then are skipped (and said so in every output)")
    ap.add_argument("--resamples", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=Path("out/bench_blend_quality"))
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:   # before the long run, not at its plot
        raise SystemExit("bench_blend_quality.py plots with matplotlib: pip install -e '.[bench]'")
    from chunkwise.checkpoints import resolve_model
    from chunkwise.reference.model import ReferenceModel
    from chunkwise.tokenizer import load_tokenizer
    from chunkwise.weights import load_weights

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path) or ByteTokenizer()
    kw = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    if args.page_size is not None:
        kw["page_size"] = args.page_size
    began = time.perf_counter()
    if args.engine == "fast":
        from chunkwise import Engine
        kw.update(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256)
        # the second engine's share counts the first's memory as used (chunkwise/engine/kv_cache.py)
        engine = Engine(path, **kw, gpu_memory_utilization=args.gpu_memory_utilization)
        exact_engine = Engine(path, **kw, gpu_memory_utilization=2 * args.gpu_memory_utilization)
        model = ReferenceModel(engine.model_config, load_weights(path, engine.engine_config.dtype,
                                                                 engine.engine_config.device, cfg=engine.model_config))
    else:
        from chunkwise.reference import Engine
        engine, exact_engine = Engine(path, **kw), Engine(path, **kw)
        model = engine.model
    wanted = list(CONFIGURATIONS) if args.configs == "all" else [
        next(c for c in CONFIGURATIONS if c.name == n.strip()) for n in args.configs.split(",")]
    skipped = {c.name: why for c in wanted if (why := missing(engine, c)) is not None}
    if skipped and args.require_all:
        raise SystemExit(f"--require-all: this engine cannot run {skipped}")
    configurations = [c for c in wanted if c.name not in skipped]
    modes = modes_for(configurations, args.ratios)

    pool = make_pool(args.seed, dict(zip(POOL, (int(n) for n in args.pool))))
    tasks = make_tasks(args.seed, args.tasks, args.two_hop_tasks, pool, tuple(int(d) for d in args.docs))
    prompts = Prompts(engine, tokenizer, pool, tasks)
    measure = Measure(model, tokenizer, tasks, prompts.answers, engine.model_config.eos_token_ids, args.batch,
                      args.reference_tasks)
    lengths = [len(p) for p in prompts.of("exact")]
    header = (f"Blend quality against exact mode: {args.model}, {args.engine} engine, {args.dtype} on "
              f"{engine.engine_config.device}, {len(tasks)} tasks (seed {args.seed}; {args.tasks} single-hop, "
              f"{args.two_hop_tasks} two-hop; prompts {min(lengths)}..{max(lengths)} tokens)")
    print(f"{header}\nsetup {time.perf_counter() - began:.1f} s; modes: {[m.label for m in modes]}; "
          f"skipped: {skipped or 'none'}", flush=True)
    warm_up(engine, exact_engine, prompts, measure)
    results = {"exact": measure.run(exact_engine, prompts.of("exact"), EXACT)}
    print(f"[exact] {results['exact']['seconds']:.1f} s", flush=True)
    for mode in modes:
        if args.deadline is not None and time.perf_counter() - began > args.deadline:
            skipped[mode.label] = f"not started: past --deadline {args.deadline:g} s"
            continue
        results[mode.label] = measure.run(engine, prompts.of(mode.context), mode)
        print(f"[{mode.label}] {results[mode.label]['seconds']:.1f} s", flush=True)
    modes = [m for m in modes if m.label in results]
    agreement = None
    if args.reference_tasks:
        t = time.perf_counter()
        agreement = reference_agreement(path, args, pool, tasks, measure, modes, tokenizer)
        agreement["seconds"] = time.perf_counter() - t
    summary = summarize(results, tasks, args.seed, args.resamples)
    ttft = speed_ttft(args.speed_json) if args.speed_json else None
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(summary, header, skipped, agreement)
    (args.out / "bench_blend_quality.md").write_text(text)
    (args.out / "bench_blend_quality.json").write_text(json.dumps(dict(
        model=str(args.model), engine=args.engine, dtype=args.dtype, seed=args.seed, ratios=args.ratios,
        skipped=skipped, prompt_lengths=lengths, tasks=[asdict(t) for t in tasks], summary=summary,
        results=results, reference_agreement=agreement, ttft_ms=ttft,
        seconds=time.perf_counter() - began), indent=1))
    plot(summary, args.out / "bench_blend_quality.png", header, ttft)
    print(text, flush=True)
    return dict(summary=summary, results=results, skipped=skipped, agreement=agreement)


if __name__ == "__main__":
    main()
