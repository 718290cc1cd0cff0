"""Beyond the loss, beside train_gpt.py: samples from a model and its HellaSwag accuracy, for --sample_at_end and
--hellaswag_every during training and for tools/sample.py and tools/hellaswag.py on a saved model. Imported by
the trainer only when a run asks for one of them.

A model here is train_gpt.py's GPT, used through what it offers a caller: logits(), decode() with kv_cache(),
softcapped(), window(), and its input conventions eot_token (every document starts with it) and block_size
(sequences are whole blocks).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from flags import UsageError
from runlog import progress_bar, progress_line


def gpt2_tokenizer():
    """tiktoken's GPT-2 encoding (tiktoken downloads it once, then reads it from its cache)."""
    try:
        import tiktoken  # an optional extra: only the downstream checks need it
    except ImportError:
        raise UsageError("the GPT-2 tokenizer needs tiktoken: pip install -r requirements-extras.txt") from None
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # network and cache errors of tiktoken's one-time download take many forms
        raise UsageError(f"cannot load the GPT-2 tokenizer ({type(e).__name__}): tiktoken downloads it once; "
                         "connect to the internet, or set TIKTOKEN_CACHE_DIR to a folder holding its cache") from None


def next_token(model, logits: Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else a draw from the model's softcapped distribution (top_k > 0 keeps the k
    likeliest). The head's padding rows beyond the vocabulary are never drawn."""
    logits = model.softcapped(logits[:model.vocab_size])
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < model.vocab_size:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def padded_to_blocks(model, tokens: list[int]) -> Tensor:
    """tokens followed by EOTs up to whole blocks, on the model's device (causal: the padding changes no earlier
    logit)."""
    padding = [model.eot_token] * (-len(tokens) % model.block_size)
    return torch.tensor(tokens + padding, device=model.embed.weight.device)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, windows: tuple[int, int], temperature: float = 1.0,
             top_k: int = 0, generator: torch.Generator | None = None, kv_cache: bool = True) -> list[int]:
    """New tokens after prompt (which fits the context), stopping before an EOT the model emits. kv_cache=False
    runs the ordinary forward over the whole prefix for every token: the reference the cache is tested against."""
    device = model.embed.weight.device
    out: list[int] = []
    if kv_cache:
        cache = model.kv_cache(windows, max_len=len(prompt) + max_new_tokens)
        logits = model.decode(torch.tensor(prompt, device=device), cache)
    window = model.window(windows)
    for i in range(max_new_tokens):
        if not kv_cache:
            sequence = prompt + out
            logits = model.logits(padded_to_blocks(model, sequence), window)[0, len(sequence) - 1]
        token = next_token(model, logits, temperature, top_k, generator)
        if token == model.eot_token:
            break
        out.append(token)
        if kv_cache and i + 1 < max_new_tokens:
            logits = model.decode(torch.tensor([token], device=device), cache)
    return out


END_OF_RUN_TOKENS = 64  # --sample_at_end: short samples from a document start ...
END_OF_RUN_TOP_K = 50  # ... at temperature 1 among the 50 likeliest tokens


def end_of_run_samples(model, n: int, windows: tuple[int, int], seed: int) -> list[str]:
    """--sample_at_end: n short unconditional samples, drawn with a generator of their own."""
    enc = gpt2_tokenizer()
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    return [enc.decode(generate(model, [model.eot_token], END_OF_RUN_TOKENS, windows, 1.0, END_OF_RUN_TOP_K,
                                generator)) for _ in range(n)]


HELLASWAG_COMMIT = "a29ff8e9a04bba4bd6588223785ce105328adc57"  # github.com/rowanz/hellaswag
HELLASWAG_URL = f"https://raw.githubusercontent.com/rowanz/hellaswag/{HELLASWAG_COMMIT}/data/hellaswag_val.jsonl"
HELLASWAG_BLOB_SHA1 = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # git's id of hellaswag_val.jsonl at that commit
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_FETCH_HINT = (f"fetch it by hand: curl -L -o {HELLASWAG_FILE} {HELLASWAG_URL}, then pass it as "
                        "--hellaswag_data (tools/hellaswag.py: --data)")
HELLASWAG_PACK_TOKENS = 1024  # candidates are scored packed into sequences of at most this many tokens


