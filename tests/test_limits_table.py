"""The limits table (chunkwise/limits.py), held to its specification and tested where it is declared.

`SPEC` below is the contract, written here independently of the table: every bound a request, a chunk, an engine
configuration or a server option is checked against, its ends (inclusive or not), its layer and the entry points
it applies at. The table must declare exactly it. Then every row is sent through every entry point it names
(`chunkwise.Engine`, `chunkwise.reference.Engine`, their `register_chunk`, the HTTP server, the CLI) at each of its
bounds, one step outside it and one step inside: inside is served without error, outside is refused (a ValueError,
a 400 or 429, exit status 1) with a message naming the value (or, for a sum such as prompt + max_tokens, the bound).
Expectations come from `SPEC`, never from the table, so a bound moved in the table or in a validator fails here.

Last, the validators' modules are scanned for ordering comparisons written outside the table: each one left there
is listed in `NOT_LIMITS` with the reason it is no bound of a value a caller chooses.
"""
from __future__ import annotations

import ast
import contextlib
import io
import math
import re
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import httpx
import pytest

import chunkwise.__main__ as cli
import chunkwise.reference
import chunkwise.serve.cli as serve_cli
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.chunks import Blend
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine_config import EngineConfig
from chunkwise.limits import ENTRY_POINTS, LAYERS, LIMITS
from chunkwise.serve.app import ServerState

pytestmark = pytest.mark.correctness

REPO = Path(__file__).resolve().parents[1]
INF = math.inf

# name: (lower, upper, lower inclusive, upper inclusive, layer, entry points). A str bound is a value of the place
# it is checked at (CONTEXT).
SPEC = {
    "prompt_token_id": (0, "vocab_size", True, False, "request", ("engine", "reference", "server", "cli")),
    "stop_token_id": (0, "vocab_size", True, False, "request", ("engine", "reference", "server")),
    "logprobs": (0, "vocab_size", True, True, "request", ("engine", "reference")),
    "top_k": (0, "vocab_size", True, True, "request", ("engine", "reference", "cli")),
    "max_tokens": (1, None, True, True, "request", ("engine", "reference", "server", "cli")),
    "request_tokens": (None, "max_model_len", True, True, "request", ("engine", "reference", "server", "cli")),
    "chunk_size": (1, None, True, True, "request", ("engine", "reference", "cli")),
    "temperature": (0, INF, True, False, "request", ("engine", "reference", "server", "cli")),
    "top_p": (0, 1, False, True, "request", ("engine", "reference", "server", "cli")),
    "chunk_token_id": (0, "vocab_size", True, False, "chunk", ("register_chunk", "server")),
    "pinned_pages": (None, "pin_cap", True, True, "chunk", ("register_chunk", "server")),
    "recompute_ratio": (0, 1, True, True, "chunk", ("engine", "reference")),
    "page_size": (1, None, True, True, "config", ("engine", "reference", "cli")),
    "num_pages": (1, None, True, True, "config", ("engine", "reference")),
    "max_num_batched_tokens": (1, None, True, True, "config", ("engine", "reference")),
    "max_num_seqs": (1, None, True, True, "config", ("engine", "reference")),
    "max_prefill_tokens_with_decodes": (1, None, True, True, "config", ("engine", "reference")),
    "max_graph_tokens": (0, None, True, True, "config", ("engine", "reference")),
    "split_kv_threshold": (0, None, True, True, "config", ("engine", "reference")),
    "split_size": ("split_tile", None, True, True, "config", ("engine", "reference")),
    "max_model_len": (2, "max_position_embeddings", True, True, "config", ("engine", "reference")),
    "gpu_memory_utilization": (0, 1, False, True, "config", ("engine", "reference")),
    "max_pinned_fraction": (0, 1, True, False, "config", ("engine", "reference")),
    "tensor_parallel_size": (1, None, True, True, "config", ("engine", "reference")),
    "deterministic_tensor_parallel_size": (None, 2, True, True, "config", ("engine", "reference")),
    "n": (1, None, True, True, "server", ("server",)),
    "openai_top_k": (-1, "vocab_size", True, True, "server", ("server",)),
    "server_logprobs": (0, "max_logprobs", True, True, "server", ("server",)),
    "waiting_requests": (None, "max_waiting", True, True, "server", ("server",)),
    "max_waiting": (1, None, True, True, "server", ("server", "cli")),
    "max_logprobs": (0, None, True, True, "server", ("server", "cli")),
}
REAL = {"temperature", "top_p", "recompute_ratio", "gpu_memory_utilization", "max_pinned_fraction"}
STEP = {"split_size": "split_tile"}   # split_size is also a multiple of the tile: its neighbours are a tile away
# rows whose checked value is a sum: their refusals name the bound, not the sum
SUMS = {"request_tokens", "pinned_pages", "waiting_requests"}

