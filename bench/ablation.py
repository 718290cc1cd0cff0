"""Ablation benchmark: what each speedrun technique buys, measured on CPU with the bundled sample.

Trains the full recipe, the recipe with each technique switched off in turn, and a plain
GPT-2-style AdamW baseline, all at the same token budget and over several seeds. Every run is
`train_gpt.py` itself in a subprocess with `--name=value` overrides (each switch is one of its
hyperparameters), so the benchmark measures exactly the trainer that ships.

    python -m bench.ablation                                  # all variants, 2 seeds, 2 parallel jobs
    python -m bench.ablation --variants=full,baseline --seeds=2 --num_iterations=10
    python -m bench.ablation --resume-existing                # continue an interrupted benchmark

Writes to --out (default bench/results/):
    logs/<variant>_s<seed>.json   train_gpt.py's run summary (val_curve, tokens, train_time_ms, ...)
    logs/<variant>_s<seed>.txt    train_gpt.py's full run log (not committed: it embeds the source)
    logs/<variant>_s<seed>.out    the subprocess's stdout and stderr
    ablation.md                   the results table (also printed)
    ablation.png                  mean validation loss against training tokens, one line per variant

Validation runs on the first --val_tokens tokens of the sample's validation shard, which no run
ever trains on (the training shard is a different file).

Table columns, per variant: final validation loss (mean over seeds); the seed spread (max - min
over seeds: the noise); the difference from the full recipe's mean and whether it is beyond the
noise (|difference| > 2 x the larger of the two seed spreads); the tokens the variant's mean
validation curve needs to reach the full recipe's final mean validation loss (the first
validation point at or below it, linearly interpolated from the point before; "not reached"
otherwise); that count divided by the full recipe's budget; training throughput (tokens /
train_time, validation excluded, measured while --jobs runs share the machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import train_gpt as T  # its TECHNIQUES name the v2 variants; its parser checks every override
from flags import EXIT_OK, EXIT_SOME_FAILED, OneLineArgumentParser, comma_list, integer, number, output_folder, run_cli
from records.read_records import mean_std  # one mean and sample std for every table here

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "train_gpt.py"

# name -> train_gpt.py overrides. Order is the table's order.
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "no_muon": ["--muon=false"],  # Adam for the hidden matrices, at --matrix_adam_lr
    "no_value_embeds": ["--value_embeds=false"],
    "no_unet_skips": ["--unet_skips=false"],
    "no_softcap": ["--logit_softcap=0"],
    "no_sliding_window": ["--sliding_window=false"],
    "no_zero_init": ["--zero_init=false"],
    "no_qk_norm": ["--qk_norm=false"],
    "baseline": ["--muon=false", "--value_embeds=false", "--unet_skips=false", "--logit_softcap=0",
                 "--sliding_window=false", "--zero_init=false", "--mlp_act=gelu", "--weight_decay=0.1"],
}
BASELINE, FULL = "baseline", "full"
REFERENCE_NOTE = ("baseline = plain GPT-2-style AdamW: no Muon (AdamW at matrix_adam_lr, weight decay 0.1 on "
                 "matrices), no value embeddings, no U-net skips, no softcap, full causal attention, random-init "
                 "output projections, GELU MLP. It keeps what train_gpt.py cannot switch off: rotary embeddings, "
                 "rms_norm, the x0 mix, attention scale 0.12, and also QK-norm and the recipe's Adam lrs for "
                 "embeddings/head/scalars.")

# Recipe v2's optimizer, data and schedule half, each technique removed in turn. Every variant
# trains the same token budget (num_iterations x batch_tokens): the batch schedule's smaller early steps
# buy it more steps (run_specs). The reference row is the reference suite's "full" recipe.
# Every variant below is derived from train_gpt.TECHNIQUES: "without X" sets X's flags back to the reference's
# values (Technique.off), "with X" to the records' (its speedrun v2 values).


def without(*names: str) -> list[str]:
    return [flag for t in T.TECHNIQUES if t.name in names for flag in T.as_flags(t.off("cpu"))]


def put_back(name: str) -> list[str]:
    return T.as_flags(next(t for t in T.TECHNIQUES if t.name == name).v2["speedrun"])


V2_MODEL_TECHNIQUES = [t.name for t in T.TECHNIQUES if t.part in ("model", "loss")]  # part 2 of v2
V2_PART1 = "v2_part1"
# --recipe=v2 now also has the model half; the shape is the cpu v2's when this suite ran (1024-token sequences,
# 2048 -> 3072 -> 4096 tokens), so that its committed results stay reproducible
# (the batch schedule's own flag alone, so that its cooldown stayed the v2's 0.55 as when the suite ran)
PART1 = ["--recipe=v2", *without(*V2_MODEL_TECHNIQUES), "--seq_len=1024", "--window_final_tokens=1024",
         "--batch_schedule=1/2,3/4,1"]
V2_PART1_VARIANTS: dict[str, list[str]] = {
    "reference": [],
    V2_PART1: PART1,
    "v2_part1_no_batch_schedule": [*PART1, "--batch_schedule="],
    **{f"v2_part1_no_{name}": [*PART1, *without(name)]
       for name in ("polar_express", "normuon", "cautious_wd", "smoothed_scalars")},
}
V2_PART1_NOTE = ("v2_part1 = --recipe=v2 on the cpu preset: Polar Express, NorMuon, cautious weight decay "
                 "(Muon and Adam), scalar Adam betas (0.9, 0.99), and the batch ramp 2048 -> 3072 -> 4096 tokens "
                 "with lrs scaled by (batch / 4096) ** 0.6 and cooldown_frac 0.55. Document alignment is not in "
                 "the cpu recipe (the bundled sample's documents are ~7.8K tokens long (median); see RECIPES in "
                 "train_gpt.py). Variants with the batch ramp train more steps so that every run sees the same "
                 "tokens.")


V2 = "v2"
# The cpu v2's own batch (RECIPES["v2"]["cpu"]: 512-token sequences, 2048 -> 4096 -> 6144 tokens); the suite's
# common --batch_tokens sets only the token budget (num_iterations x batch_tokens).
V2_CPU = ["--recipe=v2", "--batch_tokens=6144"]
# The techniques the cpu v2 leaves out for what they cost at this scale (those the speedrun v2 keeps), each put
# back (document alignment is left out for the sample's long documents, track 2's own techniques because the
# short track's records do not use them). Suite v2_each takes each one of the rest out.
LEFT_OUT_FOR_COST = [t.name for t in T.TECHNIQUES if "cpu" in t.left_out and "speedrun" in t.v2 and t.part != "data"]
V2_VARIANTS: dict[str, list[str]] = {
    "reference": [],
    V2: V2_CPU,
    **{f"v2_with_{name}": [*V2_CPU, *put_back(name)] for name in LEFT_OUT_FOR_COST},
}
V2_EACH_VARIANTS: dict[str, list[str]] = {
    "reference": [],
    V2: V2_CPU,
    **{f"v2_without_{t.name}": [*V2_CPU, *without(t.name)] for t in T.TECHNIQUES if "cpu" in t.v2},
}
V2_EACH_NOTE = ("v2 = --recipe=v2 on the cpu preset (see the v2 suite); v2_without_X sets technique X's flags back "
                "to the reference recipe's values (train_gpt.TECHNIQUES). Every variant trains the same tokens.")
V2_NOTE = ("v2 = --recipe=v2 on the cpu preset: part 1 (the v2_part1 suite: Polar Express, NorMuon, cautious weight "
           "decay, smoothed scalar betas) with the record's batch ramp in 512-token sequences, 2048 -> 4096 -> 6144 "
           "tokens (windows up to 512 tokens), and part 2, the model: a signed bigram hash embedding, smear, "
           "sparse attention gates, value-embedding and skip gates, backout, partial key offset on the long-window "
           "layers, paired heads on short-window layers 1 and 3. It leaves out the logit rescale and multi-token "
           "prediction, which cost loss on the earlier cpu v2 (bench/results/v2_seq1024_rescale_mtp, where each "
           "technique was removed in turn); v2_with_X puts X back on today's. Validation is always plain next-token "
           "loss.")


# The three recipes on the cpu preset at the v2 suite's budget (96 steps x 4096 tokens), so its reference and v2 rows
# carry over. The record at its cpu shape (RECIPES["record"]["cpu"]: 11 blocks 256 wide, the 2048 -> 4096 -> 6144
# ramp) with its step-count schedules scaled to the ~96 steps this budget buys, as the recipe scales them to 60:
# 1 extension step, the tie split at the last stage's start (round(2 x 95 / 3) = 63, odd), momentum warm-up
# 300 x 96/1285 = 22 and cool-down 50 x 96/1285 = 4.
RECORD_CPU = ["--recipe=record", "--batch_tokens=6144", "--extension_steps=1", "--tied_embed_steps=63",
              "--muon_momentum_warmup_steps=22", "--muon_momentum_cooldown_steps=4"]
RECIPE_VARIANTS: dict[str, list[str]] = {"reference": [], V2: V2_CPU, "record": RECORD_CPU}
RECIPES_NOTE = ("reference = the 2025-01-26 record's recipe (the cpu default); v2 = --recipe=v2 as in the v2 suite; "
                "record = --recipe=record: record #89's model, loss, optimizers and schedule forms at the cpu width "
                "(11 blocks of 256, MUDD, XSA, DC, prefix-token and multi-token losses, the 2048 -> 4096 -> 6144 "
                "batch ramp, tie split and extension scaled to the run's steps). Validation is plain next-token loss.")


@dataclass(frozen=True)
class Suite:
    """A set of variants compared against one of them (target), with a headline against another (baseline)."""
    variants: dict[str, list[str]]
    target: str
    baseline: str
    note: str
    out: str  # default output folder, relative to the repository


SUITES = {
    "reference": Suite(VARIANTS, FULL, BASELINE, REFERENCE_NOTE, "bench/results"),
    "v2_part1": Suite(V2_PART1_VARIANTS, V2_PART1, "reference", V2_PART1_NOTE, "bench/results/v2_part1"),
    "v2": Suite(V2_VARIANTS, V2, "reference", V2_NOTE, "bench/results/v2"),
    "v2_each": Suite(V2_EACH_VARIANTS, V2, "reference", V2_EACH_NOTE, "bench/results/v2_each"),
    "recipes": Suite(RECIPE_VARIANTS, "record", "reference", RECIPES_NOTE, "bench/results/recipes"),
}

# Defaults big enough to tell techniques apart (at 80K tokens per run the variants differed by less
# than their seed noise): 96 steps x 4096 tokens = 393,216 training tokens, validated on 65,536 held-out
# tokens at 5 points, 2 seeds. On our 2-core AMD EPYC with --jobs=2 one run takes about 12 minutes
# (6 s a step on one thread), so 9 variants x 2 seeds take about 2 hours.
DEFAULT_ITERS, DEFAULT_BATCH_TOKENS, DEFAULT_VAL_EVERY, DEFAULT_VAL_TOKENS, DEFAULT_SEEDS = 96, 4096, 24, 65536, 2
VAL_SEQ_LEN = 2048  # the cpu preset's val_seq_len: --val_tokens must be a multiple of it
SAMPLE_VAL_TOKENS = 262144  # tokens in data/sample/sotu_val_000000.bin, the held-out shard


# -----------------------------------------------------------------------------
# Statistics and the table (pure functions, tested on synthetic summaries)

@dataclass
class FailedRun:
    run_id: str
    variant: str
    seed: int
    reason: str  # exit status and the tail of stderr


@dataclass
class VariantStats:
    name: str
    seeds: list[int]
    final_mean: float
    final_std: float  # sample std (ddof=1); nan for a single seed (records/read_records.py's mean_std)
    final_spread: float  # max - min of the final losses over seeds (the noise column); 0 for one seed
    curve: list[tuple[int, float]]  # (tokens, mean val loss over seeds) at the validation points all runs share
    tokens_per_s: float  # mean over runs of tokens / train_time
    budget_tokens: int
    failures: list[FailedRun] = field(default_factory=list)


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """Tokens at which a (tokens, loss) curve first gets to target or below, linearly interpolated
    between the validation point before and the first one at or below; None if it never does."""
    for i, (tokens, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(tokens)
            t0, l0 = curve[i - 1]
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
    return None


def tokens_before(summary: dict, step: int) -> int:
    """Training tokens of steps 0 .. step-1, from the summary's batch stages ([first_step, tokens, accum]);
    summaries from before batch schedules had one batch size, tokens / steps."""
    stages = summary.get("runtime", {}).get("batch_stages") or [[0, int(summary["tokens"]) // int(summary["steps"]), 1]]
    ends = [first for first, _, _ in stages[1:]] + [max(step, stages[-1][0])]
    return sum(tokens * max(0, min(step, end) - first) for (first, tokens, _), end in zip(stages, ends))


def variant_stats(name: str, summaries: list[dict], failures: list[FailedRun] | None = None) -> VariantStats:
    """Aggregates the finished runs (train_gpt.py JSON summaries) of one variant."""
    if not summaries:
        raise ValueError(f"variant {name} has no finished runs")
    finals = [float(s["final_val_loss"]) for s in summaries]
    mean, std = mean_std(finals)
    per_run = [{int(step): float(loss) for step, loss, _ in s["val_curve"]} for s in summaries]
    steps = sorted(set.intersection(*(set(c) for c in per_run)))
    schedules = {tuple(tokens_before(s, step) for step in steps) for s in summaries}
    if len(schedules) != 1:
        raise ValueError(f"variant {name}: runs trained different tokens by the same steps")
    curve = [(tokens, sum(c[step] for c in per_run) / len(per_run)) for tokens, step in zip(schedules.pop(), steps)]
    rates = [s["tokens"] / (s["train_time_ms"] / 1000) for s in summaries if s["train_time_ms"] > 0]
    return VariantStats(name=name, seeds=[int(s["hyperparameters"]["seed"]) for s in summaries], final_mean=mean,
                        final_std=std, final_spread=max(finals) - min(finals), curve=curve, tokens_per_s=sum(rates) / len(rates) if rates else float("nan"),
                        budget_tokens=int(summaries[0]["tokens"]), failures=list(failures or []))


@dataclass
class Table:
    rows: list[dict]  # per variant: name, n, final_mean, spread, delta, beyond_noise, reach_tokens, ratio, tokens_per_s
    target: float | None  # the full recipe's final mean val loss
    headline: str  # the full recipe against the baseline
    markdown: str


def fmt_tokens(tokens: float | None) -> str:
    return "not reached" if tokens is None else f"{tokens:,.0f}"


def beyond_noise(delta: float, spread_a: float, spread_b: float) -> bool:
    """A difference counts only if it exceeds twice the larger seed spread of the two variants (with one
    seed each there is no noise estimate, so nothing counts)."""
    noise = max(spread_a, spread_b)
    return noise > 0 and abs(delta) > 2 * noise


def baseline_headline(base: VariantStats | None, full: VariantStats | None) -> str:
    if base is None:
        return "no baseline runs finished"
    if full is None:
        return "no target runs finished: nothing to compare against"
    reach = tokens_to_reach(full.curve, base.final_mean)
    if reach is None:
        return (f"{full.name} did NOT reach {base.name}'s final val loss {base.final_mean:.4f} within "
                f"{full.budget_tokens:,} tokens (its final mean: {full.final_mean:.4f})")
    return (f"{full.name} reaches {base.name}'s final val loss {base.final_mean:.4f} after {reach:,.0f} "
            f"tokens = {reach / base.budget_tokens:.3f} x the baseline's budget of {base.budget_tokens:,} tokens "
            f"({base.budget_tokens / reach:.2f}x fewer tokens)")


def build_table(stats: dict[str, VariantStats], failures: list[FailedRun], label: str, suite: Suite | None = None) -> Table:
    """The markdown results table: every variant against the suite's target (its final loss is the target)."""
    suite = suite or SUITES["reference"]
    name_of_target = "the full recipe" if suite.target == FULL else suite.target
    full = stats.get(suite.target)
    target = full.final_mean if full else None
    rows = []
    for name, s in stats.items():
        reach = tokens_to_reach(s.curve, target) if target is not None else None
        delta = s.final_mean - target if target is not None else None
        rows.append(dict(name=name, n=len(s.seeds), final_mean=s.final_mean, spread=s.final_spread, delta=delta,
                         beyond_noise=None if delta is None else beyond_noise(delta, s.final_spread, full.final_spread),
                         reach_tokens=reach, ratio=None if reach is None else reach / full.budget_tokens,
                         tokens_per_s=s.tokens_per_s))
    headline = baseline_headline(stats.get(suite.baseline), full)
    short = suite.target
    lines = [f"## Ablation: {label}", ""]
    lines.append(f"Target: {name_of_target}'s final mean val loss, {target:.4f}." if target is not None else
                 f"No {short} run finished: differences and tokens-to-reach are not available.")
    lines += [f"Baseline: {headline}.", "",
              f"| variant | runs | final val loss (mean) | seed spread (noise) | Δ vs {short} | beyond 2× noise | "
              f"tokens to reach {short}'s final | ratio to {short}'s budget | tokens/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        delta = "n/a" if row["delta"] is None else f"{row['delta']:+.4f}"
        mark = "n/a" if row["beyond_noise"] is None else ("**yes**" if row["beyond_noise"] else "no")
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"| {row['name']} | {row['n']} | {row['final_mean']:.4f} | {row['spread']:.4f} | {delta} | "
                     f"{mark} | {fmt_tokens(row['reach_tokens'])} | {ratio} | {row['tokens_per_s']:,.0f} |")
    lines += ["", f"Note: {suite.note}",
              "Seed spread is max - min of the final val loss over seeds. A difference is beyond the noise when it "
              f"exceeds twice the larger spread of the variant and {name_of_target}. Tokens-to-reach uses the mean "
              f"curve over seeds, interpolated between validation points; the ratio divides it by {name_of_target}'s "
              "token budget. tokens/s is training throughput with validation excluded, measured while "
              "parallel runs shared the cores."]
    if failures:
        lines += ["", "Runs left out (failed, or not run):"]
        lines += [f"- {f.run_id}: {f.reason}" for f in failures]
    return Table(rows=rows, target=target, headline=headline, markdown="\n".join(lines) + "\n")


