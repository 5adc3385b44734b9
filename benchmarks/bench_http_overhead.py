"""The OpenAI server's host cost per streamed token, without a model: CPU microseconds of the server process per
token, and how late the engine thread's steps come, with N concurrent streaming clients over real HTTP.

    PYTHONPATH=$PWD python -m benchmarks.bench_http_overhead                      # N = 1, 16, 64
    PYTHONPATH=$PWD python -m benchmarks.bench_http_overhead --clients 16 --profile out/http.prof

The engine is a stand-in (`FakeEngine`): each step sleeps --step-ms without the GIL, as a GPU step's wait does, then
hands every running request one token (with its logprobs if asked), so whatever the server spends per token is the
server's own: chunkwise.serve's engine thread (routing each output to its request) and its event loop (the
request's queue, the chunk's JSON, the SSE framing, starlette and uvicorn's send). The server runs in this process
as `python -m chunkwise serve --no-engine-process` runs it (uvicorn, the engine on its own thread); the clients (httpx, asyncio, one
streamed /v1/completions request at a time each, ignore_eos) run in a child process so parsing their streams takes
no GIL time from the server.
Reported per N, over the timed rounds (after a warm-up round): server CPU µs per token (this process's CPU time,
less the stand-in engine's own step work, over the tokens streamed), tokens/s, and the engine thread's lateness per
step: the time between two step() calls beyond --step-ms (p50/p99). Every Python microsecond the event loop spends
holds the GIL the engine thread needs to start its next step, so lateness is what a decode step's inter-token
latency gains from serving over HTTP. On a machine with other work the tokens/s and lateness move with it; CPU per
token much less.
--profile writes cProfile's statistics of the event loop's thread and of the engine thread (two files, .loop and
.engine appended) for the first N.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import numpy as np

from chunkwise.chunks import ChunkRegistry
from chunkwise.engine.core import CoreOutput, EngineStats
from chunkwise.engine.frontend import Frontend
from chunkwise.sampling import RequestOutput
from chunkwise.serve.cli import make_server
from chunkwise.serve.engine_core import EngineCore
from chunkwise.serve.engine_loop import EngineLoop

MODEL = "fake"
VOCAB = 1000


class FakeTokenizer:
    """Token id t is the text " t": what the server's output processor decodes FakeEngine's tokens with."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {t}" for t in token_ids)


class _FakeFrontend(Frontend):
    """FakeEngine's frontend, which keeps its FakeTokenizer across the pipe (a Frontend reloads its checkpoint's)."""

    def __setstate__(self, state: dict) -> None:
        Frontend.__init__(self, state["config"], FakeTokenizer(), state["chunks"])


class _FakeCore:
    """FakeEngine as the engine driver steps it (the engine core's calls), on a thread or in a process."""

    def __init__(self, engine: "FakeEngine"):
        self.engine = engine
        self.step, self.has_unfinished, self.stats = engine.step, engine.has_unfinished, engine.stats

    def add_requests(self, requests) -> list[int]:
        return [self.engine.add_request(r.prompt_token_ids, r.params) for r in requests]

    def abort(self, rid: int) -> CoreOutput | None:
        out = self.engine.abort(rid)
        return None if out is None else CoreOutput(rid, [], None, "abort", out)


class FakeEngine:
    """What the server's engine driver and request handlers use of chunkwise.Engine, without a model: a request
    whose prompt begins with p generates the ids p + 1, p + 2, ... (modulo the vocabulary, never 0), each with the
    text " <id>" (FakeTokenizer) and, if asked, logprobs giving it -0.5 and its top rivals u = 1, 2, ... -1 - u; each step first
    sleeps `step_s`. Its own CPU time in step() is summed in `busy_s`, and each step's start is recorded in
    `starts`."""

    def __init__(self, model: str = MODEL, step_s: float = 0.002):
        self.step_s = step_s
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 1 << 30
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.engine_config = SimpleNamespace(path=model, model_config=self.model_config,
                                             max_model_len=self.max_model_len)
        self.chunks = ChunkRegistry("fake")
        self.frontend = _FakeFrontend(self.engine_config, self.tokenizer, self.chunks)   # the server's side
        self.core = _FakeCore(self)   # what an engine process steps
        self.scheduler = SimpleNamespace(waiting=[], running={})
        self.page_pool = SimpleNamespace(num_pages=1, num_free_pages=1)
        self.busy_s = 0.0
        self.starts: list[float] = []
        self._next_id = 0

    def hand_over(self, check) -> None:
        """An EngineLoop steps it from its thread (chunkwise.Engine.hand_over): nothing else calls it here."""
        self.turn_check = check

    def add_request(self, ids, params, reuse="exact") -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        self.scheduler.running[rid] = SimpleNamespace(ids=list(ids), params=params, tokens=[])
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running)

    def stats(self) -> EngineStats:
        return EngineStats(0, len(self.scheduler.running), 1, 0, 0, 0)

    def abort(self, rid: int) -> RequestOutput | None:
        r = self.scheduler.running.pop(rid, None)
        return None if r is None else RequestOutput(rid, r.ids, r.tokens, finish_reason="abort")

    def step(self) -> list[CoreOutput]:
        self.starts.append(time.perf_counter())
        time.sleep(self.step_s)
        began = time.thread_time()
        outs = []
        for rid, r in list(self.scheduler.running.items()):
            token = (r.ids[0] + len(r.tokens)) % (VOCAB - 1) + 1
            r.tokens.append(token)
            lps = None if r.params.logprobs is None else [{token: -0.5, **{u: -1.0 - u for u in range(
                1, r.params.logprobs + 1) if u != token}}]
            done = len(r.tokens) >= r.params.max_tokens
            out = None
            if done:
                del self.scheduler.running[rid]
                out = RequestOutput(rid, r.ids, r.tokens, finish_reason="length")
            outs.append(CoreOutput(rid, [token], lps, "length" if done else None, out))
        self.busy_s += time.thread_time() - began
        return outs

    def close(self) -> None:
        pass