PAGE, PAGES, PIN_FRACTION = 4, 16, 0.25
MAX_LEN = 32          # the engines' and the server's max_model_len
CLI_MAX_LEN = 8       # the CLI's checkpoint's max_position_embeddings
SERVER_MAX_WAITING = 3
CONTEXT = {
    "engine": dict(vocab_size=VOCAB, max_model_len=MAX_LEN, max_position_embeddings=1024, split_tile=64),
    "register_chunk": dict(vocab_size=VOCAB, pin_cap=int(PIN_FRACTION * PAGES)),
    "server": dict(vocab_size=VOCAB, max_model_len=MAX_LEN, max_logprobs=20, max_waiting=SERVER_MAX_WAITING,
                   pin_cap=int(PIN_FRACTION * PAGES)),
    "cli": dict(vocab_size=VOCAB, max_model_len=CLI_MAX_LEN),
}
CONTEXT["reference"] = CONTEXT["engine"]


def test_the_table_declares_exactly_the_specified_limits():
    table = {r.name: (r.lower, r.upper, r.lower_inclusive, r.upper_inclusive, r.layer, r.applies) for r in LIMITS}
    assert len(table) == len(LIMITS), "a limit is declared twice"
    for name in table.keys() | SPEC.keys():
        assert table.get(name) == SPEC.get(name), name
    assert {r.layer for r in LIMITS} <= set(LAYERS) and {e for r in LIMITS for e in r.applies} <= set(ENTRY_POINTS)


# ---- the values sent: at, outside and inside each bound -------------------------------------------------------------

def inside(name: str, value, ctx: dict) -> bool:
    """Whether SPEC admits `value` (written out here, not through the table's code)."""
    lo, hi, lo_in, hi_in = SPEC[name][:4]
    lo, hi = (ctx[b] if isinstance(b, str) else b for b in (lo, hi))
    above = lo is None or value > lo or (lo_in and value == lo)
    below = hi is None or value < hi or (hi_in and value == hi)
    return above and below


def values_around(name: str, entry: str) -> list:
    """Each finite bound, the value one step outside it and one inside (for reals: the next float out, 1/64 in)."""
    lo, hi = SPEC[name][:2]
    ctx = CONTEXT[entry]
    out = []
    for bound, outward in ((lo, -1), (hi, 1)):
        if bound is None or bound == INF:
            continue
        b = ctx[bound] if isinstance(bound, str) else bound
        if name in REAL:
            out += [b, math.nextafter(b, outward * INF), b - outward / 64]
        else:
            step = ctx[STEP[name]] if name in STEP else 1
            out += [b, b + outward * step, b - outward * step]
    return out


class Refused(Exception):
    """An entry point refused the value; the message it gave."""


# ---- the engines ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(ckpt):
    kw = dict(page_size=PAGE, num_pages=PAGES, max_model_len=MAX_LEN)
    return {"engine": Engine(ckpt, **kw), "reference": chunkwise.reference.Engine(ckpt, max_model_len=MAX_LEN)}


def prompt_of(n: int) -> list[int]:
    return [(7 * i) % (VOCAB - 3) + 3 for i in range(n)]


def request_through_engine(eng, name: str, v) -> None:
    prompt, params, kw = [5, 9], dict(max_tokens=1, ignore_eos=True), {}
    if name == "prompt_token_id":
        prompt = [5, v]
    elif name == "stop_token_id":
        params["stop_token_ids"] = [v]
    elif name in ("logprobs", "max_tokens", "temperature", "top_p"):
        params[name] = v
    elif name == "top_k":
        params.update(top_k=v, temperature=1.0, seed=0)
    elif name == "request_tokens":
        prompt = prompt_of(v - 1)
    elif name == "chunk_size":
        prompt, kw = prompt_of(3), dict(chunk_sizes=v)
    elif name == "recompute_ratio":
        chunk = eng.register_chunk(prompt_of(2 * PAGE))
        prompt, kw = [chunk, [5, 9]], dict(reuse=Blend(recompute_ratio=v))
    else:
        raise AssertionError(f"no request probe for {name}")
    out = eng.generate([prompt], SamplingParams(**params), **kw)[0]
    assert out.error is None and len(out.token_ids) == params["max_tokens"], (name, v, out.error)