def git_blob_id(data: bytes) -> str:
    """git's id of a file's content, how GitHub names the pinned HellaSwag file: sha1 of b"blob <size>\\0" + data."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2-speedrun"


def download_hellaswag(url: str, target: Path, expected: str) -> None:
    """Fetches url into target, atomically, only if its content has the expected git blob id."""
    import urllib.request  # only the first HellaSwag run downloads
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except Exception as e:  # DNS, refused connections, HTTP errors, timeouts
        raise UsageError(f"cannot download the HellaSwag validation file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:120]}); {HELLASWAG_FETCH_HINT}") from None
    if git_blob_id(data) != expected:
        raise UsageError(f"the downloaded HellaSwag file has git blob id {git_blob_id(data)}, expected {expected}: "
                         f"corrupt or changed; {HELLASWAG_FETCH_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.part{os.getpid()}")  # ranks of one node may download at once
    part.write_bytes(data)
    os.replace(part, target)


def cached_hellaswag_file(cache_dir: Path | None = None, url: str = HELLASWAG_URL,
                          expected: str = HELLASWAG_BLOB_SHA1) -> Path:
    """The pinned validation file: downloaded on first use, verified on every use."""
    path = (cache_dir or download_cache_dir()) / HELLASWAG_FILE
    if path.is_file():
        found = git_blob_id(path.read_bytes())
        if found == expected:
            return path
        print(f"warning: cached {path} has git blob id {found}, expected {expected}; downloading it again",
              file=sys.stderr)
    download_hellaswag(url, path, expected)
    return path


@dataclass
class HellaSwagExample:
    context: str
    endings: list[str]
    label: int

    @property
    def well_formed(self) -> bool:  # endings a list of 4 strings: a 4-letter string would pass as 4 endings
        return (isinstance(self.context, str) and isinstance(self.endings, list) and len(self.endings) == 4
                and all(isinstance(e, str) for e in self.endings) and 0 <= self.label < 4)


def read_hellaswag(path: Path) -> list[HellaSwagExample]:
    """The validation split's JSONL: one object per line with "ctx", four "endings" and the "label" index."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"HellaSwag file {path} does not exist; {HELLASWAG_FETCH_HINT}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read HellaSwag file {path} ({type(e).__name__}); {HELLASWAG_FETCH_HINT}") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            example = HellaSwagExample(row["ctx"], row["endings"], int(row["label"]))
            ok = example.well_formed
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise UsageError(f"line {number} of {path} is not a HellaSwag example (needs ctx, 4 endings and a "
                             f"label 0-3): corrupt or another format; {HELLASWAG_FETCH_HINT}")
        examples.append(example)
    if not examples:
        raise UsageError(f"HellaSwag file {path} holds no examples; {HELLASWAG_FETCH_HINT}")
    return examples


@dataclass
class Candidate:
    tokens: list[int]  # EOT, context, ending
    ending_start: int  # index of the ending's first token


def candidates(example: HellaSwagExample, enc, max_tokens: int) -> list[Candidate]:
    """The four scored sequences; a context too long for max_tokens loses its oldest tokens."""
    context = enc.encode_ordinary(example.context)
    out = []
    for ending in example.endings:
        end = enc.encode_ordinary(" " + ending)[:max_tokens - 2]
        kept = context[max(0, len(context) - (max_tokens - 1 - len(end))):]
        out.append(Candidate([enc.eot_token] + kept + end, 1 + len(kept)))
    return out


def tokenized_hellaswag(examples: list[HellaSwagExample], enc, max_tokens: int) -> list[tuple[list[Candidate], int]]:
    return [(candidates(e, enc, max_tokens), e.label) for e in examples]


def load_hellaswag(data: str, max_tokens: int, cache_dir: Path | None = None) -> tuple[list, Path]:
    """Tokenized examples of a local file (data), or of the pinned validation file when data is empty."""
    path = Path(data) if data else cached_hellaswag_file(cache_dir)
    return tokenized_hellaswag(read_hellaswag(path), gpt2_tokenizer(), max_tokens), path


