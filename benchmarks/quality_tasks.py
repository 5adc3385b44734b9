"""The blend quality benchmark's tasks (issue #50 §3): four seeded families over one pool of documents.

Single-hop families, each question answered by one document (bench_blend.py's three kinds, in a larger pool):
  record     a personnel record's access code ("amber-falcon", asked in upper case as the system prompt instructs)
  passkey    a vault's passkey among filler sentences (five digits: no case to get wrong; the question repeats the
             sentence that holds it). The family exact mode is expected to solve at >= 80% (EASY_FAMILY).
  function   the constant a short function assigns (five digits)
Two-hop family:
  two-hop    "the manager code of the manager of personnel record P-…": the record names its manager, the
             manager's profile (another document of the same prompt) holds the code. Neither document alone
             answers: the code is absent from the record, the record's id absent from the profile. Cross-chunk
             attention is what blending approximates, so this family is its worst case.

Every answer occurs (in any case) in exactly one document of the pool, every key (record id, vault, function,
manager name) too; a draw that breaks this is redrawn. Each single-hop task takes 4..8 documents of the pool in
random order; a two-hop task takes its record and its manager's profile plus 2..6 others, in random order.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.bench_blend import (_ADJECTIVES, _CITIES, _DEPARTMENTS, _FILLER, _FIRST, _LAST, _NOUNS, _OBJECTS,
                                    _VERBS, DOCS_PER_TASK, _function, _passkey)

SINGLE_HOP = ("record", "passkey", "function")
FAMILIES = SINGLE_HOP + ("two-hop",)
EASY_FAMILY = "passkey"
POOL = dict(record=48, passkey=48, function=48, manager=24)   # documents per kind (function names: at most 90)


@dataclass(frozen=True)
class Document:
    kind: str            # "record" | "passkey" | "function" | "manager"
    text: str
    key: str             # what a question names it by: record id, vault, function name, manager name
    question: str        # its single-hop question ("" for a manager profile: asked through a record only)
    answer: str          # the single-hop answer as instructed ("" for a profile)
    manager: int = -1    # a record's manager: the pool index of the profile; -1 otherwise


@dataclass(frozen=True)
class Task:
    family: str
    documents: tuple[int, ...]   # pool indices, in prompt order
    sources: tuple[int, ...]     # the documents the answer needs: (target,) or (record, profile)
    question: str
    answer: str


def _profile(rng: random.Random, name: str, code: str) -> Document:
    lines = [f"team: {rng.choice(_DEPARTMENTS)}", f"office: {rng.choice(_CITIES)}, floor {rng.randint(1, 9)}",
             f"manager code: {code}", f"reports: {rng.randint(3, 14)} people",
             f"review day: {rng.choice(('Monday', 'Tuesday', 'Thursday', 'Friday'))}"]
    text = "\n".join([f"Manager profile: {name}"] + rng.sample(lines, len(lines)) +
                     [f"notes: {' '.join(rng.sample(_FILLER, 2))}"])
    return Document("manager", text, name, "", "")


def _record(rng: random.Random, rid: str, code: str, employee: str, manager: str, manager_index: int) -> Document:
    lines = [f"name: {employee}", f"city: {rng.choice(_CITIES)}", f"department: {rng.choice(_DEPARTMENTS)}",
             f"access code: {code}", f"desk: floor {rng.randint(1, 9)}, seat {rng.randint(1, 60)}",
             f"joined: {rng.choice(('March', 'June', 'October'))} {rng.randint(2005, 2023)}",
             f"manager: {manager}", f"phone extension: {rng.randint(100, 999)}",
             f"shift: {rng.choice(('early', 'day', 'late', 'night'))}"]
    text = "\n".join([f"Personnel record {rid}"] + rng.sample(lines, len(lines)) +
                     [f"notes: {' '.join(rng.sample(_FILLER, 3))}"])
    return Document("record", text, rid, f"What is the access code in personnel record {rid}?", code.upper(),
                    manager_index)


def two_hop_question(rid: str) -> str:
    return f"What is the manager code of the manager of personnel record {rid}?"


def make_pool(seed: int, sizes: dict[str, int] | None = None) -> list[Document]:
    """The pool from `seed`: profiles first, then records, passkeys and functions interleaved. Answers, keys and
    manager codes drawn without replacement; redrawn until each answer and key occurs in exactly one document."""
    sizes = dict(POOL if sizes is None else sizes)
    rng = random.Random(f"quality pool {seed}")
    n_rec, n_key, n_fun, n_man = (sizes[k] for k in ("record", "passkey", "function", "manager"))
    while True:
        names = [f"{f} {l}" for f, l in rng.sample([(f, l) for f in _FIRST for l in _LAST], n_man + n_rec)]
        managers, employees = names[:n_man], names[n_man:]
        pairs = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], n_rec + n_key)]
        numbers = [str(x) for x in rng.sample(range(10000, 100000), n_man + 2 * n_rec + n_key + 2 * n_fun)]
        funs = [f"{v}_{o}_{i}" for i, (v, o) in enumerate(rng.sample([(v, o) for v in _VERBS for o in _OBJECTS],
                                                                     n_fun))]
        it = iter(numbers)
        pool = [_profile(rng, m, next(it)) for m in managers]
        kinds = [k for i in range(max(n_rec, n_key, n_fun)) for k, n in (("record", n_rec), ("passkey", n_key),
                                                                         ("function", n_fun)) if i < n]
        counts = dict(record=0, passkey=0, function=0)
        for kind in kinds:
            i = counts[kind]
            counts[kind] += 1
            if kind == "record":
                m = rng.randrange(n_man)
                pool.append(_record(rng, f"P-{next(it)}", pairs[i], employees[i], managers[m], m))
            elif kind == "passkey":
                vault = pairs[n_rec + i]
                d = _passkey(rng, vault, next(it))
                pool.append(Document("passkey", d.text, vault, d.question, d.answer))
            else:
                d = _function(rng, funs[i], next(it), next(it))
                pool.append(Document("function", d.text, funs[i], d.question, d.answer))
        facts = [d.answer for d in pool if d.answer] + [manager_code(d) for d in pool if d.kind == "manager"]
        keys = [d.key for d in pool if d.kind != "manager"]   # a manager's name is in their records too
        if all(sum(f.lower() in d.text.lower() for d in pool) == 1 for f in facts + keys):
            return pool


def manager_code(profile: Document) -> str:
    return next(line for line in profile.text.split("\n") if line.startswith("manager code: ")).split(": ")[1]


def make_tasks(seed: int, num_single: int, num_two_hop: int, pool: list[Document],
               docs_per_task: tuple[int, int] = DOCS_PER_TASK) -> list[Task]:
    """`num_single` single-hop tasks (the families in turn) then `num_two_hop` two-hop ones, each from its own
    seeded draw, each of `docs_per_task` (least, most) documents (a two-hop task at least its two)."""
    by_kind = {k: [i for i, d in enumerate(pool) if d.kind == k] for k in ("record", "passkey", "function")}
    tasks = []
    for i in range(num_single):
        rng = random.Random(f"quality task {seed} {i}")
        family = SINGLE_HOP[i % len(SINGLE_HOP)]
        target = rng.choice(by_kind[family])
        others = rng.sample([j for j in range(len(pool)) if j != target], rng.randint(*docs_per_task) - 1)
        docs = others + [target]
        rng.shuffle(docs)
        tasks.append(Task(family, tuple(docs), (target,), pool[target].question, pool[target].answer))
    for i in range(num_two_hop):
        rng = random.Random(f"quality two-hop task {seed} {i}")
        record = rng.choice(by_kind["record"])
        profile = pool[record].manager
        rest = [j for j in range(len(pool)) if j not in (record, profile)]
        docs = rng.sample(rest, max(0, rng.randint(*docs_per_task) - 2)) + [record, profile]
        rng.shuffle(docs)
        tasks.append(Task("two-hop", tuple(docs), (record, profile), two_hop_question(pool[record].key),
                          manager_code(pool[profile])))
    return tasks
