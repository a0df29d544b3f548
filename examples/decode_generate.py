"""Greedy generation with DecodeSession: each decode step is one CUDA graph replay.

    python examples/decode_generate.py [--model smollm2-135m|qwen2.5-0.5b] [--layers N] [--tokens 32]

Builds the model with random weights (nothing is downloaded), prefills a random prompt eagerly,
then generates: every step (all layers, the LM head, greedy argmax, advancing the position) is one
graph replay, with the decode-attention choice measured at capture time and next-layer weights
prefetched into L2. The same prompt through the plain-PyTorch baseline (`TorchDecodeSession`)
gives the comparison. Without CUDA it prints a skip message and exits 0.
"""

import argparse
import time

import torch

from l2lightning.decode.model import CONFIGS, DecodeSession, TorchDecodeSession, build_decoder


def timed_generate(session: DecodeSession, prompt: torch.Tensor, tokens: int) -> tuple[torch.Tensor, float]:
    """Tokens and decode tokens/s of a second run (the first one captures the graphs)."""
    session.generate(prompt, tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = session.generate(prompt, tokens)
    torch.cuda.synchronize()
    return out, (tokens - 1) * prompt.shape[0] / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="smollm2-135m")
    parser.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the real model (quick runs)"
    )
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--attention", default="auto", choices=["auto", "kernel", "torch", "flashinfer"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_generate: skipped, DecodeSession captures CUDA graphs and needs a CUDA GPU")
        return
    model = build_decoder(args.model, layers=args.layers, device="cuda")
    prompt = torch.randint(
        0, model.config.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    max_len = args.prompt + args.tokens
    session = DecodeSession(model, args.batch, max_len, attention=args.attention)
    ours, ours_rate = timed_generate(session, prompt, args.tokens)
    baseline = TorchDecodeSession(model, args.batch, max_len)
    base, base_rate = timed_generate(baseline, prompt, args.tokens)
    print(session.describe())
    print(f"generated (first sequence): {ours[0].tolist()}")
    agree = (ours == base).float().mean().item()
    print(f"tokens equal to the PyTorch baseline: {agree:.0%} (random weights: near-ties may differ in bf16)")
    print(f"DecodeSession: {ours_rate:.0f} tokens/s   TorchDecodeSession: {base_rate:.0f} tokens/s   "
          f"speedup {ours_rate / base_rate:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
