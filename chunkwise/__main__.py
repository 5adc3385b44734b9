"""The main job: generate on a checkpoint through optimized.Engine and print it beside reference.Engine's."""
import argparse
import time

from chunkwise.sampling import SamplingParams

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
DEFAULT_PROMPT = "def quicksort(arr):"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m chunkwise", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or built-in name")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=None, help="prefill the prompt in chunks of this many tokens")
    p.add_argument("--no-reference", action="store_true", help="skip the reference engine")
    return p.parse_args(argv)


def run(engine_cls, args) -> tuple[str, list[int], float]:
    engine = engine_cls(args.model, dtype=args.dtype, page_size=args.page_size)
    start = time.perf_counter()
    out = engine.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens), chunk_sizes=args.chunk_size)[0]
    return out.text, out.token_ids, time.perf_counter() - start


def main(argv=None) -> None:
    args = parse_args(argv)
    from optimized import Engine as OptimizedEngine

    text, tokens, seconds = run(OptimizedEngine, args)
    print(f"== optimized.Engine ({args.model}, {seconds:.1f} s) ==\n{args.prompt}{text}\n")
    if args.no_reference:
        return
    from reference import Engine as ReferenceEngine

    ref_text, ref_tokens, ref_seconds = run(ReferenceEngine, args)
    print(f"== reference.Engine ({args.model}, {ref_seconds:.1f} s) ==\n{args.prompt}{ref_text}\n")
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    if same is None and len(tokens) == len(ref_tokens):
        print(f"identical: {len(tokens)} tokens")
    else:
        print(f"DIFFERENT: first divergence at generated token {same if same is not None else min(len(tokens), len(ref_tokens))}")


if __name__ == "__main__":
    main()
