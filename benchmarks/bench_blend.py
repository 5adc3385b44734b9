"""Blend mode's quality against full recompute on RAG-shaped tasks (issue #28 §4), for either engine.

    PYTHONPATH=$PWD python benchmarks/bench_blend.py --engine reference --model qwen2.5-coder-0.5b --tasks 4 \\
        --device cpu --out out/blend

Tasks (seeded, `make_tasks`): a pool of 20 documents, each holding one fact a question can ask for (a personnel
record's access code, a vault's passkey among filler sentences, the constant a short function assigns), every
answer in exactly one document of the pool; per task 4..8 of them in random order, separated by "\\n\\n", after a
system-prompt chunk whose instruction the answer must follow (the value only, in upper case), then the question.
The system prompt and the documents are registered chunks; the checkpoint's chat template frames system and user
turns when it has one (its text split around the two contents), plain text after a BOS otherwise. Documents run
60..150 tokens, requests 500..1200.

Per mode (exact, kv-deviation at each --ratios, chunk-heads at each --chunk-heads-ratios, adaptive at each
--adaptive-ratios: kv-deviation's budget shared among the chunks), over the tasks:
- accuracy: greedy output holding the expected answer (as written, upper case; and in any case, which separates
  retrieval from following the instruction), next to exact mode's;
- the share of the chunks' tokens recomputed (ChunkReuse.recomputed over the chunk pieces' tokens);
- teacher-forced agreement with full recompute over the answer's tokens: the K/V of the prompt less its last
  token from `engine.prefill_kv(..., reuse=mode)` and from exact mode, then the reference model's `extend` over
  [last prompt token] + answer[:-1] on each (one code path: only the cache differs); top-1 agreement, mean
  KL(full || blend) and the largest |delta logprob| of the answer's token over all positions.
Writes bench_blend.md (the table, also printed), bench_blend.json and bench_blend.png (quality against r) into
--out. Seconds per mode are wall time for its generation and teacher forcing (indicative only on a shared CPU).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from chunkwise.chunks import Blend
from chunkwise.sampling import SamplingParams

POOL_SIZE = 20
DOCS_PER_TASK = (4, 8)
SYSTEM_PROMPT = ("You are a precise assistant. Answer the user's question using only the documents they give. "
                 "Answer with the value only, in upper case, with no other words.")
SEPARATOR = "\n\n"

_ADJECTIVES = ("amber", "brisk", "cobalt", "dusky", "ember", "frosty", "gilded", "hollow", "ivory", "jade",
               "lunar", "misty", "nimble", "onyx", "pale", "quiet", "russet", "silver", "tawny", "umber",
               "velvet", "woven", "zesty", "copper", "scarlet", "golden", "mossy", "stormy", "sunlit", "wintry")
_NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchid", "pebble", "quarry", "river", "saddle", "thistle",
          "valley", "willow", "anchor", "beacon", "canyon", "dune", "glacier", "heron", "island", "juniper",
          "kestrel", "lagoon", "marble", "nectar", "otter", "prairie", "ridge", "summit", "tundra", "walnut")
_FIRST = ("Marta", "Tomas", "Ines", "Viktor", "Lena", "Omar", "Priya", "Jonas", "Elif", "Mateo", "Sofia", "Arun",
          "Nadia", "Felix", "Chiara", "Kenji", "Amara", "Pavel", "Rosa", "Daniel")
_LAST = ("Quinn", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Ferreira", "Brennan", "Kowalski",
         "Silva", "Nakamura", "Petrov", "Osei", "Larsen", "Duarte", "Weber", "Costa", "Ibrahim", "Keller")
_CITIES = ("Lisbon", "Porto", "Tallinn", "Lyon", "Bergen", "Krakow", "Valencia", "Ghent", "Turin", "Aarhus")
_DEPARTMENTS = ("finance", "logistics", "research", "support", "legal", "design", "operations", "sales")
_FILLER = ("The grass is green and the sky is blue.", "The sun rises in the east and sets in the west.",
           "Rivers flow from the hills down to the sea.", "Most trains leave the station on time.",
           "A good map saves hours of walking.", "The library opens at nine and closes at six.",
           "Bread tastes best on the day it is baked.", "Winter evenings are long in the north.",
           "The market is busy on Saturday mornings.", "Old bridges are often made of stone.")
_VERBS = ("merge", "score", "scale", "pack", "route", "weigh", "index", "blend", "sort", "audit")
_OBJECTS = ("ledger", "orders", "samples", "tickets", "parcels", "readings", "batches", "invoices", "shifts")
_VARS = ("factor", "weight", "salt", "offset", "stride", "bias")


@dataclass(frozen=True)
class Document:
    text: str
    question: str        # the question whose answer only this document holds
    answer: str          # the expected answer, as the instruction asks: upper case


@dataclass(frozen=True)
class Task:
    documents: tuple[int, ...]   # indices into the pool, in prompt order
    target: int                  # the pool index of the document holding the answer (one of `documents`)
    question: str
    answer: str


def _record(rng: random.Random, code: str, rid: str) -> Document:
    lines = [f"Personnel record {rid}", f"name: {rng.choice(_FIRST)} {rng.choice(_LAST)}",
             f"city: {rng.choice(_CITIES)}", f"department: {rng.choice(_DEPARTMENTS)}", f"access code: {code}",
             f"desk: floor {rng.randint(1, 9)}, seat {rng.randint(1, 60)}",
             f"joined: {rng.choice(('March', 'June', 'October'))} {rng.randint(2005, 2023)}",
             f"manager: {rng.choice(_FIRST)} {rng.choice(_LAST)}",
             f"phone extension: {rng.randint(100, 999)}",
             f"shift: {rng.choice(('early', 'day', 'late', 'night'))}",
             f"notes: {' '.join(rng.sample(_FILLER, 3))}"]
    body = [lines[0]] + rng.sample(lines[1:-1], len(lines) - 2) + [lines[-1]]
    return Document("\n".join(body), f"What is the access code in personnel record {rid}?", code.upper())


def _passkey(rng: random.Random, vault: str, key: str) -> Document:
    filler = rng.sample(_FILLER, rng.randint(6, 10))
    filler.insert(rng.randint(1, len(filler) - 1), f"The passkey of the vault {vault} is {key}. Remember it.")
    return Document(" ".join(filler), f"What is the passkey of the vault {vault}?", key)


def _function(rng: random.Random, name: str, const: str, modulus: str) -> Document:
    var = rng.choice(_VARS)
    text = (f"def {name}(values):\n"
            f"    \"\"\"{rng.choice(_VERBS).capitalize()} the {rng.choice(_OBJECTS)}: a weighted sum, reduced.\"\"\"\n"
            f"    if not values:\n"
            f"        raise ValueError(\"{name} needs at least one value\")\n"
            f"    {var} = {const}\n"
            f"    total = 0\n"
            f"    for i, value in enumerate(values):\n"
            f"        total += (value + i) * {var}\n"
            f"    # reduce so that the result fits the {rng.choice(_OBJECTS)} table\n"
            f"    return total % {modulus}\n\n\n"
            f"print({name}([{', '.join(str(rng.randint(1, 99)) for _ in range(rng.randint(3, 6)))}]))")
    return Document(text, f"Which constant does the function {name} assign to {var}?", const)


def make_pool(seed: int) -> list[Document]:
    """POOL_SIZE documents from `seed`, kinds interleaved; every answer and every question's key is drawn without
    replacement, and each answer occurs (in any case) in exactly one document: a draw that breaks this is redrawn."""
    rng = random.Random(f"bench_blend pool {seed}")
    while True:
        pairs = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], 2 * POOL_SIZE)]
        numbers = [str(x) for x in rng.sample(range(10000, 100000), 3 * POOL_SIZE)]
        names = [f"{v}_{o}_{i}" for i, (v, o) in enumerate(rng.sample([(v, o) for v in _VERBS for o in _OBJECTS],
                                                                       POOL_SIZE))]
        pool = []
        for i in range(POOL_SIZE):
            kind = i % 3
            if kind == 0:
                pool.append(_record(rng, pairs[2 * i], f"P-{numbers[3 * i]}"))
            elif kind == 1:
                pool.append(_passkey(rng, pairs[2 * i + 1], numbers[3 * i + 1]))
            else:
                pool.append(_function(rng, names[i], numbers[3 * i + 1], numbers[3 * i + 2]))
        if all(sum(d.answer.lower() in other.text.lower() for other in pool) == 1 for d in pool):
            return pool


def make_tasks(seed: int, num_tasks: int, pool: list[Document] | None = None) -> list[Task]:
    """`num_tasks` tasks from `seed`: each takes DOCS_PER_TASK documents of the pool in random order and asks
    one of them its question."""
    pool = make_pool(seed) if pool is None else pool
    tasks = []
    for i in range(num_tasks):
        rng = random.Random(f"bench_blend task {seed} {i}")
        docs = tuple(rng.sample(range(len(pool)), rng.randint(*DOCS_PER_TASK)))
        target = rng.choice(docs)
        tasks.append(Task(docs, target, pool[target].question, pool[target].answer))
    return tasks


class Framing:
    """Token ids of the text around the system prompt and the user turn: from the chat template when the tokenizer
    has one (rendered around two markers, then split), else a BOS and plain text. Text is tokenized without special
    tokens (a template's special tokens written as text still map to their ids)."""
    SYSTEM, USER = "@@SYSTEM@@", "@@USER@@"

    def __init__(self, tokenizer, bos_token_id: int | None):
        self.tok = tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "system", "content": self.SYSTEM},
                                                  {"role": "user", "content": self.USER}],
                                                 tokenize=False, add_generation_prompt=True)
            head, rest = text.split(self.SYSTEM)
            middle, tail = rest.split(self.USER)
            self.head, self.middle, self.tail = self.encode(head), self.encode(middle), tail
        else:
            self.head = [bos_token_id] if bos_token_id is not None else []
            self.middle, self.tail = self.encode(SEPARATOR), "\nAnswer:"

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []


def composite_prompt(framing: Framing, system_chunk, doc_chunks: list, task: Task) -> list:
    """[head, system, middle, doc, sep, doc, ..., question + tail]: id lists and registered chunks."""
    pieces = [framing.head] if framing.head else []
    pieces += [system_chunk, framing.middle] if framing.middle else [system_chunk]
    for j, d in enumerate(task.documents):
        if j:
            pieces.append(framing.encode(SEPARATOR))
        pieces.append(doc_chunks[d])
    pieces.append(framing.encode(f"{SEPARATOR}Question: {task.question}{framing.tail}"))
    return pieces


def without_last_token(prompt: list) -> tuple[list, int]:
    """The composite prompt less its last token (the last piece is an id list), and that token."""
    *rest, last = prompt
    return (rest + [last[:-1]] if len(last) > 1 else rest), last[-1]


def stop_ids(tokenizer, eos_token_ids) -> tuple[int, ...]:
    """EOS and the chat templates' end-of-turn tokens the vocabulary has."""
    ids = set(eos_token_ids)
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>") if t in vocab}
    return tuple(sorted(ids))


def mode_label(mode) -> str:
    return "exact" if mode == "exact" else f"{mode.policy} r={mode.recompute_ratio:g}"


@torch.inference_mode()
def teacher_forced(engine, model, prompt: list, answer_ids: list[int], mode) -> torch.Tensor:
    """Log-probabilities [len(answer), vocab] float32 of the answer's tokens over mode's cache of the prompt less its
    last token, by the reference `model`'s extend over [last token] + answer[:-1]."""
    head, last = without_last_token(prompt)
    k, v = engine.prefill_kv(head, reuse=mode)
    device = model.w["model.embed_tokens.weight"].device
    tokens = torch.tensor([last] + answer_ids[:-1], device=device)
    logits = model.extend(tokens, k.shape[1], k.to(device, model.dtype), v.to(device, model.dtype))[0]
    return torch.log_softmax(logits.float(), dim=-1)