def candidate_packs(rows: list[Candidate], pack_tokens: int, block_size: int):
    """Candidates laid out in sequences of pack_tokens, each starting on a block boundary.

    Every candidate starts with EOT, so the model's document mask keeps them apart, and on a block
    boundary its sliding windows cover what they would at position 0. Yields (tokens, [(index, start)]).
    """
    layout, used = [], 0
    for index, row in enumerate(rows):
        size = -(-len(row.tokens) // block_size) * block_size
        if layout and used + size > pack_tokens:
            yield layout, used
            layout, used = [], 0
        layout.append((index, used))
        used += size
    if layout:
        yield layout, used


@torch.no_grad()
def ending_losses(model, rows: list[Candidate], window: Tensor, pack_tokens: int,
                  show_progress: bool = False) -> list[Tensor]:
    """Per-token losses (fp32) of each candidate's ending, in order (a progress bar on a terminal if asked)."""
    device = model.embed.weight.device
    out: list[Tensor | None] = [None] * len(rows)
    packs = progress_bar(candidate_packs(rows, pack_tokens, model.block_size), "HellaSwag", show_progress, "pack")
    for layout, used in packs:
        sequence = torch.full((used,), model.eot_token, dtype=torch.int64)
        for index, start in layout:
            sequence[start:start + len(rows[index].tokens)] = torch.tensor(rows[index].tokens)
        sequence = sequence.to(device)
        logits = model.softcapped(model.logits(sequence, window)[0])
        losses = F.cross_entropy(logits[:-1], sequence[1:], reduction="none")  # losses[p]: token p + 1
        for index, start in layout:
            row = rows[index]
            out[index] = losses[start + row.ending_start - 1:start + len(row.tokens) - 1]
    return out


@dataclass
class HellaSwagScore:
    examples: int
    correct: int  # acc: lowest summed ending loss
    correct_norm: int  # acc_norm: lowest mean ending loss
    predictions: list[tuple[int, int]]  # (acc choice, acc_norm choice) per example

    @property
    def acc(self) -> float:
        return self.correct / max(self.examples, 1)

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / max(self.examples, 1)


def hellaswag_score(model, items: list[tuple[list[Candidate], int]], windows: tuple[int, int],
                    pack_tokens: int = HELLASWAG_PACK_TOKENS, show_progress: bool = False) -> HellaSwagScore:
    """acc and acc_norm over tokenized examples (ties go to the first ending)."""
    pack_tokens = min(pack_tokens, model.context_len)
    window = model.window(windows)
    losses = ending_losses(model, [row for rows, _ in items for row in rows], window, pack_tokens, show_progress)
    predictions, correct, correct_norm = [], 0, 0
    for i, (_, label) in enumerate(items):
        mine = losses[4 * i:4 * i + 4]
        sums, means = torch.stack([l.sum() for l in mine]), torch.stack([l.mean() for l in mine])
        choice = (int(sums.argmin()), int(means.argmin()))
        predictions.append(choice)
        correct += choice[0] == label
        correct_norm += choice[1] == label
    return HellaSwagScore(len(items), correct, correct_norm, predictions)


@torch.no_grad()
def hellaswag_accuracy(model, items: list, windows: tuple[int, int], place) -> tuple[float, float, int]:
    """(acc, acc_norm, examples) over every rank's share (place: train_gpt's Place), the counts summed like the
    validation losses."""
    model.eval()
    result = hellaswag_score(model, items, windows, show_progress=place.is_master)
    counts = torch.tensor([result.correct, result.correct_norm, result.examples], dtype=torch.float64,
                          device=place.device)
    if place.world_size > 1:
        dist.all_reduce(counts)
    model.train()
    correct, correct_norm, n = counts.tolist()
    return correct / n, correct_norm / n, int(n)


def score_during_training(model, items: list, windows: tuple[int, int], place, step: int,
                          total: int) -> tuple[list, str]:
    """--hellaswag_every at a step: the summary curve's point [step, acc, acc_norm, examples] and the run log's line
    (place: train_gpt's Place; every rank scores its share)."""
    started = time.perf_counter()
    acc, acc_norm, n = hellaswag_accuracy(model, items, windows, place)
    return [step, acc, acc_norm, n], progress_line(step, total, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm,
                                                   hellaswag_examples=n,
                                                   hellaswag_time=1000 * (time.perf_counter() - started))


def prepare_downstream(sample_at_end: int, hellaswag_every: int, hellaswag_data: str, place,
                       context_len: int) -> list | None:
    """What --hellaswag_every and --sample_at_end need (the tokenizer, the HellaSwag file), loaded before training
    so that a missing piece stops the run at start-up. Returns this rank's share of the tokenized HellaSwag
    examples (None without --hellaswag_every)."""
    if sample_at_end > 0:
        gpt2_tokenizer()
    if hellaswag_every <= 0:
        return None
    items, _ = load_hellaswag(hellaswag_data, min(HELLASWAG_PACK_TOKENS, context_len))
    return items[place.rank::place.world_size]


def log_samples(model, n: int, windows: tuple[int, int], seed: int, log) -> list[str]:
    """--sample_at_end: n short samples from the final model, one JSON-quoted line each in the run log."""
    model.eval()
    texts = end_of_run_samples(model, n, windows, seed)
    model.train()
    for i, text in enumerate(texts):
        log.write(f"sample {i + 1}/{len(texts)}: {json.dumps(text)}")
    return texts
