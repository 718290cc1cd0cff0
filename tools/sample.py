"""Sample text from a trained model: python -m tools.sample <checkpoint> --prompt "The President"

<checkpoint> is a step_N/ folder train_gpt.py wrote (final or mid-run) or a folder tools/export.py wrote.
The prompt starts a document (an <|endoftext|> token goes first, as in training; "<|endoftext|>" inside
the prompt starts another one). Decoding uses the model's own attention rules (document start, long and
short sliding windows) through a KV cache, so each new token costs O(window), not a pass over the
prefix; --kv_cache=false runs the full-prefix forward instead, for comparison. A sample ends at
--max_new_tokens (at least 1) or when the model ends the document. --temperature=0 decodes greedily; a
positive one is at least 1e-6, since smaller ones overflow the scaled logits.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import evaluation
from flags import integer, number, run_cli
from tools.loading import T, load_model, model_parser

EOT = T.EOT_TOKEN
# Below this a temperature divides the logits past float32's range (NaN probabilities); 0 is greedy already.
MIN_TEMPERATURE = 1e-6


def fit_prompt(prompt: list[int], max_new_tokens: int, context: int) -> tuple[list[int], bool]:
    """The prompt cut from the left (its leading document start kept) so that the new tokens fit the context."""
    if max_new_tokens >= context:
        raise T.UsageError(f"--max_new_tokens={max_new_tokens} leaves no room for the prompt in the model's "
                           f"{context}-token context; use at most {context - 1}")
    keep = context - max_new_tokens
    if len(prompt) <= keep:
        return prompt, False
    head = prompt[:1] if prompt[0] == EOT else []
    return head + prompt[len(prompt) - (keep - len(head)):], True


def encode_prompt(enc, text: str) -> list[int]:
    """A document start, then the prompt ("<|endoftext|>" in it is the EOT token)."""
    return [EOT] + enc.encode(text, allowed_special={"<|endoftext|>"})


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--prompt", default="", help="text the samples continue (default: none, a fresh document)")
    p.add_argument("--max_new_tokens", type=integer(1), default=100, help="at least 1 (default %(default)s)")
    p.add_argument("--temperature", type=number(MIN_TEMPERATURE, also=(0.0,)), default=1.0,
                   help=f"0: greedy, else at least {MIN_TEMPERATURE:g} (default %(default)s)")
    p.add_argument("--top_k", type=integer(0), default=50, help="0: the whole vocabulary (default %(default)s)")
    p.add_argument("--seed", type=integer(0, 2**64 - 1), default=0, help="of torch.Generator (default %(default)s)")
    p.add_argument("--num_samples", type=integer(1), default=1)
    p.add_argument("--kv_cache", default="true", choices=["true", "false"],
                   help="false: a full forward over the prefix for every token (slow; for comparison)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    enc = evaluation.gpt2_tokenizer()
    loaded = load_model(opts.checkpoint, opts.device, opts.window)
    model, context = loaded.model, loaded.model.context_len
    prompt, cut = fit_prompt(encode_prompt(enc, opts.prompt), opts.max_new_tokens, context)
    if cut:
        print(f"warning: the prompt is longer than the model's {context}-token context leaves room for with "
              f"--max_new_tokens={opts.max_new_tokens}; kept its last {len(prompt) - 1} tokens", file=sys.stderr)
    print(f"{loaded.source}: step {loaded.step}, {loaded.args.n_layer} layers x {loaded.args.model_dim}, "
          f"window {loaded.window_blocks} blocks, {model.embed.weight.device}, kv_cache {opts.kv_cache}",
          file=sys.stderr)
    device = model.embed.weight.device
    generator = torch.Generator(device=device).manual_seed(opts.seed)
    generated, seconds = 0, 0.0
    for i in range(opts.num_samples):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        new = evaluation.generate(model, prompt, opts.max_new_tokens, loaded.windows, opts.temperature, opts.top_k,
                       generator, kv_cache=opts.kv_cache == "true")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        generated += len(new)
        if opts.num_samples > 1:
            print(f"--- sample {i + 1}/{opts.num_samples} ---")
        print(enc.decode(prompt[1:] + new), flush=True)
    print(f"{generated} tokens in {seconds:.2f}s: {generated / max(seconds, 1e-9):.1f} tokens/s "
          f"(kv_cache {opts.kv_cache})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
