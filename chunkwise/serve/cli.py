"""`python -m chunkwise serve --model M`: an OpenAI-compatible HTTP server over chunkwise.Engine.

The engine runs in a process of its own (engine_core.py), so that serving tokens takes no host time from its
steps; `--no-engine-process` runs it on a thread of the server's process instead (engine_loop.py).
Ctrl-C or SIGTERM: the server stops accepting connections, aborts every request in flight (a stream ends with
finish_reason "abort", then [DONE]), and exits with status 0 once their connections close.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from contextlib import contextmanager

import uvicorn

from chunkwise.cli_parser import ArgumentParser
from chunkwise.engine_config import ATTENTION_BACKENDS, DTYPES
from chunkwise.serve.app import ServerState, build_app, check_server_options
from chunkwise.serve.engine_core import EngineCore, EngineStartError, settled_heap
from chunkwise.serve.engine_loop import EngineLoop
from chunkwise.serve.metrics import Metrics

GRACEFUL_SHUTDOWN_S = 10   # after the aborts, how long open connections may take to close
# An idle connection is closed by its client before the server: a client reusing one as the server closes it gets a
# read error instead of an answer. httpx (so the openai client) lets one idle for 5 s, uvicorn's own default.
KEEP_ALIVE_S = 15


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m chunkwise serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m chunkwise serve --model tiny-qwen3 --port 8000\n"
               "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
               "       -d '{\"model\": \"tiny-qwen3\", \"prompt\": [5, 6, 7], \"max_tokens\": 8}'")
    p.add_argument("--model", required=True, help="a checkpoint directory (HF layout) or a built-in name, as for "
                                                  "python -m chunkwise")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--served-model-name", help="the name requests must give as `model` (default: --model)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait for admission; more get 429 (default 1024)")
    p.add_argument("--max-logprobs", type=int, default=20, help="the most top logprobs a request may ask (20)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="step the engine in a process of its own (default), or on a thread of the server's")
    add_engine_options(p)
    return p


ENGINE_OPTIONS = ("dtype", "device", "page_size", "max_model_len", "num_pages", "max_num_batched_tokens",
                  "max_prefill_tokens_with_decodes", "max_num_seqs", "tensor_parallel_size", "split_kv_threshold",
                  "split_size", "max_graph_tokens",
                  "gpu_memory_utilization", "enable_prefix_caching", "enforce_eager", "cascade_attention",
                  "deterministic", "attention_backend", "async_scheduling", "custom_all_reduce")


# Where serving differs from the library's defaults. A step that decodes and prefills makes every decoding user
# wait for its prefill, so serving caps the prefill beside decodes (the full budget still when nothing decodes;
# measured: docs/BENCHMARKS.md, "Behind the code: SERVING_DEFAULTS"). The library keeps the budget alone, for
# offline throughput.
SERVING_DEFAULTS = {"max_prefill_tokens_with_decodes": 256}


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's arguments as options (ENGINE_OPTIONS), each defaulting to None (the engine's own default) but
    those of SERVING_DEFAULTS."""
    e = p.add_argument_group("engine options (chunkwise.engine_config.EngineConfig; default: the engine's)")
    e.add_argument("--dtype", choices=list(DTYPES))
    e.add_argument("--device", help="cpu, cuda or cuda:k")
    for name in ("page_size", "max_model_len", "num_pages", "max_num_batched_tokens", "max_num_seqs",
                 "tensor_parallel_size", "split_kv_threshold", "split_size", "max_graph_tokens"):
        e.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    e.add_argument("--max-prefill-tokens-with-decodes", type=_int_or_none, dest="max_prefill_tokens_with_decodes",
                   default=SERVING_DEFAULTS["max_prefill_tokens_with_decodes"], metavar="N|none",
                   help="prefill tokens a step that also decodes may compute (default %(default)s when serving; none: "
                        "the whole --max-num-batched-tokens)")
    e.add_argument("--gpu-memory-utilization", type=float)
    e.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                   help="prefill attention: triton (chunkwise's, the default) or fa3 (vLLM's FlashAttention-3, "
                        "where installed, on Hopper); decodes keep chunkwise's")
    for name in ("enable_prefix_caching", "enforce_eager", "cascade_attention", "deterministic",
                 "async_scheduling", "custom_all_reduce"):
        e.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, dest=name)


def _int_or_none(text: str) -> int | None:
    """An integer, or None for the word none."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, and those of SERVING_DEFAULTS (given or not, None included),
    as Engine(...) keywords."""
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None or k in SERVING_DEFAULTS}


class Server(uvicorn.Server):
    """uvicorn's server, which on shutdown (a signal, or `should_exit`) first refuses new requests and aborts
    those in flight, so their streams end at once and the graceful wait for open connections is short."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets=None) -> None:
        self.state.accepting = False
        self.state.loop.abort_all()
        await super().shutdown(sockets)


def make_server(loop, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 1024,
                max_logprobs: int = 20, log_level: str = "info") -> Server:
    """A server over a started `loop` (an EngineLoop over an Engine of this process, or an EngineCore: an engine in
    a process of its own); `server.run()` (or a thread running it) serves."""
    loop.streams.metrics = Metrics(model_name, loop.num_waiting, loop.num_running, loop.kv_pages_used,
                                   loop.kv_pages_total())
    state = ServerState(loop, model_name, max_waiting=max_waiting, max_logprobs=max_logprobs)
    config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S)
    return Server(config, state)


def engine_loop(engine) -> EngineLoop:
    """A started EngineLoop stepping `engine` (an Engine of this process) on its own thread."""
    loop = EngineLoop(engine)
    loop.start()
    return loop


@contextmanager
def serving(engine, model_name: str, log_level: str = "warning"):
    """A server on a free 127.0.0.1 port, run by a thread, over `engine`: an Engine of this process (stepped on a
    thread) or a started EngineCore. Yields the server (uvicorn's, with `.url` its address) once it accepts
    connections; on exit stops it, then the engine (closing it)."""
    loop = engine if isinstance(engine, EngineCore) else engine_loop(engine)
    srv = make_server(loop, model_name, port=0, log_level=log_level)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            loop.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    srv.url = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield srv
    finally:
        srv.should_exit = True
        thread.join(30)
        loop.close()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    from chunkwise.engine import Engine

    try:
        check_server_options(args.max_waiting, args.max_logprobs)   # before an engine is built
        if args.engine_process:
            loop = EngineCore(args.model, engine_kwargs(args))
            loop.start()
        else:
            loop = engine_loop(Engine(args.model, **engine_kwargs(args)))
    except KeyboardInterrupt:
        print("python -m chunkwise serve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:   # one line: the engine's errors name what is wrong
        what = str(e) if isinstance(e, EngineStartError) else f"{type(e).__name__}: {' '.join(str(e).split())}"
        print(f"python -m chunkwise serve: error: {what}", file=sys.stderr)
        return 1
    server = make_server(loop, args.served_model_name or args.model, args.host, args.port, args.max_waiting,
                         args.max_logprobs, args.log_level)
    # uvicorn handles SIGINT/SIGTERM while it runs, and once shut down raises the signal again for the handler
    # that was there before it: ours, which lets the engine close and the process exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        with settled_heap():
            server.run()
    finally:
        loop.close()
    return 0 if server.started else 1