class ByteTokenizer:
    """For checkpoints without a tokenizer (the tiny ones, 384 ids): id 3 + b per UTF-8 byte b, no chat template."""
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + b for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def get_vocab(self) -> dict:
        return {}


def build_prompts(engine, tokenizer, pool: list[Document], tasks: list[Task]) -> tuple[list, list[list[int]]]:
    """The tasks' composite prompts (the system prompt and the pool's documents registered with `engine`) and
    their answers' token ids."""
    framing = Framing(tokenizer, engine.model_config.bos_token_id)
    system_chunk = engine.register_chunk(framing.encode(SYSTEM_PROMPT))
    doc_chunks = [engine.register_chunk(framing.encode(d.text)) for d in pool]
    return ([composite_prompt(framing, system_chunk, doc_chunks, t) for t in tasks],
            [framing.encode(t.answer) for t in tasks])


def run(engine, model, tokenizer, tasks: list[Task], prompts: list, answers: list[list[int]], modes: list,
        on_mode=None) -> dict[str, dict]:
    """Every mode's metrics over `tasks` (their `prompts` and `answers` from build_prompts) on `engine`
    (chunkwise.Engine or chunkwise.reference.Engine); `model`: the reference model of the engine's checkpoint, for
    teacher forcing; `tokenizer` decodes the outputs. `on_mode(results)` once every mode's metrics are in."""
    stops = stop_ids(tokenizer, engine.model_config.eos_token_ids)
    params = [SamplingParams(max_tokens=len(a) + 4, stop_token_ids=stops) for a in answers]
    results, forced = {}, {}
    # On the fast engine exact mode's pages enter the prefix cache (blended ones never do): exact runs after every
    # blend, or a blend of the same prompt would find it all cached exactly and blend nothing.
    for mode in modes:
        began = time.perf_counter()
        outs = engine.generate(prompts, params, reuse=mode)
        texts = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        chunk_tokens = sum(r.num_tokens for o in outs for r in o.chunk_reuse if r.chunk is not None)
        recomputed = sum(r.recomputed for o in outs for r in o.chunk_reuse if r.chunk is not None)
        if mode != "exact":
            forced[mode_label(mode)] = [teacher_forced(engine, model, p, a, mode) for p, a in zip(prompts, answers)]
        results[mode_label(mode)] = dict(
            policy="exact" if mode == "exact" else mode.policy,
            ratio=1.0 if mode == "exact" else float(mode.recompute_ratio),
            accuracy=sum(t.answer in x for t, x in zip(tasks, texts)) / len(tasks),
            accuracy_any_case=sum(t.answer.lower() in x.lower() for t, x in zip(tasks, texts)) / len(tasks),
            recomputed_share=recomputed / chunk_tokens, seconds=time.perf_counter() - began, outputs=texts)
    full = [teacher_forced(engine, model, p, a, "exact") for p, a in zip(prompts, answers)]
    forced["exact"] = full
    for label, r in results.items():
        agree, kl, delta, count = 0, 0.0, 0.0, 0
        for a, f, b in zip(answers, full, forced[label]):
            target = torch.tensor(a, device=f.device)[:, None]
            agree += int((b.argmax(-1) == f.argmax(-1)).sum())
            kl += float((f.exp() * (f - b)).sum(-1).clamp_min(0).sum())
            delta = max(delta, float((b.gather(1, target) - f.gather(1, target)).abs().max()))
            count += len(a)
        r.update(top1_agreement=agree / count, mean_kl=kl / count, max_abs_delta_logprob=delta)
    if on_mode is not None:
        on_mode(results)
    return results