# -----------------------------------------------------------------------------
# Running the trainer

@dataclass
class RunSpec:
    variant: str
    seed: int
    args: list[str]  # train_gpt.py arguments

    @property
    def run_id(self) -> str:
        return f"{self.variant}_s{self.seed}"


def run_specs(variants: list[str], seeds: int, num_iterations: int, val_every: int, val_tokens: int,
              log_dir: Path, overrides: dict[str, list[str]] | None = None,
              batch_tokens: int = DEFAULT_BATCH_TOKENS) -> list[RunSpec]:
    """Seed-major order, so an interrupted benchmark has every variant at its first seeds.
    overrides: per-variant train_gpt.py arguments (default VARIANTS)."""
    overrides = overrides or VARIANTS
    specs = []
    for seed in range(seeds):
        for name in variants:
            common = ["--preset=cpu", f"--seed={seed}", f"--batch_tokens={batch_tokens}",
                      f"--num_iterations={num_iterations}",
                      f"--val_every={val_every}", f"--val_tokens={val_tokens}"]
            steps = equal_budget_steps(common + overrides[name], num_iterations * batch_tokens)
            specs.append(RunSpec(name, seed, common + overrides[name] + [f"--num_iterations={steps}"] +
                                 [f"--run_id={name}_s{seed}", f"--log_dir={log_dir}"]))
    return specs


