"""What each recipe-v2 technique costs in speed: time per training step of every ablation variant, in one
process, one after another, on the same 4,096-token batches of the bundled sample.

    python -m bench.step_cost                        # the v2 suite's variants, 3 timed steps each, 1 thread
    python -m bench.step_cost --suite=v2_part1 --steps=5 --threads=2

Each variant is built as train_gpt.py builds it (build_model on the runtime setup_runtime picks, then
build_optimizers) from the ablation suite's overrides, with one 4,096-token batch per step for every variant
(the batch schedule is switched off, so every step costs what the full batch costs). A step is timed in two
parts: forward + backward over its micro-batches, and the optimizer step. After one untimed step, the
median of --steps steps is printed per variant, with tokens/s and the ratio to the first variant (the
reference). Numbers for closing notes and the README, not a test; run it on an otherwise idle machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import train_gpt as T
from bench import ablation
from flags import OneLineArgumentParser, comma_list, integer, run_cli


STEP_TOKENS = 4096  # the cpu ablation's full batch: 4 sequences of 1,024


def time_variant(overrides: list[str], steps: int) -> tuple[float, float]:
    """(median forward + backward seconds, median optimizer seconds) per 4,096-token step."""
    args = T.parse_args(["--preset=cpu", *overrides, "--batch_schedule=", f"--batch_tokens={STEP_TOKENS}"], False)
    rt = T.setup_runtime(args)
    torch.manual_seed(args.seed)
    model = T.build_model(args, rt)
    opt = T.build_optimizers(model, args, 0, 1)
    stream = T.TokenStream(T.find_shards(args.train_files, "training"), args.vocab_size, cycle=True)
    loader = T.DistributedTokenLoader(stream, 0, 1, False, 0, rt.device, step_in_one_shard=args.batch_sequences > 0)
    batches = T.batch_schedule(args, 1)  # one stage: the batch schedule is off
    accum, seq_len = batches.accum(0), batches.seq_len(0)
    schedules = T.StepTensors(args, rt.device)
    forward_backward, optimizer = [], []
    for step in range(steps + 1):
        extra = schedules.mtp_weights(step)
        start = time.perf_counter()
        for i, (x, y) in enumerate(loader.next_batch(accum, seq_len)):
            opt.sync.arm(i == accum - 1)
            model(x, y, schedules.windows(step), *extra).backward()
        middle = time.perf_counter()
        opt.step(1.0, args.muon_momentum, accum)
        model.zero_grad(set_to_none=True)
        if step:  # the first step compiles the loss kernel
            forward_backward.append(middle - start)
            optimizer.append(time.perf_counter() - middle)
    return statistics.median(forward_backward), statistics.median(optimizer)


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="v2", choices=list(ablation.SUITES), help="whose variants to time (v2)")
    p.add_argument("--variants", type=comma_list(items="variant names"), default=None,
                   help="comma-separated subset (all of the suite's)")
    p.add_argument("--steps", type=integer(1), default=3, help="timed steps per variant, after one untimed (3)")
    p.add_argument("--threads", type=integer(1), default=1, help="torch threads (1, as each ablation run has)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    variants = ablation.SUITES[a.suite].variants
    names = a.variants or list(variants)
    unknown = [n for n in names if n not in variants]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(variants)}")
    print(f"| variant | forward + backward (s) | optimizer (s) | step (s) | tokens/s | vs {names[0]} |")
    print("|---|---|---|---|---|---|")
    first = None
    for name in names:
        fb, op = time_variant(variants[name], a.steps)
        first = first or fb + op
        print(f"| {name} | {fb:.2f} | {op:.2f} | {fb + op:.2f} | {STEP_TOKENS / (fb + op):,.0f} | "
              f"{(fb + op) / first:.2f}x |", flush=True)
    print(f"\n{a.steps} timed steps of {STEP_TOKENS:,} tokens per variant (median), {a.threads} thread(s), "
          f"one process, cpu preset, batch schedule off.")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
