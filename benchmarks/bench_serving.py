"""Serving latency under Poisson load (issue #29 §2): time to first token, inter-token latency and end-to-end
latency of chunkwise.Engine driven directly and through its OpenAI-compatible HTTP server, same process, same requests.

    PYTHONPATH=$PWD python -m benchmarks.bench_serving --out out/serving        # a GPU: both modes at 8 and 32 req/s
    PYTHONPATH=$PWD python -m benchmarks.bench_serving --model tiny-qwen3 --device cpu --dtype float32 \\
        --num-requests 6 --input-len-range 8,24 --output-len-range 3,4 --rates 200 --warmup-requests 1 \\
        --decode-batches 2 --decode-steps 2 --no-plot                          # a CPU smoke run (not a figure)

Each mode takes about num_requests / rate (the last arrival) plus a tail at each rate, after the engine's construction;
--num-requests and --rates shrink it.

Workload (seeded): a random bf16 model of Qwen3-0.6B's shape (bench_engine.py's checkpoint) unless --model; 300
requests, prompts of 256..2048 random token ids, 64..256 output tokens (greedy, ignore_eos: each request produces
exactly its length); arrivals a Poisson process at each rate: the same unit-rate gaps scaled by 1/rate, so rates
differ only in pace, and both modes get the same lengths and arrival times. Every run draws fresh prompt ids, so no
run finds another's pages in the prefix cache.
Modes:
  engine  a loop on this thread adds each request when its arrival time has passed and calls `engine.step()`; a
          token is stamped when step() returns it.
  http    the server of `python -m chunkwise serve` in this process (chunkwise.serve.cli.serving: uvicorn on a free
          127.0.0.1 port) over an engine built alike (the same options) in a process of its own, as the command
          runs it (--http-engine thread: this process's engine, stepped on a thread); clients in child processes
          (httpx on asyncio, uvloop's where installed: one streamed /v1/completions request per arrival;
          --client-processes of them, dealt the requests in turn) stamp each token's event when it arrives. Clients have processes of their own so that
          parsing their streams takes no GIL time from the server, and several so that one client's parsing of
          every other stream does not delay its timestamps. The engine process records its steps and compiles
          (RecordingEngine) and each HTTP run gets those within its time, as an engine run gets its own.
Latencies count from the scheduled arrival: TTFT to the first token, ITL the gaps between consecutive tokens of one
request, E2E to its last token. Per mode and rate: their p50/p90/p99 (and ITL's max), output tokens/s (tokens over
the run's duration: first arrival to last token), and goodput: the share (and rate) of requests whose TTFT is at most
--ttft-target-ms and whose own ITL p99 at most --itl-target-ms.
Over HTTP also the inter-token latency as far as the server's receipt (ReceiptRecorder): where between the engine
and the client an HTTP run's extra latency is lost. Each process that steps or serves settles its heap once built
(gc.freeze, as `chunkwise serve` does), so no full garbage collection stalls a run.
Decode-only step time: every engine step is timed by benchmarks/step_timer.py (its wall time: under overlap
scheduling the host's work for step k+1 plus the wait for step k); per run, the median of the decode-only steps
that follow a decode-only step, with their median batch, and their p99 (decode-only steps are CUDA graphs of
nearly fixed device time, so their tail is the host's: a floor under ITL p99 that no scheduling removes); also the
p50/p99 wall time of the steps with prefill rows, which every decoding user waits for. Standalone: N sequences with prompts of the workload's
mean length decode together after their prefill, --decode-steps steps timed, for each --decode-batches.
Before timing: --warmup-requests requests at the highest rate through each path (the Triton compiles of each timed
run are counted: `compiles` in the JSON, expected 0). After the HTTP warm-up, a greedy check: the first
--check-requests requests of the engine run at the first rate, sent again over HTTP at once with logprobs=0 (which
name their tokens), against the tokens the engine run produced (in bf16 a different batch may flip a near-tie, so
the share is reported, not asserted).
Writes bench_serving.md (the tables, also printed), bench_serving.json (every number, each request's latencies
included) and bench_serving.png (TTFT and ITL percentiles against rate, both modes) under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import itertools
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_engine import COMPILE_TIMES, QWEN3_0_6B_SHAPE, _install_compile_counter
from benchmarks.step_timer import StepTimer
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams
from chunkwise.serve.cli import add_engine_options, engine_kwargs, serving
from chunkwise.serve.engine_core import EngineCore, settled_heap

MODES = ("engine", "http")
SERVED_NAME = "bench"
CLIENT_LEAD_S = 0.5    # the HTTP run's start, this long after it is handed to the client processes
WINDOW_LEAD = 4        # decode steps after the prefill before a standalone window is timed
QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    arrival: float       # seconds after the run's start


@dataclass
class Trace:
    """One request's tokens as they reached the caller: time.perf_counter() stamps (CLOCK_MONOTONIC, so the client
    process's stamps compare with this one's), and their ids (engine) or names (HTTP with logprobs)."""
    arrival: float
    times: list[float] = field(default_factory=list)
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: int | None = None        # HTTP: the usage event's completion_tokens


@dataclass(frozen=True)
class Workload:
    """Lengths and unit-rate arrival offsets, drawn once from the seed; each run draws its own prompt ids."""
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    unit_arrivals: np.ndarray
    vocab_size: int
    seed: int

    @classmethod
    def draw(cls, num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
             seed: int) -> "Workload":
        rng = np.random.default_rng(seed)
        prompt_lens = rng.integers(input_range[0], input_range[1] + 1, num)
        output_lens = rng.integers(output_range[0], output_range[1] + 1, num)
        gaps = rng.exponential(1.0, num)
        return cls(prompt_lens, output_lens, np.concatenate([[0.0], np.cumsum(gaps[:-1])]), vocab_size, seed)

    def requests(self, rate: float, run: int, count: int | None = None) -> list[Request]:
        """The first `count` requests (all by default) at `rate` req/s, with prompt ids of their own for run `run`."""
        rng = np.random.default_rng([self.seed, run])
        n = len(self.prompt_lens) if count is None else count
        return [Request(rng.integers(3, self.vocab_size, int(p)).tolist(), int(o), float(a) / rate)
                for p, o, a in zip(self.prompt_lens[:n], self.output_lens[:n], self.unit_arrivals[:n])]


# ---- engine mode ------------------------------------------------------------------------------------------------
def drive_engine(engine: Engine, requests: list[Request]) -> tuple[float, list[Trace]]:
    """Adds each request once its arrival has passed, steps while any is unfinished; (start, traces)."""
    start = time.perf_counter()
    traces = [Trace(start + r.arrival) for r in requests]
    by_id: dict[int, Trace] = {}
    added = done = 0
    while done < len(requests):
        now = time.perf_counter()
        while added < len(requests) and traces[added].arrival <= now:
            r = requests[added]
            by_id[engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True))] = \
                traces[added]
            added += 1
        if not engine.has_unfinished():
            if added == len(requests):
                raise RuntimeError(f"the engine finished with {len(requests) - done} requests still unfinished here")
            time.sleep(max(0.0, traces[added].arrival - now))
            continue
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            trace = by_id[out.request_id]
            trace.times += [now] * len(out.new_token_ids)
            trace.tokens += out.new_token_ids
            if out.finished:
                trace.finish_reason = out.finish_reason
                done += 1
    return start, traces


# ---- http mode: the client, run in a child process ----------------------------------------------------------------
def http_client(url: str, requests: list[Request], start: float, logprobs: bool = False) -> list[Trace]:
    """Sends each request, streamed, at start + its arrival; the traces of their token events. On uvloop where
    installed (a dependency, as the server's): a client's own per-event Python delays its timestamps, which would
    count as the server's latency."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_http_run(url, requests, start, logprobs))
    return uvloop.run(_http_run(url, requests, start, logprobs))


async def _http_run(url: str, requests: list[Request], start: float, logprobs: bool) -> list[Trace]:
    import httpx

    # no connection cap: a request waiting for a free connection would count that wait as the server's latency
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        return list(await asyncio.gather(*(_http_request(client, r, start, logprobs) for r in requests)))


async def _http_request(client, req: Request, start: float, logprobs: bool) -> Trace:
    trace = Trace(start + req.arrival)
    await asyncio.sleep(max(0.0, trace.arrival - time.perf_counter()))
    body = dict(model=SERVED_NAME, prompt=req.prompt, max_tokens=req.output_len, temperature=0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True}, **({"logprobs": 0} if logprobs else {}))
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"the server answered {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            if event.get("usage"):
                trace.usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:   # one event per token: the server sends each engine output
                trace.times.append(now)
                if logprobs:
                    trace.tokens += choice["logprobs"]["tokens"]
                trace.finish_reason = choice["finish_reason"] or trace.finish_reason
    return trace