def equal_budget_steps(args: list[str], budget: int) -> int:
    """The step count whose batch schedule trains closest to `budget` tokens (fewer steps on a tie):
    --num_iterations for a constant batch, more steps for a schedule that starts smaller."""
    parsed = T.parse_args(args, False)

    def tokens(steps: int) -> int:
        return T.batch_schedule(dataclasses.replace(parsed, num_iterations=steps), 1).tokens_before(steps)
    steps = max(1, budget // parsed.batch_tokens)
    while tokens(steps) < budget:
        steps += 1
    return steps - 1 if steps > 1 and budget - tokens(steps - 1) <= tokens(steps) - budget else steps


def expected_hyperparameters(spec: RunSpec) -> dict:
    """What the run's summary must record for --resume-existing to reuse it."""
    parsed = T.parse_args([a for a in spec.args if not a.startswith(("--run_id", "--log_dir"))], False)
    return {k: v for k, v in vars(parsed).items() if k not in ("run_id", "log_dir")}


# Where a run's files go, and the loss its summary marks as the target: a run that differs only in these trained
# and validated the same way, so its summary stands for this spec's
NOT_THE_RUNS_MATH = ("run_id", "log_dir", "target_val_loss")


def reusable_summary(spec: RunSpec, log_dir: Path) -> dict | None:
    path = log_dir / f"{spec.run_id}.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    recorded = {k: v for k, v in summary.get("hyperparameters", {}).items() if k not in NOT_THE_RUNS_MATH}
    expected = {k: v for k, v in expected_hyperparameters(spec).items() if k not in NOT_THE_RUNS_MATH}
    # A run from before a hyperparameter existed ran its default (each new switch defaults to the old math).
    defaults = {f.name: f.default for f in dataclasses.fields(T.Hyperparameters)}
    recorded.update({k: v for k, v in expected.items() if k not in recorded and v == defaults.get(k)})
    if summary.get("status") != "finished" or recorded != expected:
        return None
    return summary


def stderr_tail(text: str, lines: int = 8) -> str:
    tail = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(tail) if tail else "(no output)"


def run_one(spec: RunSpec, log_dir: Path, threads: int) -> dict | FailedRun:
    """Runs train_gpt.py once; returns its summary, or a FailedRun with the stderr tail."""
    for suffix in (".json", ".txt", ".out"):  # the run log appends: start each run clean
        (log_dir / f"{spec.run_id}{suffix}").unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, str(TRAINER), *spec.args], cwd=REPO, env=env,
                          capture_output=True, text=True)
    (log_dir / f"{spec.run_id}.out").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    path = log_dir / f"{spec.run_id}.json"
    if proc.returncode != 0 or not path.is_file():
        return FailedRun(spec.run_id, spec.variant, spec.seed,
                       f"exit status {proc.returncode}: {stderr_tail(proc.stderr or proc.stdout)}")
    return json.loads(path.read_text())