def config_through_engine(ckpt, entry: str, name: str, v) -> None:
    kw = dict(page_size=PAGE, num_pages=PAGES, max_model_len=MAX_LEN)
    if name == "max_model_len":
        kw.pop("num_pages")
    if name == "deterministic_tensor_parallel_size":
        # a model that 2 and 3 ranks can split (6 query and KV heads): only the deterministic bound refuses 3
        ckpt = tiny_checkpoint("qwen3", num_attention_heads=6, num_key_value_heads=6, intermediate_size=192)
        kw.update(deterministic=True, tensor_parallel_size=v)
    else:
        kw[name] = v
    if entry == "reference":
        chunkwise.reference.Engine(ckpt, **kw)
        return
    if name in ("tensor_parallel_size", "deterministic_tensor_parallel_size") and v > 1:
        # the optimized engine takes the same EngineConfig first; past it, several ranks start worker processes
        EngineConfig(ckpt, **kw)
        return
    out = Engine(ckpt, **kw).generate([[5]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 1, (name, v, out.error)


def chunk_through_register_chunk(ckpt, engines, name: str, v) -> None:
    if name == "chunk_token_id":
        for eng in engines.values():
            eng.register_chunk([5, v])
        return
    assert name == "pinned_pages"
    eng = Engine(ckpt, page_size=PAGE, num_pages=PAGES, max_model_len=MAX_LEN, max_pinned_fraction=PIN_FRACTION)
    chunk = eng.register_chunk(prompt_of(v * PAGE), pin=True)
    assert eng.page_pool.num_pinned_pages == v
    eng.unpin(chunk)


# ---- the server -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(ckpt):
    engine = Engine(ckpt, page_size=PAGE, num_pages=PAGES, max_model_len=MAX_LEN, max_pinned_fraction=PIN_FRACTION)
    with serve_cli.serving(engine, "tiny") as srv:
        srv.state.max_waiting = SERVER_MAX_WAITING
        yield srv


def through_server(server, name: str, v) -> None:
    if name in ("max_waiting", "max_logprobs"):
        try:
            ServerState(SimpleNamespace(), "m", **{name: v})
        except ValueError as e:
            raise Refused(str(e)) from None
        return
    post = lambda path, body: httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=120)   # noqa: E731
    if name in ("chunk_token_id", "pinned_pages"):
        pin = name == "pinned_pages"
        r = post("/v1/chunks", {"prompt": [5, v] if not pin else prompt_of(v * PAGE), "pin": pin})
        if r.status_code == 200 and pin:
            assert httpx.delete(f"{server.url}/v1/chunks/{r.json()['id']}").status_code == 200
    else:
        body = {"prompt": [5, 9], "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        if name == "prompt_token_id":
            body["prompt"] = [5, v]
        elif name == "stop_token_id":
            body["stop_token_ids"] = [v]
        elif name in ("max_tokens", "temperature", "top_p", "n"):
            body[name] = v
        elif name == "openai_top_k":
            body.update(top_k=v, temperature=1.0, seed=0)
        elif name == "server_logprobs":
            body["logprobs"] = v
        elif name == "request_tokens":
            body["prompt"] = prompt_of(v - 1)
        elif name == "waiting_requests":   # nothing else waits: the request's own samples fill the queue
            body["n"] = v
        else:
            raise AssertionError(f"no server probe for {name}")
        r = post("/v1/completions", body)
        if r.status_code == 200:
            assert all(c["finish_reason"] == "length" for c in r.json()["choices"]), r.json()
    if r.status_code != 200:
        assert r.status_code in (400, 429), r.text
        assert (r.status_code == 429) == (name == "waiting_requests"), r.text
        raise Refused(r.json()["error"]["message"])


# ---- the CLI --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_ckpt():
    return tiny_checkpoint("qwen3", max_position_embeddings=CLI_MAX_LEN)


def through_cli(ckpt, name: str, v) -> None:
    if name in ("max_waiting", "max_logprobs"):
        argv = ["serve", "--model", str(ckpt), "--no-engine-process", f"--{name.replace('_', '-')}={v}"]
        patches = [mock.patch.object(serve_cli, "engine_loop", lambda e: SimpleNamespace(close=lambda: None)),
                   mock.patch.object(serve_cli, "make_server",
                                     lambda *a: SimpleNamespace(run=lambda: None, started=True)),
                   mock.patch.object(serve_cli.signal, "signal", lambda *a: None),
                   mock.patch.object(serve_cli, "settled_heap", contextlib.nullcontext),
                   mock.patch.object(serve_cli.logging, "basicConfig", lambda **kw: None)]
    else:
        option = {"prompt_token_id": "prompt-ids", "top_k": "top-k", "max_tokens": "max-tokens",
                  "chunk_size": "chunk-size", "temperature": "temperature", "top_p": "top-p",
                  "page_size": "page-size"}.get(name)
        argv = ["--model", str(ckpt), "--no-reference", "--prompt-ids=5,9", "--max-tokens=1"]
        if name == "prompt_token_id":
            argv[3] = f"--prompt-ids=5,{v}"
        elif name == "request_tokens":
            argv[3] = "--prompt-ids=" + ",".join(map(str, prompt_of(v - 1)))
        elif option is None:
            raise AssertionError(f"no CLI probe for {name}")
        else:
            argv.append(f"--{option}={v}")
        patches = []
    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        rc = cli.main(argv)
    if rc != 0:
        assert rc == 1, (argv, rc, err.getvalue())
        raise Refused(err.getvalue().strip().splitlines()[-1])


# ---- every row, every entry point, both sides -----------------------------------------------------------------------

# The cheapest entry points first, so that under -x a moved bound fails in seconds: the reference (the shared
# validators), the server (its own checks first, then the pin cap), register_chunk, the optimized engine, the CLI.
ORDER = ("reference", "server", "register_chunk", "engine", "cli")
CASES = sorted(((name, entry) for name, spec in SPEC.items() for entry in spec[5]),
               key=lambda c: (ORDER.index(c[1]), ("server", "chunk").index(SPEC[c[0]][4]) if SPEC[c[0]][4] in
                              ("server", "chunk") else 2))


@pytest.mark.parametrize("name, entry", CASES, ids=[f"{n}-{e}" for n, e in CASES])
def test_each_limit_is_served_at_and_inside_its_bounds_and_refused_past_them_naming_the_value(
        request, ckpt, name, entry):
    """A drawn set of values is no use here: each bound's three neighbours are the whole property."""
    ctx = CONTEXT[entry]
    if entry in ("engine", "reference") and SPEC[name][4] == "config":
        probe = lambda v: config_through_engine(ckpt, entry, name, v)   # noqa: E731
    elif entry in ("engine", "reference"):
        eng = request.getfixturevalue("engines")[entry]
        probe = lambda v: request_through_engine(eng, name, v)   # noqa: E731
    elif entry == "register_chunk":
        engines = request.getfixturevalue("engines")
        probe = lambda v: chunk_through_register_chunk(ckpt, engines, name, v)   # noqa: E731
    elif entry == "server":
        srv = request.getfixturevalue("server")
        probe = lambda v: through_server(srv, name, v)   # noqa: E731
    else:
        small = request.getfixturevalue("cli_ckpt")
        probe = lambda v: through_cli(small, name, v)   # noqa: E731
    for v in values_around(name, entry):
        want = inside(name, v, ctx)
        try:
            probe(v)
        except (ValueError, TypeError, Refused) as e:
            assert not want, f"{name}={v!r} through {entry} is inside its limits but was refused: {e}"
            if name in SUMS:
                bound = SPEC[name][1]
                assert str(ctx[bound]) in str(e), (name, v, str(e))
            else:
                assert repr(v) in str(e) or str(v) in str(e), f"{name}={v!r} refused without naming it: {e}"
            continue
        assert want, f"{name}={v!r} through {entry} is outside its limits but was accepted"


# ---- no bound outside the table -------------------------------------------------------------------------------------

VALIDATORS = ["chunkwise/requests.py", "chunkwise/sampling.py", "chunkwise/tokenizer.py", "chunkwise/chunks.py",
              "chunkwise/engine_config.py", "chunkwise/open_config.py", "chunkwise/serve/protocol.py",
              "chunkwise/serve/app.py", "chunkwise/serve/chat.py",
              "chunkwise/serve/cli.py", "chunkwise/__main__.py", "chunkwise/reference/engine.py",
              "chunkwise/engine/llm_engine.py"]
# In the engines' own modules only their validators (the rest is the engine at work, not a check of input).
VALIDATING_FUNCTIONS = {"chunkwise/reference/engine.py": {"__init__", "register_chunk", "unpin"},
                        "chunkwise/engine/llm_engine.py": {"__init__", "register_chunk", "_check_pin_cap", "unpin",
                                                           "add_request"}}
NOT_LIMITS = {
    ("chunkwise/engine_config.py", "blend_refusal", "self.tensor_parallel_size > 1"):
        "whether a valid tensor_parallel_size can blend (one rank only), not its admission",
    ("chunkwise/sampling.py", "greedy", "self.temperature < GREEDY_TEMPERATURE"):
        "which sampler a valid temperature takes (greedy below the threshold), not its admission",
    ("chunkwise/sampling.py", "sampling_probs", "params.top_p < 1.0"): "sampling: whether top-p cuts at all",
    ("chunkwise/sampling.py", "sampling_probs", "torch.softmax(sorted_logits, dim=-1).cumsum(-1) <= 1 - params.top_p"):
        "sampling: the top-p cut itself",
    ("chunkwise/sampling.py", "sampling_probs", "logits < kth"): "sampling: the top-k cut itself",
    ("chunkwise/chunks.py", "variant", "n <= start"): "which registered variant fits a prompt: its context ends "
        "before the chunk",
    ("chunkwise/chunks.py", "variant", "n > len(best.token_ids)"): "which registered variant fits a prompt: the "
        "longest context",
    ("chunkwise/tokenizer.py", "all_ints", "set(map(type, xs)) <= {int}"): "a subset test of types",
    ("chunkwise/tokenizer.py", "encode_prompts", "set(map(type, ids)) <= {int}"): "a subset test of types",
    ("chunkwise/tokenizer.py", "is_single_prompt", "len(prompts) > 0"): "a non-empty test",
    ("chunkwise/tokenizer.py", "push", "len(text) <= len(sent)"): "streaming text: whether new text came",
    ("chunkwise/chunks.py", "check", "0 <= chunk.chunk_id < self.num_issued"):
        "a handle's id among those this registry issued, not a value a caller chooses",
    ("chunkwise/engine_config.py", "_check_tensor_parallel", "first + n > torch.cuda.device_count()"):
        "the machine's devices (one per rank), not a declared bound; needs CUDA to test",
    ("chunkwise/engine_config.py", "_resolve_device", "dev.index >= torch.cuda.device_count()"):
        "the machine's devices, not a declared bound; needs CUDA to test",
    ("chunkwise/serve/protocol.py", "body", "self.status >= 500"): "an error's type from its status",
    ("chunkwise/serve/cli.py", "serving", "time.monotonic() > deadline"): "a start-up timeout",
}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def comparisons(path: str, source: str | None = None) -> list[tuple[str, str, str]]:
    """(module, function, source) of every ordering comparison, or `in range(...)`, inside a function."""
    tree = ast.parse((REPO / path).read_text() if source is None else source)
    wanted = VALIDATING_FUNCTIONS.get(path)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (wanted and fn.name not in wanted):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Compare):
                continue
            ranged = any(isinstance(op, (ast.In, ast.NotIn)) and isinstance(c, ast.Call)
                         and getattr(c.func, "id", None) == "range" for op, c in zip(node.ops, node.comparators))
            if ranged or any(isinstance(op, ORDERING) for op in node.ops):
                found.append((path, fn.name, ast.unparse(node)))
    return found


def test_no_validator_compares_against_a_bound_outside_the_table():
    """A new check must be a row of chunkwise/limits.py (then this file's SPEC and probes name it), or, if it bounds
    nothing a caller chooses, an entry of NOT_LIMITS with its reason."""
    found = [c for path in VALIDATORS for c in comparisons(path)]
    new = sorted(set(found) - NOT_LIMITS.keys())
    assert not new, f"comparisons outside chunkwise/limits.py: {new}"
    gone = sorted(NOT_LIMITS.keys() - set(found))
    assert not gone, f"NOT_LIMITS entries no longer in the code (remove them): {gone}"


def test_the_scan_sees_a_check_written_outside_the_table():
    """The scan's own power, on the sample's two bugs written by hand: a chunk's ids checked with <=, and the
    waiting queue's limit in a range."""
    source = ("def chunk_ids(ids, vocab_size):\n    return [t for t in ids if not 0 <= t <= vocab_size]\n"
              "def full(state, n):\n    return state.waiting + n not in range(state.max_waiting)\n")
    assert [c[1:] for c in comparisons("chunkwise/chunks.py", source)] == [
        ("chunk_ids", "not 0 <= t <= vocab_size"[4:]), ("full", "state.waiting + n not in range(state.max_waiting)")]