def markdown(results: dict[str, dict], header: str) -> str:
    rows = [header, "",
            "| mode | recomputed | accuracy | accuracy (any case) | top-1 agreement | mean KL(full‖blend) "
            "| max abs Δ logprob | seconds |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in sorted(results.items(), key=lambda item: item[0] != "exact"):   # exact's row first
        rows.append(f"| {label} | {r['recomputed_share']:.1%} | {r['accuracy']:.0%} | {r['accuracy_any_case']:.0%} "
                    f"| {r['top1_agreement']:.1%} | {r['mean_kl']:.4f} | {r['max_abs_delta_logprob']:.3f} "
                    f"| {r['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for r in results.values():
        if r["policy"] != "exact":
            series.setdefault(r["policy"], []).append(r)
    for policy, rs in series.items():
        rs = sorted(rs, key=lambda r: r["ratio"])
        x = [r["ratio"] for r in rs]
        style = dict(marker={"kv-deviation": "o", "adaptive": "^"}.get(policy, "s"),
                     linestyle="-" if len(rs) > 1 else "none")
        left.plot(x, [r["accuracy"] for r in rs], label=f"{policy}: accuracy", **style)
        left.plot(x, [r["top1_agreement"] for r in rs], label=f"{policy}: top-1 agreement", alpha=0.7, **style)
        right.plot(x, [max(r["mean_kl"], 1e-6) for r in rs], label=f"{policy}: mean KL", **style)
        right.plot(x, [max(r["max_abs_delta_logprob"], 1e-6) for r in rs], label=f"{policy}: max |Δ logprob|",
                   alpha=0.7, **style)
    if "exact" in results:
        left.axhline(results["exact"]["accuracy"], color="grey", linestyle="--", label="exact: accuracy")
    left.set(xlabel="recompute ratio r", ylabel="share", ylim=(-0.05, 1.05), title="accuracy and agreement")
    right.set(xlabel="recompute ratio r", yscale="log", title="divergence from full recompute (floor 1e-6)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratios(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a real checkpoint name, a tiny one or a path")
    ap.add_argument("--engine", choices=("fast", "reference"), default="fast")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", type=ratios, default=[0, 0.05, 0.15, 0.3, 1.0], help="kv-deviation's, comma-separated")
    ap.add_argument("--chunk-heads-ratios", type=ratios, default=[0.15], help="chunk-heads', comma-separated")
    ap.add_argument("--adaptive-ratios", type=ratios, default=[0.15, 0.3], help="adaptive's, comma-separated")
    ap.add_argument("--no-exact", action="store_true", help="skip exact mode's generation (its row)")
    ap.add_argument("--out", type=Path, default=Path("out/bench_blend"))
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:   # before the long run, not at its plot
        raise SystemExit("bench_blend.py plots with matplotlib: pip install -e '.[bench]'")

    from chunkwise.checkpoints import resolve_model
    from chunkwise.reference.model import ReferenceModel
    from chunkwise.tokenizer import load_tokenizer
    from chunkwise.weights import load_weights

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path) or ByteTokenizer()
    kw = dict(dtype=args.dtype, device=args.device, max_model_len=4096)
    if args.engine == "fast":
        from chunkwise import Engine
        engine = Engine(path, **kw)
        model = ReferenceModel(engine.model_config, load_weights(path, engine.engine_config.dtype,
                                                                 engine.engine_config.device,
                                                                 cfg=engine.model_config))
    else:
        from chunkwise.reference import Engine
        engine = Engine(path, **kw)
        model = engine.model
    pool = make_pool(args.seed)
    tasks = make_tasks(args.seed, args.tasks, pool)
    prompts, answers = build_prompts(engine, tokenizer, pool, tasks)
    # exact's generation last: on the reference engine it recomputes the whole sequence per token, the slowest
    modes = [Blend(r, "kv-deviation") for r in args.ratios] + [Blend(r, "chunk-heads") for r in args.chunk_heads_ratios]
    modes += [Blend(r, "adaptive") for r in args.adaptive_ratios]
    modes += [] if args.no_exact else ["exact"]
    lengths = [sum(len(p) for p in prompt) for prompt in prompts]
    header = (f"Blend quality against full recompute: {args.model}, {args.engine} engine, {args.dtype} on "
              f"{engine.engine_config.device}, {len(tasks)} tasks (seed {args.seed}, prompts {min(lengths)}.."
              f"{max(lengths)} tokens)")
    args.out.mkdir(parents=True, exist_ok=True)

    def save(results: dict[str, dict]) -> None:
        (args.out / "bench_blend.md").write_text(markdown(results, header))
        (args.out / "bench_blend.json").write_text(json.dumps(
            dict(model=args.model, engine=args.engine, dtype=args.dtype, seed=args.seed, prompt_lengths=lengths,
                 tasks=[asdict(t) for t in tasks], results=results), indent=1))

    results = run(engine, model, tokenizer, tasks, prompts, answers, modes, on_mode=save)
    print(markdown(results, header))
    plot(results, args.out / "bench_blend.png", header)
    return results


if __name__ == "__main__":
    main()