def run_all(specs: list[RunSpec], log_dir: Path, jobs: int, resume: bool,
            report_only: bool = False) -> tuple[dict[str, list[dict]], list[FailedRun], int]:
    """Trains every spec (reusing matching finished summaries with resume); returns the summaries by
    variant, the failures and how many runs were reused."""
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    results: dict[str, list[dict]] = {}
    failures: list[FailedRun] = []
    todo = []
    for spec in specs:
        summary = reusable_summary(spec, log_dir) if resume else None
        if summary is not None:
            print(f"reusing {spec.run_id}: final val loss {summary['final_val_loss']:.4f}", flush=True)
            results.setdefault(spec.variant, []).append(summary)
        else:
            todo.append(spec)
    if report_only:  # the table of what has finished; each run not (yet) there is named
        return results, [FailedRun(s.run_id, s.variant, s.seed, "not run (--report-only: no finished summary with "
                                   "these settings)") for s in todo], len(specs) - len(todo)
    started = time.time()
    print(f"{len(todo)} run(s) to train, {jobs} at a time with OMP_NUM_THREADS={threads}", flush=True)

    def job(spec: RunSpec):
        t = time.time()
        out = run_one(spec, log_dir, threads)
        return spec, out, time.time() - t

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for done, (spec, out, seconds) in enumerate(pool.map(job, todo), 1):
            elapsed = time.time() - started
            if isinstance(out, FailedRun):
                failures.append(out)
                print(f"[{done}/{len(todo)} {elapsed:.0f}s] FAILED {spec.run_id} ({seconds:.0f}s): {out.reason}",
                      flush=True)
            else:
                results.setdefault(spec.variant, []).append(out)
                print(f"[{done}/{len(todo)} {elapsed:.0f}s] {spec.run_id}: final val loss "
                      f"{out['final_val_loss']:.4f} in {seconds:.0f}s", flush=True)
    return results, failures, len(specs) - len(todo)