def check_traces(traces: list[Trace], requests: list[Request], label: str) -> None:
    """Every request produced exactly its length (one event per token over HTTP), finishing on its length."""
    for i, (t, r) in enumerate(zip(traces, requests)):
        counts = [len(t.times)] + ([t.usage] if t.usage is not None else [])
        if any(c != r.output_len for c in counts) or t.finish_reason != "length":
            raise RuntimeError(f"{label}: request {i} asked for {r.output_len} tokens and got {counts} (tokens "
                               f"stamped, then the server's count), finish_reason {t.finish_reason!r}")


# ---- numbers --------------------------------------------------------------------------------------------------------
def quantiles(values, with_max: bool = False) -> dict:
    """p50/p90/p99 (and max) of `values`; None each when there are none."""
    a = np.asarray(values, float)
    out = {f"p{q}": float(np.percentile(a, q)) if a.size else None for q in QUANTILES}
    if with_max:
        out["max"] = float(a.max()) if a.size else None
    return out


def summarize(traces: list[Trace], start: float, ttft_target_ms: float, itl_target_ms: float) -> dict:
    """The run's latency percentiles (ms), throughput, goodput, and each request's own numbers."""
    per_request, gaps = [], []
    for t in traces:
        itl = 1e3 * np.diff(t.times)
        gaps.append(itl)
        per_request.append(dict(arrival_s=t.arrival - start, tokens=len(t.times),
                                ttft_ms=1e3 * (t.times[0] - t.arrival), e2e_ms=1e3 * (t.times[-1] - t.arrival),
                                itl_p99_ms=float(np.percentile(itl, 99)) if itl.size else None,
                                itl_max_ms=float(itl.max()) if itl.size else None))
    duration = max(t.times[-1] for t in traces) - start
    tokens = sum(r["tokens"] for r in per_request)
    good = sum(r["ttft_ms"] <= ttft_target_ms and (r["itl_p99_ms"] is None or r["itl_p99_ms"] <= itl_target_ms)
               for r in per_request)
    return dict(requests=len(traces), duration_s=duration, tokens=tokens, output_tokens_per_s=tokens / duration,
                ttft_ms=quantiles([r["ttft_ms"] for r in per_request], with_max=True),
                itl_ms=quantiles(np.concatenate(gaps), with_max=True),
                e2e_ms=quantiles([r["e2e_ms"] for r in per_request], with_max=True),
                goodput=dict(fraction=good / len(traces), requests_per_s=good / duration,
                             ttft_target_ms=ttft_target_ms, itl_target_ms=itl_target_ms),
                per_request=per_request)


