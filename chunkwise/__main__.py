"""Generate on a checkpoint through chunkwise.Engine and print it beside chunkwise.reference.Engine's output.

Errors, a bad argument's too, are one line on stderr and exit status 1 (--traceback shows the whole trace).
`python -m chunkwise serve --model M` runs the OpenAI-compatible HTTP server instead (`serve --help`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from chunkwise.checkpoints import REAL_NAMES, TINY_NAMES
from chunkwise.cli_parser import ArgumentParser
from chunkwise.engine_config import DTYPES
from chunkwise.sampling import SamplingParams

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
DEFAULT_PROMPT = "def quicksort(arr):"
RANDOM_PROMPT_TOKENS = 16


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    return ids


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m chunkwise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m chunkwise\n  python -m chunkwise --model tiny-qwen3 --prompt-ids 5,6,7\n"
               "  python -m chunkwise --model gemma3-270m --prompt 'The three primary colors are'\n"
               "  python -m chunkwise serve --model tiny-qwen3   (an OpenAI-compatible server: serve --help)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a checkpoint directory (HF layout) or a built-in name: {', '.join(TINY_NAMES)} (tiny "
                        f"random checkpoints without a tokenizer), {', '.join(REAL_NAMES)} (real ones, from the "
                        f"registry packages of the `real` extra). Default: {DEFAULT_MODEL}")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help=f"prompt text (needs a tokenizer). Default: {DEFAULT_PROMPT!r}, or "
                                         f"{RANDOM_PROMPT_TOKENS} random token ids (from --seed) for a "
                                         f"checkpoint without a tokenizer")
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="the prompt as token ids: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="default float32")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (default 16)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill the prompt in chunks of this many tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default) keeps every token")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seeds sampling and a random prompt (default 0)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference engine")
    p.add_argument("--traceback", action="store_true", help="on an error, show the whole traceback")
    return p


def random_prompt(config, seed: int, n: int = RANDOM_PROMPT_TOKENS) -> list[int]:
    """n token ids drawn from `seed`, leaving out the checkpoint's BOS and EOS ids."""
    special = set(config.eos_token_ids) | {config.bos_token_id}
    allowed = torch.tensor([t for t in range(config.vocab_size) if t not in special])
    picks = torch.randint(len(allowed), (n,), generator=torch.Generator().manual_seed(seed))
    return allowed[picks].tolist()


def choose_prompt(args, engine) -> tuple[str | list[int], str | None]:
    """The prompt, and a line saying where it came from when the user did not give it."""
    if args.prompt_ids is not None:
        return args.prompt_ids, None
    if engine.tokenizer is None:
        if args.prompt is not None:
            raise ValueError(f"{args.model} has no tokenizer, so --prompt text cannot be encoded; pass "
                             f"--prompt-ids 1,2,3 (or neither, for a random prompt)")
        ids = random_prompt(engine.model_config, args.seed)
        return ids, (f"prompt: {len(ids)} random token ids (seed {args.seed}), as {args.model} has no "
                     f"tokenizer: {ids}")
    return (args.prompt if args.prompt is not None else DEFAULT_PROMPT), None


@contextmanager
def counted(engine, method: str, tokens_of, bar):
    """Advance `bar` by tokens_of(result) after each call of engine.<method> (instance-level wrap)."""
    original = getattr(engine, method)

    def wrapper(*a, **kw):
        result = original(*a, **kw)
        bar.update(tokens_of(result))
        return result
    setattr(engine, method, wrapper)
    try:
        yield
    finally:
        delattr(engine, method)


def run_engine(kind: str, args, params: SamplingParams, prompt=None):
    """Load `kind`'s engine and generate with live progress; (engine, prompt, output, load s, gen s).

    The optimized engine's own progress bar counts generated tokens; the reference has none, so its
    tokens are counted by its forwards (one full `logits` pass per generated token)."""
    module = importlib.import_module(kind)
    start = time.perf_counter()
    engine = module.Engine(args.model, dtype=args.dtype, page_size=args.page_size)
    loaded = time.perf_counter()
    if prompt is None:
        prompt, note = choose_prompt(args, engine)
        if note:
            print(note)
    if kind == "chunkwise.engine":
        out = engine.generate([prompt], params, chunk_sizes=args.chunk_size, use_tqdm=True)[0]
    else:
        # delay: no bar for a request refused at once, so its error stays one clean line
        with tqdm(total=params.max_tokens, desc=f"{kind}.Engine", unit="tok", file=sys.stderr, leave=False,
                  delay=0.5) as bar, counted(engine, "logits", lambda _: 1, bar):
            out = engine.generate([prompt], params, chunk_sizes=args.chunk_size)[0]
    return engine, prompt, out, loaded - start, time.perf_counter() - loaded


def report(kind: str, args, engine, prompt, out, load_s: float, gen_s: float) -> None:
    n = len(out.token_ids)
    print(f"== {kind}.Engine ({args.model}, {args.dtype}): load {load_s:.1f} s + generate {gen_s:.1f} s "
          f"= {load_s + gen_s:.1f} s; {n} tokens, {n / gen_s:.1f} tok/s, finish {out.finish_reason} ==")
    if engine.tokenizer is not None:
        print((prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)) + out.text)
    print(f"token ids: {out.token_ids}\n")


def run(args) -> None:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    engine, prompt, out, load_s, gen_s = run_engine("chunkwise.engine", args, params)
    report("chunkwise.engine", args, engine, prompt, out, load_s, gen_s)
    if args.no_reference:
        return
    del engine   # its KV pool is no longer needed
    ref_engine, _, ref, load_s, gen_s = run_engine("chunkwise.reference", args, params, prompt)
    report("chunkwise.reference", args, ref_engine, prompt, ref, load_s, gen_s)
    tokens, ref_tokens = out.token_ids, ref.token_ids
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    if first is None and len(tokens) == len(ref_tokens):
        print(f"identical: {len(tokens)} tokens")
    else:
        print(f"DIFFERENT: first divergence at generated token {first if first is not None else min(len(tokens), len(ref_tokens))}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:   # the server's own options (chunkwise/serve/cli.py)
        from chunkwise.serve.cli import main as serve
        return serve(argv[1:])
    args = parser().parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        print("python -m chunkwise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, not a traceback: the engines' errors name what is wrong
        if args.traceback:
            raise
        message = " ".join(str(e).split("\n"))
        print(f"python -m chunkwise: error: {type(e).__name__}: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