def plot(stats: dict[str, VariantStats], target: float | None, label: str, path: Path, suite: Suite) -> str:
    """Mean val loss vs tokens per variant (the step-0 point is left out: it only stretches the axis)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, s in stats.items():
        pts = [(t, loss) for t, loss in s.curve if t > 0]
        style = dict(linewidth=2.5, color="black") if name == suite.target else \
            dict(linewidth=2.5, color="tab:red", linestyle="--") if name == suite.baseline else dict(linewidth=1.2)
        ax.plot([t for t, _ in pts], [loss for _, loss in pts], marker="o", markersize=3, label=name, **style)
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"{suite.target} final {target:.3f}")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title(textwrap.fill(label, 100), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def parse_cli(argv: list[str]) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=integer(1), default=DEFAULT_SEEDS, help=f"seeds 0..N-1 per variant ({DEFAULT_SEEDS})")
    p.add_argument("--num_iterations", type=integer(1), default=DEFAULT_ITERS, help=f"training steps ({DEFAULT_ITERS})")
    p.add_argument("--batch_tokens", type=integer(1024), default=DEFAULT_BATCH_TOKENS,
                   help=f"tokens per step, a multiple of the cpu preset's seq_len 1024 ({DEFAULT_BATCH_TOKENS})")
    p.add_argument("--val_every", type=integer(0), default=DEFAULT_VAL_EVERY, help="validation interval in steps")
    p.add_argument("--val_tokens", type=integer(1), default=DEFAULT_VAL_TOKENS,
                   help=f"held-out validation tokens, a multiple of {VAL_SEQ_LEN} ({DEFAULT_VAL_TOKENS})")
    p.add_argument("--suite", default="reference", choices=list(SUITES),
                   help="reference: the 2025-01-26 techniques; v2_part1: recipe v2's optimizer half")
    p.add_argument("--variants", type=comma_list(items="variant names"), default=None,
                   help="comma-separated subset of the suite's variants (all)")
    p.add_argument("--jobs", type=integer(1), default=2, help="parallel runs; each gets OMP_NUM_THREADS = cores // jobs")
    p.add_argument("--out", type=Path, default=None, help="folder for logs, table, plot (the suite's folder)")
    p.add_argument("--baseline-matrix-adam-lr", dest="baseline_lr", type=number(0, lo_open=True), default=None,
                   help="the baseline's AdamW lr for hidden matrices (default: train_gpt.py's matrix_adam_lr)")
    p.add_argument("--report-only", dest="report_only", action="store_true",
                   help="train nothing: the table and plot of the finished runs in OUT/logs whose settings match")
    p.add_argument("--resume-existing", dest="resume_existing", action="store_true",
                   help="reuse finished run summaries in OUT/logs whose hyperparameters match")
    a = p.parse_args(argv)
    suite = SUITES[a.suite]
    a.out = a.out or REPO / suite.out
    a.variants = a.variants or list(suite.variants)
    unknown = [v for v in a.variants if v not in suite.variants]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)} in suite {a.suite}; valid: {', '.join(suite.variants)}")
    if a.val_tokens <= 0 or a.val_tokens % VAL_SEQ_LEN or a.val_tokens > SAMPLE_VAL_TOKENS:
        p.error(f"--val_tokens={a.val_tokens} must be a positive multiple of the cpu preset's val_seq_len "
                f"{VAL_SEQ_LEN}, at most the {SAMPLE_VAL_TOKENS:,} tokens of the held-out shard")
    if a.batch_tokens <= 0 or a.batch_tokens % 1024:
        p.error(f"--batch_tokens={a.batch_tokens} must be a positive multiple of the cpu preset's seq_len 1024")
    output_folder(a.out, "--out", "pass --out=FOLDER where a folder can be made and written")  # before any run
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_cli(sys.argv[1:] if argv is None else argv)
    out = a.out.resolve()
    log_dir = out / "logs"
    cores = os.cpu_count() or 1
    suite = SUITES[a.suite]
    label = (f"CPU ({cores} cores), bundled State of the Union sample, cpu preset, {a.num_iterations} steps × "
             f"{a.batch_tokens} tokens, {a.seeds} seed(s), val {a.val_tokens} held-out tokens every {a.val_every} "
             f"steps, {a.jobs} run(s) in parallel")
    overrides = dict(suite.variants)
    if a.baseline_lr is not None and BASELINE in overrides:
        overrides[BASELINE] = VARIANTS[BASELINE] + [f"--matrix_adam_lr={a.baseline_lr}"]
        label += f", baseline matrix_adam_lr {a.baseline_lr}"
    specs = run_specs(a.variants, a.seeds, a.num_iterations, a.val_every, a.val_tokens, log_dir, overrides,
                      a.batch_tokens)
    started = time.time()
    results, failures, reused = run_all(specs, log_dir, a.jobs, a.resume_existing or a.report_only, a.report_only)
    stats = {name: variant_stats(name, results[name], [f for f in failures if f.variant == name])
             for name in a.variants if results.get(name)}
    for name in a.variants:
        if name not in stats:
            print(f"variant {name}: every run failed; left out of the table", flush=True)
    if not stats:
        print("error: no run finished; nothing to report", file=sys.stderr)
        return 1
    table = build_table(stats, failures, label, suite)
    trained = 0 if a.report_only else len(specs) - reused
    text = table.markdown + (f"\nWall time of this invocation: {time.time() - started:.0f} s "
                             f"({trained} run(s) trained, {reused} reused from earlier invocations).\n")
    (out / "ablation.md").write_text(text)
    print(text)
    print(plot(stats, table.target, label, out / "ablation.png", suite))
    return EXIT_SOME_FAILED if failures else EXIT_OK


if __name__ == "__main__":
    sys.exit(run_cli(main))