def step_stats(steps: list[dict]) -> dict:
    """The run's engine steps (StepTimer's records): the median wall time of decode-only steps that follow a
    decode-only step (under overlap a step's wall time includes the wait for the one before), their median batch,
    the median batch of every step, and the wall time of the steps with prefill rows (every user decoding beside
    them waits for them: where an ITL tail comes from, unless the host stalled). The decode-only steps' own p99 is
    the floor a host's stalls put under ITL p99 whatever the scheduling: decode-only steps run as CUDA graphs of
    nearly fixed device time, so their tail is the host's."""
    decode = [s for prev, s in zip(steps, steps[1:]) if s["decode_only"] and prev["decode_only"]]
    decode_ms = quantiles([1e3 * s["step"] for s in decode])
    mixed = [1e3 * s["step"] for s in steps if not s["decode_only"]]
    return dict(steps=len(steps), batch_median=float(np.median([s["batch"] for s in steps])) if steps else None,
                decode_steps=len(decode), decode_step_ms=decode_ms["p50"], decode_step_p99_ms=decode_ms["p99"],
                decode_batch_median=float(np.median([s["tokens"] for s in decode])) if decode else None,
                mixed_steps=len(mixed), mixed_step_ms=quantiles(mixed))


def window_stats(steps: list[dict], compile_times: list[float], begin: float, end: float) -> dict:
    """A run's engine steps (StepTimer's records, in order) and Triton compiles: those that began within [begin,
    end] (time.perf_counter is the system's clock, so this works across processes): their count, step_stats, and
    the steps by kind and path (CUDA graph or eager) from the runner's `launches` counts, what a latency tail came
    from."""
    before = [s for s in steps if s["at"] < begin]
    inside = [s for s in steps if begin <= s["at"] <= end]
    base = before[-1]["launches"] if before else {}
    last = inside[-1]["launches"] if inside else base
    return dict(compiles=sum(begin <= t <= end for t in compile_times), **step_stats(inside),
                launches={f"{kind} {path}": n - base.get((kind, path), 0) for (kind, path), n in last.items()})