# ---- the clients: a child process -----------------------------------------------------------------------------------
def clients(url: str, num: int, requests: int, max_tokens: int, logprobs: int | None) -> tuple[int, list[float]]:
    """`num` clients, each streaming `requests` completions one after another: the data events received, and the
    gaps (s) between consecutive events of one stream."""
    return asyncio.run(_clients(url, num, requests, max_tokens, logprobs))


async def _clients(url: str, num: int, requests: int, max_tokens: int, logprobs: int | None):
    import httpx

    body = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=max_tokens, ignore_eos=True, stream=True,
                **({} if logprobs is None else {"logprobs": logprobs}))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        async def one() -> int:
            events = 0
            for _ in range(requests):
                last = None
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200, resp.status_code
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            events += 1
                            if last is not None:
                                gaps.append(now - last)
                            last = now
            return events
        return sum(await asyncio.gather(*(one() for _ in range(num)))), gaps


# ---- the server: this process ---------------------------------------------------------------------------------------
def measure(args, num: int, profile: str | None) -> dict:
    in_process = args.engine == "thread"
    if in_process:
        engine = FakeEngine(step_s=args.step_ms / 1e3)
        loop = EngineLoop(engine)
    else:   # the stand-in engine in a process of its own, as `chunkwise serve` runs the real one
        engine = None
        loop = EngineCore(MODEL, {"step_s": args.step_ms / 1e3}, engine_class=FakeEngine)
        loop.start()
    srv = make_server(loop, MODEL, port=0, log_level="warning")
    # cProfile follows the thread that enables it: the event loop's and the engine thread's are ours to start
    on_loop = cProfile.Profile() if profile else None
    on_engine = cProfile.Profile() if profile and in_process else None
    if in_process:
        loop.start(profile=on_engine)
    thread = threading.Thread(target=srv.run if on_loop is None else lambda: on_loop.runcall(srv.run), daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            pool.submit(clients, url, num, 1, args.max_tokens, args.logprobs).result()   # warm-up
            busy = engine.busy_s if in_process else 0.0
            if in_process:
                engine.starts.clear()
            cpu, wall = time.process_time(), time.perf_counter()
            events, gaps = pool.submit(clients, url, num, args.requests, args.max_tokens, args.logprobs).result()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if in_process:
                cpu -= engine.busy_s - busy
                starts = np.array(engine.starts)
    finally:
        srv.should_exit = True
        thread.join(30)
        loop.close()
    tokens = num * args.requests * args.max_tokens
    if events != tokens:
        raise RuntimeError(f"{num} clients: {events} events for {tokens} tokens")
    if profile:
        on_loop.dump_stats(profile + ".loop")
        if on_engine is not None:
            on_engine.dump_stats(profile + ".engine")
    itl = np.array(gaps) * 1e3
    row = dict(engine=args.engine, clients=num, tokens=tokens, cpu_us_per_token=cpu / tokens * 1e6,
               tokens_per_s=tokens / wall, itl_ms_p50=float(np.percentile(itl, 50)),
               itl_ms_p99=float(np.percentile(itl, 99)), late_ms_p50=None, late_ms_p99=None, steps=None)
    if in_process:
        late = np.diff(starts) * 1e3 - args.step_ms   # between two steps, beyond the step's own sleep
        # steps with only a few streams running (their ramp up and down) are counted too: all are the server's
        row.update(late_ms_p50=float(np.percentile(late, 50)), late_ms_p99=float(np.percentile(late, 99)),
                   steps=len(starts))
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="N concurrent streams (1 16 64)")
    p.add_argument("--requests", type=int, default=4, help="timed requests per client, one after another (4)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request (256)")
    p.add_argument("--step-ms", type=float, default=2.0, help="each fake step's sleep, without the GIL (2.0)")
    p.add_argument("--logprobs", type=int, default=None, help="ask logprobs=K (default: none, as bench_serving)")
    p.add_argument("--engine", choices=["process", "thread", "both"], default="both",
                   help="the stand-in engine in a process of its own (as `chunkwise serve`), on the server's thread "
                        "(--no-engine-process), or each in turn (default)")
    p.add_argument("--profile", help="write cProfile statistics here (.loop, .engine) for the first N")
    args = p.parse_args(argv)
    bad = [n for n in args.clients if n < 1]
    if bad or args.requests < 1 or args.max_tokens < 1 or args.step_ms < 0:
        p.error(f"--clients, --requests and --max-tokens must be >= 1 and --step-ms >= 0, got clients {args.clients},"
                f" requests {args.requests}, max tokens {args.max_tokens}, step {args.step_ms} ms")
    rows = []
    print(f"step {args.step_ms:g} ms, {args.max_tokens} tokens x {args.requests} requests per client, logprobs "
          f"{args.logprobs}")
    print("| engine | clients | server CPU µs/token | tokens/s | client ITL p50 / p99 ms | step lateness p50 / p99 ms "
          "| steps |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for engine in (["process", "thread"] if args.engine == "both" else [args.engine]):
        for i, num in enumerate(args.clients):
            r = measure(argparse.Namespace(**{**vars(args), "engine": engine}), num,
                        args.profile if i == 0 and not rows else None)
            rows.append(r)
            late = "-" if r["steps"] is None else f"{r['late_ms_p50']:.2f} / {r['late_ms_p99']:.2f}"
            print(f"| {engine} | {num} | {r['cpu_us_per_token']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{r['itl_ms_p50']:.2f} / {r['itl_ms_p99']:.2f} | {late} | {r['steps'] or '-'} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