class ReceiptRecorder:
    """When the server received each step's outputs (`Streams.deliver`: on the server's event loop for an engine
    process, on the engine's thread otherwise; before any request's stream) and which requests got a token. A
    request's gaps between receipts are its inter-token latency as far as the server's receipt: beside the engine's
    own and the clients', it says where an HTTP run's extra latency is lost (before the receipt: the engine
    process's pipe; after it: the event loop's streams, the socket, the client)."""

    def __init__(self, streams):
        self.receipts: list[tuple[float, list[int]]] = []
        deliver = streams.deliver

        def recorded(outs):
            self.receipts.append((time.perf_counter(), [o.request_id for o in outs if o.new_token_ids]))
            deliver(outs)
        streams.deliver = recorded

    def itl(self, begin: float, end: float) -> dict:
        """The gaps (ms) between consecutive receipts of a request's tokens received within [begin, end]: their
        count and p50/p90/p99/max."""
        last, gaps = {}, []
        for at, rids in self.receipts:
            if begin <= at <= end:
                for rid in rids:
                    if rid in last:
                        gaps.append(1e3 * (at - last[rid]))
                    last[rid] = at
        return dict(gaps=len(gaps), **quantiles(gaps, with_max=True))


class RecordingEngine(Engine):
    """The engine of the HTTP runs' engine process: records its steps (StepTimer: when each began, its wall time,
    its batch, the runner's launches so far) and Triton's compiles (when each happened), and writes them as JSON to
    `record` when closed, so that the benchmark gives each HTTP run its steps, paths and compiles as it gives an
    engine-direct run."""

    def __init__(self, model, record: str, **kwargs):
        _install_compile_counter()
        super().__init__(model, **kwargs)
        self.record = record
        self.timer = StepTimer(self, device_sync=False)

    def close(self) -> None:
        if self.record is not None:
            steps = [dict(at=s["at"], step=s["step"], decode_only=s["decode_only"], tokens=s["tokens"],
                          batch=s["batch"], launches=[[k, p, n] for (k, p), n in s["launches"].items()])
                     for s in self.timer.steps]
            Path(self.record).write_text(json.dumps(dict(steps=steps, compiles=COMPILE_TIMES)))
            self.record = None
        super().close()


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode_window(engine: Engine, timer: StepTimer, num_seqs: int, prompt_len: int, steps: int,
                  rng: np.random.Generator) -> dict:
    """The mean wall time of `steps` engine steps while num_seqs sequences (prompts of prompt_len) decode together,
    once all are prefilled and WINDOW_LEAD steps more have run; whether every timed step was decode-only at that
    batch (a preemption would break it)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    ids = [engine.add_request(rng.integers(3, vocab, prompt_len).tolist(), params) for _ in range(num_seqs)]
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(WINDOW_LEAD):
        engine.step()
    first = len(timer.steps)
    sync(engine)
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine)
    seconds = (time.perf_counter() - began) / steps
    timed = timer.steps[first:]
    for rid in ids:
        engine.abort(rid)
    engine.step()   # postprocesses the step in flight, if any: the engine is idle again
    return dict(sequences=num_seqs, prompt_len=prompt_len, steps=steps, step_ms=1e3 * seconds,
                tokens_per_s=num_seqs / seconds,
                all_decode=all(s["decode_only"] and s["tokens"] == num_seqs for s in timed))


# ---- report ---------------------------------------------------------------------------------------------------------
def _ms(q: dict, keys, scale: float = 1.0) -> str:
    return " / ".join("-" if q[k] is None else f"{q[k] * scale:.{1 if scale == 1 else 2}f}" for k in keys)


def markdown(results: dict) -> str:
    c = results["config"]
    rows = [f"Serving benchmark: {c['model']}, {c['dtype']} on {c['device']}; {c['num_requests']} requests, prompts "
            f"{c['input_len_range'][0]}..{c['input_len_range'][1]}, outputs {c['output_len_range'][0]}.."
            f"{c['output_len_range'][1]} tokens (seed {c['seed']}); max_num_batched_tokens "
            f"{c['max_num_batched_tokens']} (prefill beside decodes {c['max_prefill_tokens_with_decodes']}), "
            f"max_num_seqs {c['max_num_seqs']}, async_scheduling "
            f"{c['async_scheduling']}; goodput: TTFT <= {c['ttft_target_ms']:g} ms and ITL p99 <= "
            f"{c['itl_target_ms']:g} ms", "",
            "| mode | rate req/s | duration s | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 / max ms "
            "| E2E p50 / p90 / p99 s | goodput | decode-only step ms p50 (batch) / p99 | ITL p99 / decode-only step "
            "| steps with prefill ms p50 / p99 | compiles |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        g = r["goodput"]
        decode, p99 = r["decode_step_ms"], r["itl_ms"]["p99"]
        step = "-" if decode is None else \
            f"{decode:.2f} ({r['decode_batch_median']:.0f}) / {r['decode_step_p99_ms']:.2f}"
        ratio = "-" if decode is None or p99 is None else f"{p99 / decode:.2f}x"
        rows.append(f"| {r['mode']} | {r['rate']:g} | {r['duration_s']:.1f} | {r['output_tokens_per_s']:.0f} "
                    f"| {_ms(r['ttft_ms'], ('p50', 'p90', 'p99'))} | {_ms(r['itl_ms'], ('p50', 'p90', 'p99', 'max'))} "
                    f"| {_ms(r['e2e_ms'], ('p50', 'p90', 'p99'), 1e-3)} | {g['fraction']:.0%} "
                    f"({g['requests_per_s']:.1f}/s) | {step} | {ratio} | {_ms(r['mixed_step_ms'], ('p50', 'p99'))} "
                    f"| {r['compiles']} |")
    receipts = [r for r in results["runs"] if "server_receipt_itl_ms" in r]
    if receipts:
        rows += ["", "Inter-token latency as far as the server's receipt of each step's outputs (before any "
                     "request's stream), HTTP runs: " + "; ".join(
                         f"{r['rate']:g} req/s p50 / p90 / p99 / max "
                         f"{_ms(r['server_receipt_itl_ms'], ('p50', 'p90', 'p99', 'max'))} ms" for r in receipts)]
    if results["decode_windows"]:
        rows += ["", "Standalone decode-only steps (after the prefill and warm-up steps):", "",
                 "| sequences | prompt tokens | step ms | tok/s | all decode-only |", "|---:|---:|---:|---:|---|"]
        rows += [f"| {w['sequences']} | {w['prompt_len']} | {w['step_ms']:.2f} | {w['tokens_per_s']:.0f} "
                 f"| {w['all_decode']} |" for w in results["decode_windows"]]
    check = results["greedy_check"]
    if check is not None:
        rows += ["", f"Greedy check: {check['identical']} of {check['requests']} requests got the same tokens over "
                     f"HTTP as in the engine run."]
    return "\n".join(rows) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, target, title in ((axes[0], "ttft_ms", c["ttft_target_ms"], "time to first token"),
                                      (axes[1], "itl_ms", c["itl_target_ms"], "inter-token latency")):
        for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
            runs = sorted((r for r in results["runs"] if r["mode"] == mode), key=lambda r: r["rate"])
            for q, style, marker in zip(QUANTILES, ("-", "--", ":"), "os^"):
                points = [(r["rate"], r[metric][f"p{q}"]) for r in runs if r[metric][f"p{q}"] is not None]
                if points:
                    ax.plot(*zip(*points), style, marker=marker, color=color, label=f"{mode} p{q}")
        ax.axhline(target, color="grey", linewidth=0.8, label="goodput target")
        ax.set(xlabel="arrival rate (req/s)", ylabel="ms", yscale="log", title=title)
        ax.set_xticks(sorted({r["rate"] for r in results["runs"]}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{c['model']}, {c['dtype']} on {c['device']}, {c['num_requests']} requests", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------------------------------
def _numbers(kind, name: str, low, count: int | None = None, above: bool = False):
    """An argparse type: comma-separated numbers of `kind`, each >= low (> low if `above`), `count` of them if given."""
    def parse(text: str):
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be comma-separated numbers, got {text!r}") from None
        if (not values or any(v < low or (above and v == low) for v in values)
                or (count is not None and len(values) != count)):
            raise argparse.ArgumentTypeError(f"{name} must be {count or 'one or more'} number(s) "
                                             f"{'>' if above else '>='} {low}, got {text!r}")
        return values
    parse.__name__ = name   # argparse names the type in its messages
    return parse


def _length_range(name: str):
    ints = _numbers(int, name, 1, count=2)

    def parse(text: str) -> tuple[int, int]:
        lo, hi = ints(text)
        if lo > hi:
            raise argparse.ArgumentTypeError(f"{name} must be LOW,HIGH with LOW <= HIGH, got {text!r}")
        return lo, hi
    return parse


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--modes takes {', '.join(MODES)} (comma-separated), got {text!r}")
    return modes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Engine options default to the engine's own, except --dtype (bfloat16 here) "
                                       "and --max-model-len (here the longest request: both ranges' highs).")
    p.add_argument("--model", help="a checkpoint directory or built-in name (default: a random model of Qwen3-0.6B's "
                                   "shape, written once by chunkwise.checkpoints.tiny_checkpoint)")
    p.add_argument("--rates", type=_numbers(float, "--rates", 0, above=True), default=[8.0, 32.0],
                   help="Poisson arrival rates in requests/s, comma-separated (default 8,32)")
    p.add_argument("--num-requests", type=int, default=300, help="requests per run (default 300)")
    p.add_argument("--input-len-range", type=_length_range("--input-len-range"), default=(256, 2048),
                   help="prompt tokens, LOW,HIGH uniform (default 256,2048)")
    p.add_argument("--output-len-range", type=_length_range("--output-len-range"), default=(64, 256),
                   help="output tokens, LOW,HIGH uniform (default 64,256)")
    p.add_argument("--modes", type=_modes, default=list(MODES), help="engine, http or both (default engine,http)")
    p.add_argument("--http-engine", choices=["process", "thread"], default="process",
                   help="http mode's engine: in a process of its own (default, as `chunkwise serve`), or this "
                        "process's engine on a thread (`chunkwise serve --no-engine-process`)")
    p.add_argument("--client-processes", type=int, default=8,
                   help="http mode's client processes, the requests dealt among them in turn (default 8: a "
                        "process parsing many streams delays its own timestamps at high rates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-target-ms", type=float, default=200.0, help="goodput's TTFT target (default 200)")
    p.add_argument("--itl-target-ms", type=float, default=50.0,
                   help="goodput's target for a request's ITL p99 (default 50)")
    p.add_argument("--warmup-requests", type=int, default=32,
                   help="requests of the warm-up run through each path, at the highest rate (default 32)")
    p.add_argument("--check-requests", type=int, default=8,
                   help="engine-run requests sent again over HTTP to compare their greedy tokens (default 8)")
    p.add_argument("--decode-batches", type=_numbers(int, "--decode-batches", 1), default=[16, 64],
                   help="standalone decode-only windows: sequences decoding together, comma-separated (default 16,64)")
    p.add_argument("--decode-steps", type=int, default=32, help="steps timed per decode window (default 32)")
    p.add_argument("--out", type=Path, default=Path("out/bench_serving"), help="output folder")
    p.add_argument("--json", type=Path, help="default: OUT/bench_serving.json")
    p.add_argument("--markdown", type=Path, help="default: OUT/bench_serving.md")
    p.add_argument("--png", type=Path, help="default: OUT/bench_serving.png")
    p.add_argument("--no-plot", action="store_true",
                   help="write no PNG (it needs matplotlib: pip install -e '.[bench]')")
    add_engine_options(p)
    p.set_defaults(dtype="bfloat16")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    for name in ("num_requests", "decode_steps", "client_processes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_requests", "check_requests"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    longest = args.input_len_range[1] + args.output_len_range[1]
    if args.max_model_len is not None and args.max_model_len < longest:
        p.error(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest} tokens: "
                f"--input-len-range's high plus --output-len-range's)")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:   # before the long run, not at its plot
        p.error("the plot needs matplotlib (pip install -e '.[bench]'), or pass --no-plot")
    args.json = args.json or args.out / "bench_serving.json"
    args.markdown = args.markdown or args.out / "bench_serving.md"
    args.png = None if args.no_plot else args.png or args.out / "bench_serving.png"
    return args


# ---- the runs -------------------------------------------------------------------------------------------------------
class Bench:
    """One engine, its step timer, the workload, and every result so far."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        model = args.model or str(tiny_checkpoint("qwen3", seed=0, **QWEN3_0_6B_SHAPE))
        kwargs = engine_kwargs(args)
        kwargs.setdefault("max_model_len", args.input_len_range[1] + args.output_len_range[1])
        began = time.perf_counter()
        self.engine = Engine(model, **kwargs)
        self.model, self.kwargs = model, kwargs
        self.construct_s = time.perf_counter() - began
        cfg = self.engine.engine_config
        too_big = [b for b in args.decode_batches if b > cfg.max_num_seqs]
        if too_big:
            self.engine.close()
            raise SystemExit(f"--decode-batches {too_big} exceed the engine's max_num_seqs {cfg.max_num_seqs}: "
                             f"raise --max-num-seqs")
        self.timer = StepTimer(self.engine, device_sync=False)
        self.workload = Workload.draw(args.num_requests, args.input_len_range, args.output_len_range,
                                      self.engine.model_config.vocab_size, args.seed)
        self.runs = itertools.count(1)   # each run's prompt ids come from (seed, its number)
        self.process_runs: list[tuple[dict, float, float]] = []   # HTTP runs of an engine process, with their times
        self.receipts: ReceiptRecorder | None = None   # the HTTP server's receipts of the engine's outputs
        self.engine_runs: dict[float, tuple[list[Request], list[Trace]]] = {}
        self.results = dict(config=self._config(model), runs=[], decode_windows=[], greedy_check=None)

    def _config(self, model: str) -> dict:
        a, cfg = self.args, self.engine.engine_config
        device = torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda" else "cpu"
        return dict(model=a.model or "random Qwen3-0.6B shape", checkpoint=model, dtype=str(cfg.dtype).split(".")[-1],
                    device=device, num_requests=a.num_requests, rates=a.rates, input_len_range=a.input_len_range,
                    output_len_range=a.output_len_range, seed=a.seed, ttft_target_ms=a.ttft_target_ms,
                    itl_target_ms=a.itl_target_ms, max_num_batched_tokens=cfg.max_num_batched_tokens,
                    max_prefill_tokens_with_decodes=cfg.max_prefill_tokens_with_decodes, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, page_size=cfg.page_size,
                    num_pages=self.engine.executor.num_pages, async_scheduling=cfg.async_scheduling,
                    enforce_eager=cfg.enforce_eager, construct_s=self.construct_s)

    def warmup_requests(self) -> list[Request]:
        count = min(self.args.warmup_requests, self.args.num_requests)
        return self.workload.requests(max(self.args.rates), next(self.runs), count) if count else []

    def record(self, mode: str, rate: float, run) -> None:
        """Runs `run(requests) -> (start, traces)` on the rate's requests, timed; keeps its summary (an engine
        process's steps and compiles are added by `add_process_steps` once it has closed)."""
        requests = self.workload.requests(rate, next(self.runs))
        start, traces = run(requests)
        check_traces(traces, requests, f"{mode} mode at {rate:g} req/s")
        if mode == "engine":
            self.engine_runs[rate] = requests, traces
        r = dict(mode=mode, rate=rate, **summarize(traces, start, self.args.ttft_target_ms, self.args.itl_target_ms))
        end = start + r["duration_s"]
        if mode == "http":
            r["server_receipt_itl_ms"] = self.receipts.itl(start, end)
        if mode == "engine" or self.args.http_engine == "thread":   # this process stepped the engine
            r.update(window_stats(self.timer.steps, COMPILE_TIMES, start, end))
        else:
            self.process_runs.append((r, start, end))
        self.results["runs"].append(r)
        self.report(r)

    @staticmethod
    def report(r: dict) -> None:
        steps = f"compiles {r['compiles']}; steps {r['launches']}" if "compiles" in r else "(steps: see below)"
        print(f"[{r['mode']} {r['rate']:g} req/s] {r['output_tokens_per_s']:.0f} tok/s; TTFT p50/p99 "
              f"{_ms(r['ttft_ms'], ('p50', 'p99'))} ms; ITL p50/p99 {_ms(r['itl_ms'], ('p50', 'p99'))} ms; goodput "
              f"{r['goodput']['fraction']:.0%}; {steps}", flush=True)

    def add_process_steps(self, path: Path) -> None:
        """Each HTTP run's steps, launches and compiles from the engine process's record (RecordingEngine)."""
        rec = json.loads(path.read_text())
        steps = [dict(s, launches={(k, p): n for k, p, n in s["launches"]}) for s in rec["steps"]]
        for r, begin, end in self.process_runs:
            r.update(window_stats(steps, rec["compiles"], begin, end))
            step = "-" if r["decode_step_ms"] is None else f"{r['decode_step_ms']:.2f} ms"
            print(f"[{r['mode']} {r['rate']:g} req/s, the engine process] compiles {r['compiles']}; steps "
                  f"{r['launches']}; decode-only step {step}", flush=True)

    def engine_mode(self) -> None:
        warm = self.warmup_requests()
        if warm:
            check_traces(drive_engine(self.engine, warm)[1], warm, "engine warm-up")
        for rate in self.args.rates:
            self.record("engine", rate, lambda requests: drive_engine(self.engine, requests))

    def decode_windows(self) -> None:
        prompt_len = sum(self.args.input_len_range) // 2
        rng = np.random.default_rng([self.args.seed, next(self.runs)])
        for n in self.args.decode_batches:
            w = decode_window(self.engine, self.timer, n, prompt_len, self.args.decode_steps, rng)
            self.results["decode_windows"].append(w)
            print(f"[decode {n} sequences] {w['step_ms']:.2f} ms/step", flush=True)

    def http_mode(self) -> None:
        """The server over an engine process built alike (or this engine), client processes, warm-up, the greedy
        check, runs; this engine is closed by the end."""
        spawn = multiprocessing.get_context("spawn")   # a fresh interpreter: no copy of this one's threads or CUDA
        engine, record = self.engine, self.args.out / "engine_process_steps.json"
        if self.args.http_engine == "process":
            self.engine.close()   # its memory is the engine process's now
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            record.parent.mkdir(parents=True, exist_ok=True)
            engine = EngineCore(self.model, dict(self.kwargs, record=str(record)), engine_class=RecordingEngine)
            engine.start()
        k = self.args.client_processes
        # settled once serving, as `chunkwise serve`'s process is
        with serving(engine, SERVED_NAME) as srv, ProcessPoolExecutor(k, mp_context=spawn) as clients, settled_heap():
            self.receipts = ReceiptRecorder(srv.state.loop.streams)
            def run(requests, logprobs=False):   # request i goes to client i % k
                start = time.perf_counter() + CLIENT_LEAD_S
                parts = [clients.submit(http_client, srv.url, requests[i::k], start, logprobs) for i in range(k)]
                traces = [None] * len(requests)
                for i, part in enumerate(parts):
                    traces[i::k] = part.result()
                return start, traces
            warm = self.warmup_requests()
            if warm:
                check_traces(run(warm)[1], warm, "http warm-up")
            self.greedy_check(run)
            for rate in self.args.rates:
                self.record("http", rate, run)
        if self.process_runs:   # the engine process has closed, its record written
            self.add_process_steps(record)

    def greedy_check(self, run) -> None:
        """The first requests of the first rate's engine run, again over HTTP (at once, with their token names)."""
        if not self.engine_runs or not self.args.check_requests:
            return
        requests, traces = self.engine_runs[self.args.rates[0]]
        n = min(self.args.check_requests, len(requests))
        again = [Request(r.prompt, r.output_len, 0.0) for r in requests[:n]]
        _, http = run(again, logprobs=True)
        check_traces(http, again, "greedy check over http")
        tok = self.engine.tokenizer   # named as the server names a token (app.py's _Reply._token)
        names = [[tok.decode([i]) if tok is not None else f"token_id:{i}" for i in trace.tokens]
                 for trace in traces[:n]]
        same = [h.tokens == e for h, e in zip(http, names)]
        self.results["greedy_check"] = dict(requests=n, identical=sum(same),
                                            differing=[i for i, s in enumerate(same) if not s])

    def write(self) -> None:
        a, results = self.args, self.results
        for path in (a.json, a.markdown, a.png):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))
        table = markdown(results)
        a.markdown.write_text(table)
        print("\n" + table)
        if a.png is not None:
            plot(results, a.png)
        print(f"wrote {a.json}, {a.markdown}" + (f", {a.png}" if a.png is not None else ""))


def main(argv=None) -> dict:
    args = parse_args(argv)
    _install_compile_counter()
    bench = Bench(args)
    try:
        with settled_heap():   # the engine driven directly as a serving process runs it
            if "engine" in args.modes:
                bench.engine_mode()
            bench.decode_windows()
        if "http" in args.modes:
            bench.http_mode()
    finally:
        bench.engine.close()   # the server closes it too; twice is harmless
    bench.write()
    return bench.results


if __name__ == "__main__":
    main()
