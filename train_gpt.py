"""GPT-2 speedrun trainer: one file, any number of ranks, CUDA or CPU.

Trains a GPT-2-small-class model on pre-tokenized FineWeb shards to <= 3.28
validation loss, following the 2025-01-26 NanoGPT speedrun recipe: Muon for
hidden matrices, Adam for the rest, value embeddings, U-net skips, long/short
sliding-window attention over documents and an FP8 LM head. Gradients reach
the optimizers through a reduce-scatter loop (each rank updates its share and
the updates are all-gathered), this trainer's own; the record all-reduces.
--preset=medium is track 2: a GPT-2-medium-class model to <= 2.92.

    torchrun --standalone --nproc_per_node=8 train_gpt.py          # speedrun preset on GPUs
    python train_gpt.py                                            # cpu preset, bundled sample
    python train_gpt.py --preset=cpu --num_iterations=20 --seed=1  # any hyperparameter as --name=value
    torchrun --standalone --nproc_per_node=8 train_gpt.py --recipe=v2  # the later records' techniques

--recipe=reference (the default) keeps the 2025-01-26 math bit for bit; --recipe=v2 switches on later
records' techniques, each declared once in TECHNIQUES and each its own hyperparameter, so that any one can be
switched off.

Sections, in order: configuration, the speedrun's math (the attention windows, the model, the optimizers, the
gradient's path between ranks, the schedules, the data), then the machinery around it (the techniques of recipe v2
and track 2, flag validation, distributed setup and device choices), the training loop and the way out. What
is not the speedrun lives beside this file, which imports it and embeds its source in every run log: flags.py (the
command line), runlog.py (the run's records), checkpoints.py, evaluation.py (samples, HellaSwag) and lifecycle.py
(torch releases, signals, the end of the process group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import platform
import signal
import sys
import threading
import time
import typing
from dataclasses import dataclass, fields
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

# flags.py imports no torch: its handler is in place before the seconds that numpy and torch take to import.
from flags import (ANY_BOOL, ANY_TEXT, BETA, EXIT_OK, EXIT_PEER_LOST, EXIT_RUN_FAILED, EXIT_USAGE, LR,  # noqa: F401
                   NON_EMPTY, OPTIONAL_BETA, PLAIN_NAME, UNIT, Rule, RunFailed, UsageError, as_flags,
                   exit_on_signal_while_importing, field_types, flag, flag_text, help_lines, integer, number, one_of,
                   parse_overrides, stopped_before_training)

if __name__ == "__main__":  # a signal during the imports below ends in one line, not a 40-line traceback
    signal.signal(signal.SIGINT, exit_on_signal_while_importing)
    signal.signal(signal.SIGTERM, exit_on_signal_while_importing)

import numpy as np

# The 2025-01 record's allocator setting, before torch starts CUDA (a user's own setting wins): training
# (48K tokens) and validation (262K) graphs alternate, and fixed-size segments would fragment between them.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lifecycle import (TORCH_API, Interrupted, StopSignal, check_torch_install, device_notes, end_distributed,
                       is_collective_failure, keep_freed_host_memory)
from checkpoints import (Checkpoints, FiniteWatch, FlatShard, check_same_tensors, choose_checkpoint,
                         claim_run_folder, clean_stale_staging, dcp, gather_objects, local_part, lock_run_log,
                         read_checkpoint_meta, segment, training_state)
from runlog import (ENERGY_PHASES, Clock, EnergyMeter, Metrics, RecompileWatch, RunFolder, RunLog,
                    device_name, energy_line, environment_lines, git_commit, git_dirty, make_profiler, peak_memory_mib,
                    peak_tflops, progress_bar, progress_line, recorded_validations, report_card, run_curve,
                    sources_sha256, target_among, trainer_sources, write_header, write_report, write_summary)

REPO_DIR = Path(__file__).resolve().parent
EOT_TOKEN = 50256  # <|endoftext|>: every document starts with it
BLOCK_SIZE = 128  # attention mask granularity and window unit, in tokens


# -----------------------------------------------------------------------------
# Configuration

@dataclass
class Hyperparameters:
    """Every knob of a run. The defaults are the `speedrun` preset: the 2025-01-26 record of the NanoGPT
    speedrun ("R" below: records/track_1_short/2025-01-26_BatchSize of modded-nanogpt), whose values
    tests/test_config.py pins."""
    preset: str = flag("auto", "speedrun | cpu | medium; auto picks speedrun when CUDA is present, cpu otherwise",
                       group="general")
    recipe: str = flag("auto", "reference (R, bit for bit) | v2: the later records' techniques (TECHNIQUES) | "
                               "record: record #89 (f411b3d3) value for value, speedrun and cpu presets; auto: "
                               "the preset's own (DEFAULT_RECIPES: record on speedrun, the GPU default)")
    seed: int = flag(0, "model initialisation (data order is fixed by the shards)")
    train_files: str = flag("data/fineweb10B/fineweb_train_*.bin", "", group="data")
    val_files: str = flag("data/fineweb10B/fineweb_val_*.bin", "")
    val_tokens: int = flag(10_485_760, "R: the fixed validation budget every speedrun record is scored on")
    train_cycle: bool = flag(False, "allow more than one pass over the training shards")
    bos_align: bool = flag(False, "start every training sequence at a document start")
    doc_len_cap: int = flag(0, "2025-09-03_FA3: pack documents cut to this many tokens (the rest dropped); 0: off")
    stage_doc_len_caps: str = flag("", "record #89, T:1980-1987, T:1752-1754: each batch stage's document cap "
                                       "('896,2048,2048'); empty: doc_len_cap throughout")
    batch_tokens: int = flag(8 * 48 * 1024, "R: 8 GPUs x 48K tokens per optimizer step, fixed for any world size",
                                            group="batch: one flat sequence of seq_len tokens per rank per micro-step")
    seq_len: int = flag(48 * 1024, "R: cut from 64K to 48K per GPU (critical batch size, arXiv 2410.21676)")
    batch_schedule: str = flag("", "2025-11-29_BatchSizeSchedule: equal-length stages, fractions of batch_tokens "
                                   "('1/3,2/3,1': the record's 131K -> 262K -> 393K); empty: batch_tokens throughout")
    batch_lr_exponent: float = flag(0.6, "same record: a stage's lrs are scaled by (its tokens / batch_tokens) ** "
                                         "0.6")
    batch_sequences: int = flag(0, "track 2, 2025-12-31_BulkSmallTrackTransfer: every step is this many packed "
                                   "sequences of (stage tokens / N) each, seq_len the longest (M L1351, L1718: one "
                                   "buffer per GPU); 0: seq_len sequences, micro-steps grow with the stage")
    val_seq_len: int = flag(4 * 64 * 1024, "R: 256K-token val sequences cut fewer documents (~0.0015 lower val loss)")
    num_iterations: int = flag(1770, "R", group="schedule")
    cooldown_frac: float = flag(0.4, "R: lr decays linearly over this last fraction of training ...")
    lr_final_frac: float = flag(0.1, "R: ... down to this fraction of the base lr")
    val_every: int = flag(125, "R")
    window_final_tokens: int = flag(1728, "R: window grows linearly to next_multiple(1728 * step / 1770, 128) tokens")
    window_stages: str = flag("", "track 2, 2025-12-31_BulkSmallTrackTransfer: the long window in blocks at each of "
                                  "equal stages of training ('3,7,11,...,23'); empty: the linear growth above")
    extension_steps: int = flag(0, "track 2, 2025-12-31_BulkSmallTrackTransfer: steps after the schedules' end (M "
                                   "L1627: 40) at the final lr, batch and windows; every schedule runs on "
                                   "num_iterations - extension_steps")
    stage_lr_shares: str = flag("", "same record: each batch stage's share of the peak lrs (M get_lr / 2: "
                                    "'0.5,0.76,0.865,1,...'), a stage from step k/n of the schedule on (strict, "
                                    "M L1429-1436); empty: (stage tokens / batch_tokens) ** batch_lr_exponent")
    muon_momentum_cooldown_steps: int = flag(0, "same record: Muon's momentum falls linearly back to "
                                                "muon_momentum_start over the last N steps (M get_muon_momentum: 50)")
    yarn_max_window: int = flag(0, "same record: YaRN (M Yarn.apply) rescales rotary and the attention scale at each "
                                   "long-window stage change to at most this many blocks (13); 0: off")
    final_window_blocks: int = flag(0, "same record: the long window of the last validation alone "
                                       "(M ws_validate_post_yarn_ext: 27); 0: the schedule's")
    token_exact_windows: bool = flag(False, "same record: FA3's window, key j seen by query q iff q - 128 * w <= j "
                                            "<= q (M L982-984); False: whole blocks, floor(q/128) - floor(j/128) < w")
    rounded_stages: bool = flag(False, "record #89, T:1943, T:1956-1967: stage k of n starts at round(k * S / n) "
                                       "for the batch, lr, windows and YaRN alike (423, 847 of 1270), the lr's stage "
                                       "the batch's; false: ceil(k * S / n), track 2's lr a step later")
    extension_window_blocks: int = flag(0, "record #89, T:1987: the long window of the extension steps (13), a YaRN "
                                           "change of its own; 0: the last stage's")
    stage_share_cooldown: bool = flag(False, "record #89, T:1968-1976 (get_lr): the cooldown blends the stage's lr "
                                             "share into lr_final_frac of the base lrs, share (1 - tau) + final tau, "
                                             "from step int((1 - cooldown_frac) S); false: cooldown x share")
    sliding_window: bool = flag(True, "False: full causal attention within documents (ablation)")
    vocab_size: int = flag(50257, "GPT-2's BPE vocabulary (the head pads it to 50304, a multiple of 128)",
                                  group="model (R: 12 x 768, 6 heads of 128; GPT-2 vocabulary, head padded to 50304)")
    n_layer: int = flag(12, "R: GPT-2 small's depth")
    model_dim: int = flag(768, "R: GPT-2 small's width")
    n_head: int = flag(6, "R: 6 heads of 128 (GPT-2 small has 12 of 64)")
    head_dim: int = flag(128, "R: wide heads, half of each rotated by rotary")
    attn_scale: float = flag(0.12, "R: fixed attention temperature instead of 1/sqrt(128)")
    logit_softcap: float = flag(30.0, "R: 30 * sigmoid(logits / 7.5); 0 turns the softcap (and the rescale below) "
                                      "off")
    value_embeds: bool = flag(True, "R: three value-embedding tables (value residual, arXiv 2410.17897)")
    unet_skips: bool = flag(True, "R: encoder layers feed the mirrored decoder layers with learned weights")
    zero_init: bool = flag(True, "R: zero-init output projections and the head (initial loss ln(50304))")
    qk_norm: bool = flag(True, "R: rms_norm of queries and keys before rotary")
    mlp_act: str = flag("relu2", "R: relu(x)^2 (Primer, arXiv 2109.08668) | gelu")
    bigram_vocab_size: int = flag(0, "2026-01-19_BigramHashEmbedding: rows of a hashed (previous, current) token "
                                     "table added to every layer's input; 0: off",
                                     group="model, recipe v2 (each off by default, which is the reference's math)")
    bigram_dim: int = flag(0, "2026-05-20_BigramsSignTrick: the table's width, added to the stream's first dims; 0: "
                              "model_dim")
    bigram_sign: bool = flag(False, "same record: a second hash picks a fixed random +-1 vector per bigram, so rows "
                                    "shared by several bigrams interfere less")
    smear: bool = flag(False, "2025-09-18_Smear: a gated share of the previous token's embedding, within the "
                              "document")
    attn_gate: bool = flag(False, "2025-08-23_SparseAttnGate: a sigmoid gate per head on the attention output")
    ve_gates: bool = flag(False, "2025-12-29_VeSkipGates: a sigmoid gate per head on the value embeddings")
    skip_gates: bool = flag(False, "same record: a 2 * sigmoid gate on each U-net skip, read from the embedding x0")
    backout: bool = flag(False, "2025-10-04_Backout: subtract a learned share of the stream after 3/4 of the layers "
                                "before the head")
    key_offset: bool = flag(False, "2025-12-14_PartialKeyOffset: long-window keys' stationary rotary dims come from "
                                   "the previous token")
    paired_heads: bool = flag(False, "2026-01-07_PairedHeadAttention: head pairs attend as one head over interleaved"
                                     " positions")
    value_embed_tables: int = flag(3, "R: three value-embedding tables, read by the first and the last three layers "
                                      "(a shallower model: one per encoder layer); track 2, "
                                      "2025-08-28_Medium_NewValemb: five")
    attention_free_layer: bool = flag(True, "R: the layer after the middle (7 of 12) has an MLP and no attention; "
                                            "track 2, 2025-12-31_BulkSmallTrackTransfer: every layer attends")
    pad_embed_tables: bool = flag(False, "track 2, 2025-12-31_BulkSmallTrackTransfer: the token and value-embedding "
                                         "tables have the head's padded rows (M L1046, L1061); rows past the "
                                         "vocabulary are never read")
    skip_connections: str = flag("", "same record: U-net skips as 'a>b,...', the stream after block a added before "
                                     "block b (M L1127-1128: 6>9,4>10,2>11); empty: each encoder block to its mirror")
    skip_sigmoid: bool = flag(False, "same record: a skip's weight is sigmoid(lambda), lambda from -1.5 (M L1096, "
                                     "L1179); false: the weight itself, from 1")
    gate_dims: int = flag(12, "the stream's first dims every gate reads (attention, value-embedding, skip, smear): "
                              "12 (2025-08-23_SparseAttnGate, GATE_DIMS); track 2: 16 (M L1048, L1053)")
    second_embed: bool = flag(False, "track 2 (M L1079-1080, L1164, L1183-1185): a second token embedding, normed, "
                                     "that every layer adds at a learned weight from 0")
    residual_lambda_init: float = flag(1.0, "the stream's weight in each layer's mix at init (M L1092: 1.05)")
    attn_output_lambda: bool = flag(False, "M L988, L1093: a learned scalar (from 1) on every attention's output "
                                           "projection; the value embedding then enters v unscaled (M L977)")
    cross_document_shifts: bool = flag(False, "M L971-974, L1159-1162, L1213-1219: smear, key offset and the "
                                              "multi-token targets read across document boundaries (only the "
                                              "sequence's ends stop them); record #89 T:1786-1793: the bigram "
                                              "hashes too")
    long_window_blocks: str = flag("", "record #89, T:1494-1496: the long-window blocks (3,10), whose keys take the "
                                       "key offset; set: the layout is the *_blocks lists, not LayerRoles.for_depth's")
    attention_free_blocks: str = flag("", "record #89, T:1494, T:1592: blocks with an MLP and no attention (6)")
    paired_head_blocks: str = flag("", "record #89, T:1252: blocks whose head pairs attend as one (0,2,5,9)")
    value_embed_blocks: str = flag("", "record #89, T:1543: blocks that read a value table, the j-th table j "
                                       "(1,2,8,9,10)")
    ve_gate_reads_value: bool = flag(False, "record #89, T:1613-1614: the value-embedding gate reads [a[:6], ve[:6]] "
                                            "(half the gate dims of each), not a[:12]")
    value_embed_init_std: float = flag(0.0, "record #89, T:1261: the value tables start N(0, std) (0.01); 0: N(0, 1), "
                                            "or zeros with --value_embed_zero_init")
    attn_proj_uniform_init: bool = flag(False, "record #89, T:1288-1293: attention's output projection starts uniform "
                                               "like Q, K, V (vo_bank), not zero")
    sublayer_lambdas: bool = flag(False, "record #89, T:1334-1338, T:1638, T:1665: x <- r x + p f(x) per sublayer, "
                                         "r = sqrt(1.1), p = 1, both learned per block")
    attention_cache_block: int = flag(0, "record #89, T:1598: the blocks after this one attend over rms of the "
                                         "stream after it (7); 0: each block over its own stream")
    mudd_gate_block: int = flag(0, "record #89, T:1436-1484, T:1551-1589: per-token gates (XSA, output gates, "
                                   "x0 and bigram injections, skips, DC) from x0 and the stream entering this block "
                                   "(4); 0: off")
    output_gate_blocks: str = flag("", "record #89, T:1240, T:1158-1159: blocks whose heads' outputs are scaled by "
                                       "a linear MUDD gate from 0.25 (3,10)")
    xsa_blocks: str = flag("", "record #89, T:1238, T:1151-1157: blocks with gated exclusive self-attention (1,3,4,7)")
    dc_blocks: str = flag("", "record #89, T:1239, T:1142-1149: blocks with DC head composition over 112 keys (10)")
    mudd: bool = flag(False, "record #89, T:1352-1401, T:1601-1610, T:1677-1680: MUDD dense connections on the last "
                             "block and after it")
    qkv_init_gain: float = flag(0.5, "R: Q, K, V uniform with std gain / sqrt(model_dim); M L935-936: 1")
    head_init_std: float = flag(0.0, "M L1072-1073: the head starts N(0, std) (0.005); 0: --zero_init decides")
    value_embed_zero_init: bool = flag(False, "M L1062-1063: the value-embedding tables start at zero")
    bf16_rotary: bool = flag(False, "M L881-886, L902-911 (record #89: T:1002-1017): rotary's cos/sin tables and the "
                                    "rotation in bf16")
    bf16_train_logits: bool = flag(False, "M L1204-1221: the training loss's softcap, logsumexp and cross-entropy "
                                          "on bf16 logits (validation stays fp32, M L1196-1202)")
    bf16_val_softcap: bool = flag(False, "record #89, T:1689-1691: validation squashes the bf16 logits in bf16, "
                                         "then takes the fp32 cross-entropy; false: the softcap in fp32")
    loss_sum: bool = flag(False, "M L1213-1221: the training loss is summed over the sequence's tokens, not "
                                 "averaged (validation: the mean); the logged train loss is per token")
    short_window_cap: int = flag(0, "track 2, 2025-12-31_BulkSmallTrackTransfer: the short window is at most this "
                                    "many blocks (11); 0: half the long window, as R")
    logit_offset: float = flag(0.0, "2025-12-26_LogitRescale: softcap * sigmoid((logits + offset) / "
                                    "logit_temperature)")
    logit_temperature: float = flag(7.5, "R: 30 * sigmoid(logits / 7.5)")
    mtp_tokens: int = flag(1, "2025-12-22_MultiTokenPrediction: the training loss also predicts the next N-1 tokens "
                              "after the next; 1: off")
    mtp_frac: float = flag(1.0, "same record: the fraction of training its phases take (track 2, "
                                "2025-12-31_BulkSmallTrackTransfer: 0.25), next-token only after it")
    prefix_loss_weight: float = flag(0.0, "record #89, T:1957, T:1981-1983, K:1066-1090: the training loss adds this "
                                          "weight times the cross-entropy of the next token's longest prefix token "
                                          "(data/prefix_tokens.py), decaying by --loss_weights_by_stage; 0: off")
    loss_weights_by_stage: bool = flag(False, "record #89, T:1950-1958, T:1980-1988: the MTP (and prefix) weights "
                                              "follow the batch stages (k, fraction t), not equal phases of mtp_frac")
    muon: bool = flag(True, "R: Muon for hidden matrices; False: Adam for them too (ablation)", group="optimizers")
    muon_lr: float = flag(0.05, "R")
    muon_momentum: float = flag(0.95, "R: Nesterov momentum, warmed up from muon_momentum_start ...")
    muon_momentum_start: float = flag(0.85, "R")
    muon_momentum_warmup_steps: int = flag(300, "R: ... over these steps")
    ns_steps: int = flag(5, "R: quintic Newton-Schulz iterations")
    polar_express: bool = flag(False, "2025-09-29_PolarExpress: a minimax-optimal quintic per iteration (at most 5)")
    normuon: bool = flag(False, "2025-10-24_NorMuon: normalise the orthogonalised update per neuron by its 2nd "
                                "moment")
    normuon_beta2: float = flag(0.95, "same record")
    cautious_wd: bool = flag(False, "2025-11-10_CautiousWD: decay only where the update and the weight agree in sign")
    muon_cautious_wd: float = flag(1.2, "same record; applied as lr * wd, so it follows the lr schedule")
    adam_cautious_wd: float = flag(0.005, "2025-12-18_CautiousWDAdam: head and embeddings (not the scalars)")
    record_muon_shapes: bool = flag(False, "track 2, 2025-12-31_BulkSmallTrackTransfer: Muon's lr (and decay) "
                                           "multiplier from M's stored shapes (M L633-649): Q, K, V, O x2, c_fc x2, "
                                           "MLP c_proj x4; record #89 (T:509-522, with muon_qk_head_pairs): Q, K, V, "
                                           "O x1, c_fc x2, c_proj x4")
    muon_qk_head_pairs: bool = flag(False, "record #89, 2026-04-08_PairedHeadMuon (T:1272-1285, T:510): Muon "
                                           "orthogonalises Q and K per head pair (2 * head_dim x dim, NorMuon per "
                                           "pair), V and O whole; with record_muon_shapes their lr from those shapes")
    muon_gates: bool = flag(False, "same record: the attention and value-embedding gates train in Muon (per-row "
                                   "NorMuon, cautious decay), not the scalar Adam (M L949-957)")
    muon_gate_lr_mul: float = flag(0.1, "same record: the gates' share of muon_lr (M L951, L957)")
    adam_every: int = flag(1, "same record: the Adams step every Nth step (M: 2, odd steps) on the summed gradients"
                              " of the N steps (M L1506-1507, L1575-1594)")
    adam_master: bool = flag(True, "false: M's DistAdam: head, embeddings and gates bf16, updated in place with no "
                                   "fp32 master, bf16 moments, M's eps form and strict cautious mask (M L700-830)")
    adam_moments_fp32: bool = flag(False, "record #89, T:554-555: that Adam (--adam_master=false) keeps its moments "
                                          "in fp32; false: bf16, as track 2's")
    token_embed_lr: float | None = flag(None, "same record: the token embedding's lr (M: 0.008, L1076); none: "
                                              "embed_lr")
    head_embed_wd_mul: float = flag(1.0, "same record: the head's and token embedding's share of adam_cautious_wd "
                                         "(M: 150, L1107-1113)")
    value_embed_wd_mul: float = flag(1.0, "same record: the value embeddings' (and embed2's) share of "
                                          "adam_cautious_wd (M: 5, L1106, L1111)")
    x0_lambda_lr: float | None = flag(None, "same record: the x0 (and x02) lambdas apart, in the main Adam at this lr"
                                            " with no decay (M: 0.04, L1083-1086); none: in the scalars")
    gate_adam_lr: float | None = flag(None, "same record: the smear and skip gates in the main Adam at this lr, no "
                                            "decay (M: 8e-5, L1048-1057); none: gate_lrs' share of scalar_lr")
    tied_embed_steps: int = flag(0, "same record: the input embedding reads the head's weight through this step's "
                                    "update, then takes its weight and Adam state (M: 785, L770-779, L1583-1585)")
    table_adam_beta1: float | None = flag(None, "record #89, T:2034, T:2037: the value-embedding and bigram tables' "
                                                "Adam beta1 (0.75); none: adam_beta1")
    bigram_wd_mul: float = flag(1.0, "record #89, T:2034: the bigram table's share of adam_cautious_wd (5)")
    gate_scalar_betas: bool = flag(False, "record #89, T:2031-2032: the gates in the main Adam (gate_adam_lr) take "
                                          "the scalars' betas (0.9, 0.99); false: adam_beta1, adam_beta2")
    ve_gate_lr: float | None = flag(None, "record #89, T:2032: the value-embedding gates' lr (0.008), decayed by "
                                          "adam_cautious_wd (wd_mul 1); none: as the other gates, no decay")
    scalar_adam_beta1: float | None = flag(None, "2025-12-21_SmoothedScalars: 0.9 for the scalars; none: adam_beta1")
    scalar_adam_beta2: float | None = flag(None, "same record: 0.99; none: adam_beta2")
    adam_beta1: float = flag(0.8, "R")
    adam_beta2: float = flag(0.95, "R")
    adam_eps: float = flag(1e-10, "R")
    head_lr: float = flag(0.008, "R")
    embed_lr: float = flag(0.6, "R: token and value embeddings")
    scalar_lr: float = flag(0.04, "R: lambdas and skip weights")
    matrix_adam_lr: float = flag(0.001, "hidden matrices' lr when muon is off (best of a sweep on the cpu preset)")
    weight_decay: float = flag(0.0, "R: none; decoupled, on matrices updated by Adam")
    dtype: str = flag("bf16", "activations and embeddings: bf16 | fp32", group="systems")
    fp8_head: bool = flag(True, "R: FP8 LM head; used only where the GPU supports FP8 (compute capability >= 8.9)")
    fp8_mlp: bool = flag(False, "record #89, T:1403-1434, K:443-566: the MLP's training forward in FP8 (up: current "
                                "scaling, down: delayed scales); used only where the GPU supports FP8")
    fp8_head_scales: str = flag("reference", "the FP8 head's x, W, g scales: reference (2, 2^9, 2^19) | record (record "
                                             "#89, T:1225: 448/100, 448/1.6, 448/0.75 on the summed loss)")
    attention: str = flag("auto", "flex | banded; auto: flex on CUDA, banded (SDPA over key chunks) on CPU")
    compile: str = flag("auto", "model | loss (softcap + cross-entropy only) | off; auto: model on CUDA, loss on CPU")
    coordinate_descent_tuning: bool = flag(True, "R's inductor setting with --compile=model: faster kernels, longer "
                                                 "compile")
    warmup_steps: int = flag(10, "untimed steps to compile kernels; state is restored afterwards")
    collective_timeout_s: int = flag(600, "a dead rank stops the others after this long")
    log_dir: str = flag("logs", "", group="logging and accounting")
    run_id: str = flag("", "default: time, preset and a random suffix")
    log_train_loss: bool = flag(False, "a host sync per step; off for the timed speedrun")
    profile_steps: int = flag(0, "record this many steps with torch.profiler (Chrome trace per rank)")
    target_val_loss: float = flag(3.28, "R's rule: a record is the validation loss reached; the log, summary, metrics "
                                        "and report card mark the step, time, tokens and energy at which a "
                                        "validation first reaches this")
    stop_at_target: bool = flag(False, "end the run at the first validation at or below target_val_loss (off: the "
                                       "records score the fixed step count)")
    tensorboard: bool = flag(False, "also write the metrics as TensorBoard scalars (needs pip install tensorboard)")
    usd_per_gpu_hour: float = flag(0.0, "price of a GPU-hour for the report card's cost line; 0: not priced")
    hellaswag_every: int = flag(0, "HellaSwag acc/acc_norm every N steps and at the end, all ranks' shares summed",
                                   group="downstream checks (tools/): off by default, outside the timed region")
    hellaswag_data: str = flag("", "a local HellaSwag JSONL; empty: the pinned validation file, downloaded once")
    sample_at_end: int = flag(0, "log this many short samples from the final model")
    checkpoint_every: int = flag(0, "0: only with checkpoint_final", group="checkpoints")
    checkpoint_final: bool = flag(False, "")
    checkpoint_keep: int = flag(2, "")
    resume: str = flag("", "a checkpoint folder; 'latest' (newest under log_dir); 'auto' (this run_id's newest, else"
                           " fresh)")
    stop_after: int = flag(0, "stop (with a checkpoint) after this step; for preemption tests and resume drills")


PRESETS = {
    "speedrun": dict(),  # the dataclass defaults are the 8xH100 reference recipe
    "cpu": dict(
        train_files="data/sample/sotu_train_*.bin",
        val_files="data/sample/sotu_val_*.bin",
        val_tokens=16384,
        batch_tokens=2048,
        seq_len=1024,
        val_seq_len=2048,
        num_iterations=60,
        val_every=20,
        window_final_tokens=1024,
        n_layer=6,
        model_dim=256,
        n_head=4,
        head_dim=64,
        warmup_steps=1,
        log_train_loss=True,
        target_val_loss=5.7,  # the committed cpu record reaches it at step 40 of 60 (5.677)
    ),
    # Track 2, GPT-2-medium-class to 2.92: the record of modded-nanogpt PR #188 (2025-12-31, records/track_2_medium/
    # 2025-12-31_BulkSmallTrackTransfer; "M" below: its train_gpt_medium.py at d7011639), value for value
    # (docs/track2-record-fidelity.md). Every lr is M's at its final batch: M's base lr times its peak multiplier
    # 2.0 (get_lr), the batch stages' shares scaling down from there.
    "medium": dict(
        n_layer=16, model_dim=1024, n_head=8, head_dim=128,  # M L1688-1695
        value_embed_tables=5, attention_free_layer=False,  # M: tables at layers 0-4 and 11-15; all 16 layers attend
        batch_tokens=524288, batch_schedule="1/4,1/2,3/4,1,1,1,1,1,1,1,1,1",  # M L1617-1620: 12 equal stages
        batch_sequences=8,  # M L1351, L1718: one packed buffer of stage/8 tokens per GPU on its 8 GPUs
        seq_len=64 * 1024,  # the last stage's buffer, 524288 / 8 (sizes the rotary tables); 16K to 64K per stage
        num_iterations=4740, cooldown_frac=0.7, lr_final_frac=0.05,  # M: 4700 + 40 steps; lr 2.0 -> 0.1 (L1420-1435)
        val_every=250,  # M L1632
        window_stages="3,7,11,13,15,17,19,21,23,23,23,23", short_window_cap=11,  # M L1636-1638, get_ws
        extension_steps=40, muon_momentum_cooldown_steps=50,  # M L1625-1627 (4700 + 40), get_muon_momentum
        stage_lr_shares="0.5,0.76,0.865,1,1,1,1,1,1,1,1,1",  # M get_lr's lr_max / 2.0 per batch stage (L1429-1436)
        attn_scale=0.1, yarn_max_window=13,  # M L889 (Yarn.attn_scale), L1552-1553 (YaRN up to 13 blocks)
        final_window_blocks=27, token_exact_windows=True,  # M L1646 (ws_validate_post_yarn_ext), L982-984 (FA3)
        bos_align=True, doc_len_cap=4096,  # M L1622: documents cut at 4,096 tokens
        muon_lr=0.03, polar_express=True, normuon=True, normuon_beta2=0.95,  # M L1486: NorMuon lr 0.015 x 2.0
        cautious_wd=True, muon_cautious_wd=1.2, adam_cautious_wd=0.005,  # M L1484-1486
        head_lr=0.008, embed_lr=0.6, scalar_lr=0.08, adam_eps=1e-8,  # M: 0.004 x 2.0; value embeds x 75; scalars x 5
        scalar_adam_beta1=0.9, scalar_adam_beta2=0.99,  # M L1485
        record_muon_shapes=True, muon_gates=True, muon_gate_lr_mul=0.1,  # M L633-649, L940-957, L996-1001
        adam_every=2, adam_master=False,  # M L1506-1507, L1575-1594: odd steps; L700-830: bf16, in place, no master
        token_embed_lr=0.008, head_embed_wd_mul=150.0, value_embed_wd_mul=5.0,  # M L1076, L1104-1113
        x0_lambda_lr=0.04, gate_adam_lr=8e-5,  # M L1048-1057 (0.004 x 0.01 x 2), L1083-1086 (0.004 x 5 x 2)
        tied_embed_steps=785,  # M L1495: ceil(4700 * 2/3/4) | 1
        smear=True, attn_gate=True, ve_gates=True, skip_gates=True, backout=True, key_offset=True,
        pad_embed_tables=True, gate_dims=16, second_embed=True,  # M L1046 (tables of 50,304), L1048, L1079-1080
        skip_connections="6>9,4>10,2>11", skip_sigmoid=True,  # M L1127-1128, L1096 (lambda -1.5), L1179
        residual_lambda_init=1.05, attn_output_lambda=True,  # M L1092; L988, L1093
        cross_document_shifts=True,  # M L971-974 (key offset), L1159-1162 (smear), L1213-1219 (MTP targets)
        qkv_init_gain=1.0, head_init_std=0.005, value_embed_zero_init=True,  # M L935-936, L1072-1073, L1062-1063
        bf16_rotary=True, bf16_train_logits=True, loss_sum=True,  # M L881-886, L1204-1221 (summed, bf16 logits)
        logit_softcap=23.0, logit_offset=5.0, mtp_tokens=3, mtp_frac=0.25,  # M L1203; MTP in the first quarter
        fp8_head=False, coordinate_descent_tuning=False,  # M L845 (FP8 head off), L28 (commented out)
        target_val_loss=2.92,  # the track's target
    ),
}

def help_text(overrides: dict[str, object]) -> str:
    """What --help prints: every flag in its group with its value under the preset and recipe on the command line
    (the speedrun preset's reference recipe by default), the other presets' values where they differ, and what
    it does."""
    preset = overrides.get("preset", "speedrun")
    chosen = resolve_hyperparameters({**overrides, "preset": preset if preset != "auto" else "speedrun"}, False)
    others = {name: resolve_hyperparameters({**overrides, "preset": name}, False) for name in PRESETS
              if name != chosen.preset and recipe_fits(overrides.get("recipe", Hyperparameters.recipe), name)}
    return "\n".join([
        "usage: torchrun --nproc_per_node=N train_gpt.py [--name=value ...]   (one process: python train_gpt.py)",
        f"Every flag is --name=value (a bare --name sets a switch true). Values shown: the {chosen.preset} preset, "
        f"recipe {chosen.recipe} (--preset=NAME --recipe=NAME --help shows another); [name: x] is another "
        "preset's value; (from: ...) is where the recipe's value comes from.",
        *help_lines(chosen, others, same=("preset",), sources=RECIPE_SOURCES[chosen.recipe][chosen.preset])])


def recipe_fits(recipe: str, preset: str) -> bool:
    """Whether a recipe has values for a preset: record #89's are the short track's, not the medium preset's
    (auto: each preset's own)."""
    return not (recipe == "record" and preset == "medium")


def recipe_values(preset: str, recipe: str) -> dict[str, object]:
    """Every hyperparameter as a preset and a recipe give it, before the command line: the dataclass defaults, the
    preset's values on top, the recipe's on those."""
    return {**{f.name: f.default for f in fields(Hyperparameters)}, **PRESETS[preset], **RECIPES[recipe][preset],
            "preset": preset, "recipe": recipe}


def resolve_hyperparameters(overrides: dict[str, object], cuda_available: bool,
                            check_unused: bool = True) -> Hyperparameters:
    """The command line's values on top of its recipe's, on top of its preset's; validated (check_unused: the
    flags it sets that the run would never use too; a resumed run checks them on its checkpoint's values)."""
    preset = overrides.get("preset", "auto")
    if preset == "auto":
        preset = "speedrun" if cuda_available else "cpu"
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    recipe = overrides.get("recipe", Hyperparameters.recipe)
    if recipe == "auto":
        recipe = DEFAULT_RECIPES[preset]
    if recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")
    if not recipe_fits(recipe, preset):
        raise UsageError("--recipe=record is the short track's record #89; the medium preset is track 2's record "
                         "already: pass --preset=speedrun or --preset=cpu, or drop --recipe")
    args = Hyperparameters(**{**recipe_values(preset, recipe), **overrides, "preset": preset, "recipe": recipe})
    validate_args(args, overrides if check_unused else None)
    return args


def parse_args(argv: list[str], cuda_available: bool) -> Hyperparameters:
    """`--name=value` overrides applied on top of a preset; unknown names and bad values are refused."""
    return resolve_hyperparameters(parse_overrides(Hyperparameters, argv), cuda_available)


# What a resumed run does not take from its checkpoint: where to find it and how to name this launch, the
# one-shot flags of a launch (stop after a step, profile a few steps), and the collective timeout, which the
# process group is made with before the checkpoint is read.
PER_LAUNCH_FIELDS = ("resume", "log_dir", "run_id", "stop_after", "profile_steps", "collective_timeout_s")


def resumed_hyperparameters(recorded: dict, overrides: dict[str, object], fresh: Hyperparameters,
                            path: Path) -> tuple[Hyperparameters, list[str]]:
    """A resumed run continues the run it resumes: every hyperparameter the checkpoint recorded, except the
    per-launch ones and those the command line sets. Returns them with the run-log lines that say which values
    came from where (where the checkpoint and this command line alone would disagree)."""
    kinds = field_types(Hyperparameters)
    for name in ("preset", "recipe"):
        if name in overrides and name in recorded and overrides[name] != recorded[name]:
            raise UsageError(f"--{name}={overrides[name]} differs from checkpoint {path}'s {name} {recorded[name]}: "
                             f"a resumed run keeps its {name}; drop --{name}, or start a new run")
    check_unrecorded(recorded, overrides, path)
    carried = {}
    for name, value in recorded.items():
        if name not in kinds or name in PER_LAUNCH_FIELDS or name in overrides:
            continue  # a field this train_gpt.py no longer has, or one this launch sets itself
        if not kinds[name].holds(value):
            raise UsageError(f"checkpoint {path} records {name}={value!r}, not a {kinds[name]}: its checkpoint.json "
                             "is edited or corrupt; resume from an earlier checkpoint")
        carried[name] = float(value) if kinds[name].kind is float and value is not None else value
    args = Hyperparameters(**{**dataclasses.asdict(fresh), **carried, **overrides})
    validate_args(args, overrides)
    kept = [f"{n}={flag_text(v)}" for n, v in carried.items() if v != getattr(fresh, n)]
    changed = [f"{n}={flag_text(v)} (checkpoint: {flag_text(recorded[n])})" for n, v in overrides.items()
               if n in recorded and n not in PER_LAUNCH_FIELDS and v != recorded[n]]
    lines = [f"resume: the hyperparameters of checkpoint {path}" + (f", which differ from this command line's "
                                                                   f"defaults in {', '.join(kept)}" if kept else "")]
    if changed:
        lines.append(f"resume: changed on the command line: {', '.join(changed)}")
    return args, lines


def check_unrecorded(recorded: dict, overrides: dict[str, object], path: Path) -> None:
    """Refuses a checkpoint from an older train_gpt.py whose preset has since changed: a flag it does not record
    ran at its default, today's behaviour then, and its preset now sets the flag otherwise (the medium preset's
    record layout, say), so the run cannot go on as it began."""
    preset, recipe = recorded.get("preset"), recorded.get("recipe", "reference")  # the only recipe then
    now = {**PRESETS.get(preset, {}), **RECIPES.get(recipe, {}).get(preset, {})}
    defaults = {f.name: f.default for f in fields(Hyperparameters)}
    changed = [f"{name}={flag_text(defaults[name])} (now {flag_text(value)})" for name, value in now.items()
               if name not in recorded and name not in overrides and value != defaults[name]]
    if changed:
        raise UsageError(f"checkpoint {path} is from an older train_gpt.py, whose {preset} preset ran with "
                         f"{', '.join(changed)}: resume it with the train_gpt.py that wrote it (its sha256 is in "
                         "checkpoint.json), or start a fresh run")


def parsed_list(text: str, parse: typing.Callable[[str], typing.Any], holds: typing.Callable[[typing.Any], bool]):
    """A comma-separated flag's items, each parsed and each holding; None if the text is not such a list."""
    try:
        out = [parse(part.strip()) for part in text.split(",")]
    except (ValueError, ZeroDivisionError):
        return None
    return out if all(holds(item) for item in out) else None


def stage_fractions(text: str) -> list[Fraction] | None:
    """--batch_schedule's stages as exact fractions of batch_tokens; None if the text is not such a list."""
    return parsed_list(text, Fraction, lambda f: 0 < f <= 1)


def lr_shares(text: str) -> list[float] | None:
    """--stage_lr_shares as positive floats (the record #89's 1.52 and 1.73 exceed 1); None if the text is not such a
    list."""
    return parsed_list(text, float, lambda f: 0 < f < math.inf)


def stage_doc_caps(text: str) -> list[int] | None:
    """--stage_doc_len_caps as token counts; None if the text is not such a list."""
    return parsed_list(text, int, lambda c: c >= 1)


def scheduled_steps(args: Hyperparameters) -> int:
    """The steps every schedule runs over (the lr cooldown, batch and window stages, MTP phases, the momentum
    warm-up's clock); track 2's extension steps after them hold the schedules' final values."""
    return args.num_iterations - args.extension_steps


def stage_start(k: int, n: int, scheduled: int, rounded: bool = False) -> int:
    """The first step of stage k of n equal stages of the scheduled steps: ceil(k S / n) (a step is in stage
    floor(n step / S)); record #89 (T:1943, TrainingSchedule): round(k S / n), 423 and 847 of 1270."""
    return round(k * scheduled / n) if rounded else -(-k * scheduled // n)


def stage_of(step: int, n: int, scheduled: int, rounded: bool = False) -> int:
    """Which of n equal stages of the scheduled steps a step is in (stage_start's boundaries); the last one from the
    end of the schedule on (M get_ws: int(n * step / 4700); record #89 lookup, T:1956-1961)."""
    if not rounded:
        return min(n * step // scheduled, n - 1)
    return max(k for k in range(n) if stage_start(k, n, scheduled, True) <= step)


def scheduled_steps_text(args: Hyperparameters) -> str:
    """How a refusal names the scheduled steps: --num_iterations, less the extension where there is one."""
    if not args.extension_steps:
        return f"--num_iterations={args.num_iterations}"
    return (f"--num_iterations={args.num_iterations} less --extension_steps={args.extension_steps} "
            f"({scheduled_steps(args)} scheduled steps)")


# -----------------------------------------------------------------------------
# Attention windows: every layer's window at every step, and the masks that apply it
#
# A window is a count of BLOCK_SIZE-token blocks: a query in block i sees its document's keys in blocks i-w+1..i.
# attention_windows(step, args) is the one schedule, the (long, short) pair at a step, for every phase: training,
# validation and the warm-up (StepTensors), FLOP counts, HellaSwag and the samples (at their step), the tools
# (at the checkpoint's step, or num_iterations for the final window). layer_windows gives each layer its half of
# the pair. The masks apply a layer's window: attention_allowed is the rule, the others build it per backend.

def attention_windows(step: int, args: Hyperparameters) -> tuple[int, int]:
    """(long, short) attention windows in blocks at a step. R: the long window grows linearly to
    window_final_tokens, rounded up to whole blocks; the short-window layers see half of it. Track 2's 2025-12-31
    record: the long window steps through --window_stages over equal stages of training, the short one capped."""
    if not args.sliding_window:
        return window_pair(max(args.seq_len, args.val_seq_len) // BLOCK_SIZE)
    if args.final_window_blocks and step == args.num_iterations:  # track 2: the last validation's long window
        return window_pair(args.final_window_blocks, args.short_window_cap)
    if args.extension_window_blocks and scheduled_steps(args) <= step:  # record #89: the extension's own window
        return window_pair(args.extension_window_blocks, args.short_window_cap)
    if args.window_stages:
        stages = window_stage_blocks(args.window_stages)
        stage = stage_of(step, len(stages), scheduled_steps(args), args.rounded_stages)
        return window_pair(stages[stage], args.short_window_cap)
    tokens = max(next_multiple(args.window_final_tokens * step / args.num_iterations, BLOCK_SIZE), BLOCK_SIZE)
    return window_pair(tokens // BLOCK_SIZE, args.short_window_cap)


def long_window_changes(args: Hyperparameters) -> list[tuple[int, int, int]]:
    """(step, old, new) of every change of the staged long window during training, as YaRN sees them (the last
    validation's final_window_blocks is no change of the schedule: M applies no YaRN there)."""
    if not (args.sliding_window and args.window_stages):
        return []
    stages, scheduled = window_stage_blocks(args.window_stages), scheduled_steps(args)
    firsts = [stage_start(k, len(stages), scheduled, args.rounded_stages) for k in range(len(stages))]
    if args.extension_window_blocks and args.extension_steps:  # record #89: the extension is a stage of its own
        firsts, stages = firsts + [scheduled], stages + [args.extension_window_blocks]
    return [(first, old, new) for first, old, new in zip(firsts[1:], stages, stages[1:])
            if old != new and first < args.num_iterations]


def window_pair(long_blocks: int, short_cap: int = 0) -> tuple[int, int]:
    """A long window and its short one: half of it, at least one block, and at most short_cap blocks if set."""
    short = max(long_blocks // 2, 1)
    return long_blocks, min(short, short_cap) if short_cap else short


def window_tensor(long_blocks: int, device: torch.device | str | None = None, short_cap: int = 0) -> Tensor:
    """The model's windows input, (long, short) in blocks, for a fixed long window (the tests' shorthand)."""
    return torch.tensor(window_pair(long_blocks, short_cap), dtype=torch.int64, device=device)


MAX_EAGER_WINDOWS = 4096  # more distinct windows than this (absurd flags) are made as steps reach them


def window_pairs(args: Hyperparameters) -> set[tuple[int, int]] | None:
    """Every (long, short) window pair the schedule can reach, found stage by stage or block by block rather than
    step by step (a superset where blocks are skipped); None when there are more than MAX_EAGER_WINDOWS."""
    if not args.sliding_window:
        return {attention_windows(0, args)}
    final = {attention_windows(args.num_iterations, args)}  # final_window_blocks' pair, where it is set
    if args.window_stages:
        stages = window_stage_blocks(args.window_stages) + [args.extension_window_blocks] * bool(
            args.extension_window_blocks)
        return final | {window_pair(blocks, args.short_window_cap) for blocks in stages}
    final_blocks = max(next_multiple(args.window_final_tokens, BLOCK_SIZE) // BLOCK_SIZE, 1)  # the growth's end
    if final_blocks <= MAX_EAGER_WINDOWS:
        return {window_pair(blocks, args.short_window_cap) for blocks in range(1, final_blocks + 1)}
    if args.num_iterations < MAX_EAGER_WINDOWS:
        return {attention_windows(step, args) for step in range(args.num_iterations + 1)}
    return None


def layer_windows(windows, roles: LayerRoles) -> list:
    """Each layer's entry of a (long, short) pair: the long one on the layout's long-window layers, the short one
    on the others. windows: attention_windows' ints, the model's (2,) tensor of them, or (0, 1) for each layer's
    index into it."""
    return [windows[0] if is_long else windows[1] for is_long in roles.long_window]


def window_stage_blocks(text: str) -> list[int] | None:
    """--window_stages as block counts; None if the text is not such a list."""
    return parsed_list(text, int, lambda b: b >= 1)


def document_ids(tokens: Tensor) -> Tensor:
    """Document index of every token: a new document starts at each EOT token."""
    return (tokens == EOT_TOKEN).cumsum(0)


def attention_allowed(docs: Tensor, q_idx: Tensor, kv_idx: Tensor, window_blocks: Tensor,
                      exact: bool = False) -> Tensor:
    """The one mask rule: causal, same document, and within window_blocks 128-token blocks: whole blocks (the query's
    and the w-1 before it), or token-exact (track 2's FA3 window: the 128 * w keys before the query and itself)."""
    if exact:
        in_window = q_idx - kv_idx <= window_blocks * BLOCK_SIZE
    else:
        in_window = q_idx // BLOCK_SIZE - kv_idx // BLOCK_SIZE < window_blocks
    return (kv_idx <= q_idx) & (docs[q_idx] == docs[kv_idx]) & in_window


def sliding_window_mask(tokens: Tensor, window_blocks: Tensor, exact: bool = False) -> Tensor:
    """Dense (T, T) boolean mask of attention_allowed: O(T^2), kept as the tests' oracle only."""
    idx = torch.arange(tokens.numel(), device=tokens.device)
    return attention_allowed(document_ids(tokens), idx[:, None], idx[None, :], window_blocks, exact)


BAND_CHUNK_KEYS = 64 * 1024  # key slots per SDPA call: bounds the per-call mask and gradient buffers


@dataclass
class BandedMask:
    """attention_allowed over each query block's band: key blocks i-W+1..i of query block i.

    Query blocks are split into chunks; chunk (lo, hi) has a boolean mask (hi-lo, 1, 128, W*128).
    Keys left of the sequence start (block index < 0) are padding and never allowed.
    """
    band_blocks: int  # W
    chunks: list[tuple[int, int, Tensor]]


def banded_window_mask(tokens: Tensor, window_blocks: Tensor, chunk_keys: int = BAND_CHUNK_KEYS,
                       exact: bool = False) -> BandedMask:
    """The band of each query block, masked by the same rule as the dense and Flex masks.

    The window is read as an int here (a host sync), once per mask: the band's width is a shape. A token-exact
    window of w blocks reaches one block further back (into block i - w), so its band is w + 1 blocks.
    """
    docs = document_ids(tokens)
    n_blocks = tokens.numel() // BLOCK_SIZE
    band = max(1, min(int(window_blocks) + exact, n_blocks))  # a wider window sees the whole sequence anyway
    per_chunk = max(1, chunk_keys // (band * BLOCK_SIZE))
    offsets = torch.arange(band * BLOCK_SIZE, device=tokens.device)
    chunks = []
    for lo in range(0, n_blocks, per_chunk):
        hi = min(lo + per_chunk, n_blocks)
        q_idx = torch.arange(lo * BLOCK_SIZE, hi * BLOCK_SIZE, device=tokens.device).view(hi - lo, BLOCK_SIZE, 1)
        first_key = (torch.arange(lo, hi, device=tokens.device) - (band - 1)) * BLOCK_SIZE
        kv_idx = (first_key.view(-1, 1) + offsets).view(hi - lo, 1, -1)
        allowed = attention_allowed(docs, q_idx, kv_idx.clamp_min(0), window_blocks, exact) & (kv_idx >= 0)
        chunks.append((lo, hi, allowed[:, None]))
    return BandedMask(band_blocks=band, chunks=chunks)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, mask: BandedMask, scale: float) -> Tensor:
    """Exact attention over (1, T, H, D) inputs that scores only each query block's band: O(T*W).

    The keys are padded with W-1 blocks in front; query block i's band is then a window of the
    padded keys, taken as an overlapping view (no copy). Every query may attend to itself, so no
    row of a mask is empty and no softmax sees only -inf.
    """
    if q.size(0) != 1:
        raise ValueError("banded attention takes one flat sequence (batch size 1)")
    band, n_heads, head_dim = mask.band_blocks, q.size(2), q.size(3)
    pad = (band - 1) * BLOCK_SIZE
    k, v = (F.pad(t[0], (0, 0, 0, 0, pad, 0)) for t in (k, v))  # (pad + T, H, D)

    def bands(t: Tensor, lo: int, hi: int) -> Tensor:  # (hi - lo, H, W*128, D), a view of t
        rows = t[lo * BLOCK_SIZE:(hi + band - 1) * BLOCK_SIZE]
        return rows.unfold(0, band * BLOCK_SIZE, BLOCK_SIZE).permute(0, 1, 3, 2)

    out = []
    for lo, hi, allowed in mask.chunks:
        q_blocks = q[0, lo * BLOCK_SIZE:hi * BLOCK_SIZE].view(hi - lo, BLOCK_SIZE, n_heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q_blocks, bands(k, lo, hi), bands(v, lo, hi), attn_mask=allowed,
                                           scale=scale)
        out.append(y.transpose(1, 2).reshape(1, (hi - lo) * BLOCK_SIZE, n_heads, head_dim))
    return torch.cat(out, dim=1) if len(out) > 1 else out[0]


def sliding_window_block_mask(tokens: Tensor, window_blocks: Tensor, exact: bool = False):
    """FlexAttention BlockMask of attention_allowed, built from per-block document ranges.

    A block pair is full when every pair in it is allowed, partial (mask_mod decides) when some are. A token-exact
    window's block w back is partial (its keys from the query's offset in the block on), the nearer ones can be full.
    """
    from torch.nn.attention.flex_attention import BlockMask

    docs = document_ids(tokens)
    n_blocks = tokens.numel() // BLOCK_SIZE
    doc_lo, doc_hi = docs.view(n_blocks, BLOCK_SIZE)[:, 0], docs.view(n_blocks, BLOCK_SIZE)[:, -1]
    q_blk = torch.arange(n_blocks, device=tokens.device)[:, None]
    kv_blk = q_blk.T
    whole_in_window = q_blk - kv_blk < window_blocks  # every key of the block pair within the window
    in_window = q_blk - kv_blk <= window_blocks if exact else whole_in_window  # some key of it
    any_allowed = (kv_blk <= q_blk) & (doc_lo[:, None] <= doc_hi[None, :]) & (doc_lo[None, :] <= doc_hi[:, None])
    all_allowed = ((kv_blk < q_blk) & (doc_lo[:, None] == doc_hi[:, None]) & (doc_lo[None, :] == doc_hi[None, :])
                   & (doc_lo[:, None] == doc_lo[None, :]))
    full = all_allowed & whole_in_window
    partial = any_allowed & in_window & ~full

    def kv_order(blocks: Tensor) -> tuple[Tensor, Tensor]:
        counts = blocks.sum(dim=-1, dtype=torch.int32)
        order = blocks.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), order[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return attention_allowed(docs, q_idx, kv_idx, window_blocks, exact)

    partial_counts, partial_idx = kv_order(partial)
    full_counts, full_idx = kv_order(full)
    return BlockMask.from_kv_blocks(partial_counts, partial_idx, full_counts, full_idx,
                                    BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod)


def first_key_in_window(query: int, window_blocks: int, exact: bool = False) -> int:
    """The first position a query at `query` may attend to under a window of window_blocks blocks."""
    if exact:
        return max(0, query - window_blocks * BLOCK_SIZE)
    return max(0, (query // BLOCK_SIZE - window_blocks + 1) * BLOCK_SIZE)


# -----------------------------------------------------------------------------
# Model

def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


@dataclass(frozen=True)
class LayerRoles:
    """Every depth-dependent role of the U-net layout, derived in one place.

    For 12 layers: value embeddings 0,1,2 at layers 0-2 and again at 9-11, no attention
    in layer 7, windows L S S S L S | S L S S S L, layers 0-5 feed skips into 11-6.
    """
    value_embed: tuple[int | None, ...]  # table index used by each layer
    attention: tuple[bool, ...]
    long_window: tuple[bool, ...]
    n_encoder: int
    n_value_embeds: int
    paired_heads: tuple[bool, ...]  # attention layers whose head pairs attend as one
    key_offset: tuple[bool, ...]  # attention layers whose keys take the previous token's stationary dims
    backout_layer: int | None  # the stream entering this layer is backed out before the head
    output_gate: tuple[bool, ...] = ()  # record #89: heads scaled by a MUDD gate (empty: none)
    xsa: tuple[bool, ...] = ()  # record #89: gated exclusive self-attention
    dc: tuple[bool, ...] = ()  # record #89: DC head composition

    VALUE_EMBED_TABLES = 3  # R: three value-embedding tables, read by the first three and the last three layers
    # (track 2's records: five, --value_embed_tables)
    LONG_WINDOW_EVERY = 4  # R: encoder layers 0, 4, ... have the long window; the decoder mirrors the encoder
    NO_ATTENTION_OFFSET = 1  # R: the layer just after the middle (7 of 12) has no attention, only its MLP
    BACKOUT_FRACTION = Fraction(3, 4)  # 2025-10-04_Backout: the stream after block 8 of 12 (0-based), entering 9

    @staticmethod
    def for_depth(n_layer: int, value_embeds: bool = True, paired_heads: bool = False, key_offset: bool = False,
                  backout: bool = False, value_embed_tables: int = VALUE_EMBED_TABLES,
                  attention_free_layer: bool = True) -> "LayerRoles":
        n_enc = n_layer // 2
        n_ve = min(value_embed_tables, n_enc) if value_embeds else 0
        ve: list[int | None] = [None] * n_layer
        for i in range(n_ve):
            ve[i] = ve[n_layer - n_ve + i] = i
        encoder_long = [i % LayerRoles.LONG_WINDOW_EVERY == 0 for i in range(n_enc)]
        attention = [not attention_free_layer or i != n_enc + LayerRoles.NO_ATTENTION_OFFSET for i in range(n_layer)]
        long_window = encoder_long + encoder_long[::-1]
        # 2026-01-07_PairedHeadAttention pairs layers 0, 2, 5, 9 of its 11: the first short-window layer and each
        # short-window layer just before a long-window or attention-free one (1, 3, 6, 10 of our 12)
        short = [i for i in range(n_layer) if attention[i] and not long_window[i]]
        paired = {i for i in short if i == short[0] or i + 1 < n_layer and (long_window[i + 1] or not attention[i + 1])}
        return LayerRoles(value_embed=tuple(ve), attention=tuple(attention), long_window=tuple(long_window),
                          n_encoder=n_enc, n_value_embeds=n_ve,
                          paired_heads=tuple(paired_heads and i in paired for i in range(n_layer)),
                          key_offset=tuple(key_offset and attention[i] and long_window[i] for i in range(n_layer)),
                          backout_layer=int(n_layer * LayerRoles.BACKOUT_FRACTION) if backout else None)


    @staticmethod
    def from_lists(cfg: "ModelConfig") -> "LayerRoles":
        """Record #89's explicit layout (T:1238-1252, T:1494-1496, T:1543): every role a list of blocks, the j-th
        value-embedding block reading table j, the key offset on the long windows (with --key_offset)."""
        n = cfg.n_layer
        has = {name: set(block_list(getattr(cfg, f"{name}_blocks"))) for name in
               ("long_window", "attention_free", "paired_head", "value_embed", "output_gate", "xsa", "dc")}
        ve_blocks = block_list(cfg.value_embed_blocks) if cfg.value_embeds else []
        attention = tuple(i not in has["attention_free"] for i in range(n))
        long_window = tuple(i in has["long_window"] for i in range(n))
        return LayerRoles(value_embed=tuple(ve_blocks.index(i) if i in ve_blocks else None for i in range(n)),
                          attention=attention, long_window=long_window, n_encoder=n // 2,
                          n_value_embeds=len(ve_blocks), paired_heads=tuple(i in has["paired_head"] for i in range(n)),
                          key_offset=tuple(cfg.key_offset and attention[i] and long_window[i] for i in range(n)),
                          backout_layer=int(n * LayerRoles.BACKOUT_FRACTION) if cfg.backout else None,
                          output_gate=tuple(i in has["output_gate"] for i in range(n)),
                          xsa=tuple(i in has["xsa"] for i in range(n)), dc=tuple(i in has["dc"] for i in range(n)))

    @staticmethod
    def of(cfg: "ModelConfig") -> "LayerRoles":
        """The explicit lists where --long_window_blocks is set, else for_depth's rule."""
        if cfg.long_window_blocks:
            return LayerRoles.from_lists(cfg)
        roles = LayerRoles.for_depth(cfg.n_layer, cfg.value_embeds, cfg.paired_heads, cfg.key_offset, cfg.backout,
                                     cfg.value_embed_tables, cfg.attention_free_layer)
        if not cfg.mudd_gate_block:
            return roles
        gated = {name: set(block_list(getattr(cfg, f"{name}_blocks"))) for name in ("output_gate", "xsa", "dc")}
        return dataclasses.replace(roles, **{name: tuple(i in blocks and roles.attention[i] for i in range(cfg.n_layer))
                                             for name, blocks in gated.items()})


def block_list(text: str) -> list[int] | None:
    """A *_blocks flag's block indices (empty text: none); None where the text is not a comma list of indices."""
    return [] if text == "" else parsed_list(text, int, lambda i: i >= 0)


BLOCK_LISTS = ("long_window", "attention_free", "paired_head", "value_embed", "output_gate", "xsa", "dc")


def layout_problem(a) -> str | None:
    """What is wrong with record #89's block lists on this depth, if anything: a block past the last layer, or an
    attention-free block given an attention role."""
    lists = {name: block_list(getattr(a, f"{name}_blocks")) or [] for name in BLOCK_LISTS}
    for name, blocks in lists.items():
        if any(b >= a.n_layer for b in blocks):
            return (f"--{name}_blocks={getattr(a, f'{name}_blocks')} names block {max(blocks)}, past the last layer "
                    f"({a.n_layer - 1} of --n_layer={a.n_layer}); pass blocks below {a.n_layer}")
    for name, blocks in lists.items():
        clash = set(blocks) & set(lists["attention_free"]) if name != "attention_free" else set()
        if clash:
            return (f"--{name}_blocks={getattr(a, f'{name}_blocks')} gives block {min(clash)} an attention role, and "
                    f"--attention_free_blocks={a.attention_free_blocks} takes its attention away; drop it from one")
    return None


def paired_clash(a) -> str | None:
    """An XSA or DC block that is also paired (record #89 has them on unpaired blocks only, T:1152), if any."""
    paired = set(block_list(a.paired_head_blocks) or [])
    for name in ("xsa", "dc"):
        clash = set(block_list(getattr(a, f"{name}_blocks")) or []) & paired
        if clash:
            return (f"--{name}_blocks={getattr(a, f'{name}_blocks')} includes block {min(clash)}, whose heads "
                    f"--paired_head_blocks={a.paired_head_blocks} pairs; {name.upper()} needs unpaired heads: drop it "
                    "from one")
    return None


def mudd_problem(a) -> str | None:
    """What record #89's MUDD (T:1601-1610, T:1677-1680) lacks on this run, if anything: the cached stream h7, one
    skip (its source is h3), value tables read by the last block (table 0 is ve0), even heads, and attention."""
    skips = skip_pairs(a.skip_connections) if a.unet_skips and a.skip_connections else None
    roles = LayerRoles.from_lists(a) if a.long_window_blocks else LayerRoles.for_depth(
        a.n_layer, a.value_embeds, a.paired_heads, a.key_offset, a.backout, a.value_embed_tables,
        a.attention_free_layer)
    needs = [(not a.attention_cache_block, "an --attention_cache_block (its h7)"),
             (not skips or len(skips) != 1, "exactly one --skip_connections pair (its h3)"),
             (roles.value_embed[-1] is None, "a value table read by the last block (--value_embed_blocks)"),
             (not roles.attention[-1], "attention in the last block"), (a.n_head % 2 == 1, "an even --n_head")]
    missing = [what for lacking, what in needs if lacking]
    return f"--mudd=true needs {missing[0]}; pass it or --mudd=false" if missing else None


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA over (1, T, H, D) inputs with an explicit boolean mask: the KV-cache decode path."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    return y.transpose(1, 2)


class BandedAttention:
    """Banded masks and scaled_dot_product_attention: CPU, and wherever FlexAttention is off."""
    build_mask = staticmethod(banded_window_mask)
    attend = staticmethod(banded_attention)

    def __init__(self):
        # The band's width is read from a tensor: a compiled model calls this eagerly. Wrapped per model, not at
        # import: torch.compiler.disable imports dynamo, a second of start-up that --help and flag errors skip.
        self.build_mask = torch.compiler.disable(banded_window_mask)


class FlexAttention:
    """Block-sparse FlexAttention: CUDA (its backward does not run on CPU). compiled: flex_attention compiled on
    its own, for a model that is not compiled around it (uncompiled, it would build the dense score matrix: 58 GB
    per layer at 48K tokens)."""
    build_mask = staticmethod(sliding_window_block_mask)

    def __init__(self, compiled: bool = False):
        from torch.nn.attention.flex_attention import flex_attention
        self.kernel = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> Tensor:
        y = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, scale=scale)
        return y.transpose(1, 2)


def attention_backend(name: str, compiled: bool = False):
    """The attention a model runs: "banded" or "flex" (compiled on its own, or not)."""
    return FlexAttention(compiled) if name == "flex" else BandedAttention()


def attention_with(backend, mask):
    """One layer's attention, attend(q, k, v, scale): the backend with this layer's mask (KVCache.layer is the
    other kind, for decoding)."""
    return lambda q, k, v, scale: backend.attend(q, k, v, mask, scale)


# FP8 head: e4m3 operands forward, e5m2 gradients backward, scales fixed by the recipe.

def inverse_scale(scale: float, device: torch.device) -> Tensor:
    """torch._scaled_mm's fp32 scale operand, filled on the device (new_tensor would copy from the host and wait)."""
    return torch.full((), 1 / scale, dtype=torch.float32, device=device)


def fp8_forward_math(x: Tensor, w: Tensor, x_scale: float, w_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    x_f8 = (x * x_scale).to(torch.float8_e4m3fn)
    w_f8 = (w * w_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, use_fast_accum=True,
                           scale_a=inverse_scale(x_scale, x.device), scale_b=inverse_scale(w_scale, x.device))
    return out, x_f8, w_f8


def fp8_backward_math(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_scale: float, w_scale: float,
                      grad_scale: float) -> tuple[Tensor, Tensor]:
    grad_f8 = (grad * grad_scale).to(torch.float8_e5m2)
    inv = lambda s: inverse_scale(s, grad.device)
    grad_x = torch._scaled_mm(grad_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16, use_fast_accum=False,
                              scale_a=inv(grad_scale), scale_b=inv(w_scale))
    grad_w = torch._scaled_mm(grad_f8.T.contiguous(), x_f8.T.contiguous().T, out_dtype=torch.float32,
                              use_fast_accum=False, scale_a=inv(grad_scale), scale_b=inv(x_scale))
    return grad_x, grad_w


def fp8_kernel(math, backend: str):
    """The FP8 math as an op runs it: "eager", or compiled by a torch.compile backend ("inductor": the trainer's
    choice with --compile=model). A custom op is opaque to the model's torch.compile, so its scaling, casts and
    transposes would otherwise run as separate eager kernels (about 10 GB of extra memory traffic per step on a
    49152x50304 gradient); the record compiles the op's insides the same way, inside the op. torch.compile caches
    what it compiles by the function's code, so making the wrapper at each call compiles once."""
    return math if backend == "eager" else torch.compile(math, dynamic=False, fullgraph=True, backend=backend)


@torch.library.custom_op("speedrun::fp8_matmul", mutates_args=())
def fp8_matmul(x: Tensor, w: Tensor, x_scale: float, w_scale: float, backend: str,
               grad_scale: float = 2.0 ** 19) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w.T in FP8, its math run as fp8_kernel(backend) runs it; also returns the FP8 operands for backward
    (whose gradient is scaled by grad_scale)."""
    return fp8_kernel(fp8_forward_math, backend)(x, w, x_scale, w_scale)


@fp8_matmul.register_fake
def _(x: Tensor, w: Tensor, x_scale: float, w_scale: float, backend: str, grad_scale: float = 2.0 ** 19):
    return (x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16),
            torch.empty_like(x, dtype=torch.float8_e4m3fn), torch.empty_like(w, dtype=torch.float8_e4m3fn))


@torch.library.custom_op("speedrun::fp8_matmul_backward", mutates_args=())
def fp8_matmul_backward(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_scale: float, w_scale: float,
                        grad_scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """grad_x = grad @ w and grad_w = grad.T @ x from two scaled matmuls; grad_w accumulates in fp32."""
    return fp8_kernel(fp8_backward_math, backend)(grad, x_f8, w_f8, x_scale, w_scale, grad_scale)


@fp8_matmul_backward.register_fake
def _(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_scale: float, w_scale: float, grad_scale: float, backend: str):
    return (x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.float32))


FP8_SCALES = dict(x_scale=2.0, w_scale=2.0 ** 9, grad_scale=2.0 ** 19)  # R (w from 2**5, grad from 2**29)
# record #89, T:1225: x/(100/448), W/(1.6/448), g/(0.75/448) with g the summed loss's gradient (grad_scale = 1)
FP8_HEAD_SCALES = {"reference": FP8_SCALES,
                   "record": dict(x_scale=448 / 100, w_scale=448 / 1.6, grad_scale=448 / 0.75)}


def _fp8_setup_context(ctx, inputs, output):
    _, _, x_scale, w_scale, backend, *grad_scale = inputs
    ctx.save_for_backward(output[1], output[2])
    ctx.scales, ctx.backend = (x_scale, w_scale, *(grad_scale or [FP8_SCALES["grad_scale"]])), backend


def _fp8_backward(ctx, grad_out, *_):
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_matmul_backward(grad_out, x_f8, w_f8, *ctx.scales, ctx.backend)
    return grad_x, grad_w, None, None, None, None


fp8_matmul.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


class CastedLinear(nn.Linear):
    """fp32 master weight, used in the activation dtype; optionally FP8 in training (the head): fp8 names how
    fp8_matmul runs its math (fp8_kernel), None keeps the activation dtype; fp8_scales: FP8_SCALES' keys."""

    def __init__(self, in_features: int, out_features: int, zero_init: bool = False, fp8: str | None = None,
                 fp8_scales: dict[str, float] = FP8_SCALES):
        super().__init__(in_features, out_features, bias=False)
        self.fp8, self.fp8_scales = fp8, fp8_scales
        bound = math.sqrt(3) * 0.5 / math.sqrt(in_features)  # uniform with std 0.5/sqrt(fan_in)
        with torch.no_grad():
            self.weight.zero_() if zero_init else self.weight.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None and self.training:
            s = self.fp8_scales
            out = fp8_matmul(x.flatten(0, -2), self.weight, s["x_scale"], s["w_scale"], self.fp8, s["grad_scale"])[0]
            return out.view(*x.shape[:-1], -1)
        return F.linear(x, self.weight.type_as(x))


def rotary_frequencies(head_dim: int) -> Tensor:
    """Angular frequency of each rotated pair: 1 down to 1/1024 over the first quarter of the head, zeros over the
    second (those dims are not rotated)."""
    n = head_dim // 4
    return torch.cat([(1 / 1024) ** torch.linspace(0, 1, n), torch.zeros(n)])


YARN_RAMP = (1, 32)  # M Yarn.apply's alpha, beta: a frequency turning < 1 time in the old window is interpolated


def yarn_state(step: int, args: Hyperparameters) -> tuple[Tensor, float]:
    """Track 2's YaRN (M Yarn.apply, L891-900) at a step: the rotary frequencies and attention scale after every
    long-window change up to the step to at most yarn_max_window blocks (M L1552-1553), from the base
    frequencies and attn_scale. A pure function of the step: a resumed run or a tool rebuilds it from its step."""
    freqs, scale = rotary_frequencies(args.head_dim), args.attn_scale
    for _, old, new in yarn_changes(step, args):
        freqs, scale = yarn_rescaled(freqs, scale, old, new)
    return freqs, scale


def yarn_changes(step: int, args: Hyperparameters) -> list[tuple[int, int, int]]:
    """(step, old, new) of the long-window changes YaRN has applied by a step: those to at most yarn_max_window."""
    if not args.yarn_max_window:
        return []
    return [(first, old, new) for first, old, new in long_window_changes(args)
            if first <= step and new <= args.yarn_max_window]


def yarn_rescaled(freqs: Tensor, scale: float, old: int, new: int) -> tuple[Tensor, float]:
    """One YaRN change from a window of old blocks to new: a frequency that turns fewer than alpha times in the old
    window slows by old/new (interpolation), one that turns more than beta times keeps its speed, linear in
    between; the attention scale grows by 1 + 0.2 ln(new/old) (M L891-900, in its float32 operation order)."""
    alpha, beta = YARN_RAMP
    rotations = BLOCK_SIZE * old * freqs / (2 * torch.pi)
    scaling_factor = old / new
    interpolation = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
    return freqs * (scaling_factor + interpolation * (1 - scaling_factor)), scale * (0.2 * math.log(new / old) + 1)


class Rotary(nn.Module):
    """Rotary embedding on half the head dimension; the other half's frequencies are zero (not rotated).
    bf16: the tables are stored in bf16 and the rotation runs in the activations' dtype (M L881-886, L902-911);
    otherwise both are fp32 (R)."""

    def __init__(self, head_dim: int, max_seq_len: int, bf16: bool = False):
        super().__init__()
        self.table_dtype = torch.bfloat16 if bf16 else torch.float32
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rotary_frequencies(head_dim))
        self.register_buffer("cos", theta.cos().to(self.table_dtype), persistent=False)
        self.register_buffer("sin", theta.sin().to(self.table_dtype), persistent=False)

    @torch.no_grad()
    def set_frequencies(self, freqs: Tensor) -> None:
        """Rebuilds the tables in place for new frequencies (YaRN, yarn_state): same buffers, same shapes."""
        theta = torch.outer(torch.arange(self.cos.size(0), dtype=torch.float32, device=self.cos.device),
                            freqs.to(self.cos.device))
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:  # (B, T, H, D) at positions offset, offset + 1, ...
        positions = slice(offset, offset + x.size(1))
        cos, sin = self.cos[None, positions, None, :], self.sin[None, positions, None, :]
        if self.table_dtype != torch.float32:  # M: x1 * cos + x2 * sin, x2 * cos - x1 * sin in bf16
            cos, sin = cos.type_as(x), sin.type_as(x)
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


GATE_DIMS = 12  # 2025-08-23_SparseAttnGate, 2025-09-18_Smear, 2025-12-29_VeSkipGates: gates read 12 dims
NEUTRAL_GATE_SCALE = 2.0  # 2025-12-29_VeSkipGates: 2 * sigmoid, so a zero-initialised gate passes its input as is
BIGRAM_HASH = (36313, 27191)  # 2026-01-19_BigramHashEmbedding: multipliers of the current and previous token
BIGRAM_SIGN_ROWS = 8192  # 2026-05-20_BigramsSignTrick: random +-1 vectors, picked by (previous xor current) % 8192
BIGRAM_LAMBDA_INIT = 0.05  # same record: every layer adds 0.05 x the bigram embedding at first
BACKOUT_LAMBDA_INIT = 0.5  # 2025-10-04_Backout


@dataclass(frozen=True)
class ModelConfig:
    """The model's share of the hyperparameters (same names and kinds): the reference's shape and math, every
    model technique's flags (tests/test_config.py holds this list to TECHNIQUES), and the positions the rotary
    tables cover."""
    vocab_size: int
    n_layer: int
    model_dim: int
    n_head: int
    head_dim: int
    attn_scale: float
    qk_norm: bool
    zero_init: bool
    mlp_act: str
    value_embeds: bool
    unet_skips: bool
    logit_softcap: float
    logit_temperature: float
    bigram_vocab_size: int
    bigram_dim: int
    bigram_sign: bool
    smear: bool
    attn_gate: bool
    ve_gates: bool
    skip_gates: bool
    backout: bool
    key_offset: bool
    paired_heads: bool
    logit_offset: float
    value_embed_tables: int
    attention_free_layer: bool
    pad_embed_tables: bool
    skip_connections: str
    skip_sigmoid: bool
    gate_dims: int
    second_embed: bool
    residual_lambda_init: float
    attn_output_lambda: bool
    cross_document_shifts: bool
    qkv_init_gain: float
    head_init_std: float
    value_embed_zero_init: bool
    bf16_rotary: bool
    bf16_train_logits: bool
    fp8_mlp: bool  # the MLPs keep the FP8 scales (whether FP8 runs is the device's: GPT's fp8_mlp)
    fp8_head_scales: str
    loss_sum: bool
    bf16_val_softcap: bool
    long_window_blocks: str
    attention_free_blocks: str
    paired_head_blocks: str
    value_embed_blocks: str
    ve_gate_reads_value: bool
    value_embed_init_std: float
    attn_proj_uniform_init: bool
    sublayer_lambdas: bool
    attention_cache_block: int
    mudd_gate_block: int
    output_gate_blocks: str
    xsa_blocks: str
    dc_blocks: str
    mudd: bool
    short_window_cap: int
    token_exact_windows: bool
    x0_lambda_lr: float | None  # set: each layer's x0 lambda is a parameter of its own (the optimizer's group)
    max_seq_len: int  # the longer of training and validation sequences

    @staticmethod
    def of(args: Hyperparameters) -> "ModelConfig":
        shared = {f.name: getattr(args, f.name) for f in fields(ModelConfig) if f.name != "max_seq_len"}
        return ModelConfig(**shared, max_seq_len=max(args.seq_len, args.val_seq_len))


def sigmoid_gate(x: Tensor, weight: Tensor) -> Tensor:
    """sigmoid(x[..., :G] @ weight.T) for a (gates, G) weight: one gate per row, read from the stream's first G
    dims (--gate_dims)."""
    return torch.sigmoid(F.linear(x[..., :weight.size(-1)], weight.type_as(x)))


def previous_in_document(x: Tensor, doc_start: Tensor | None) -> Tensor:
    """x (1, T, ...) shifted one position later along T: each position gets the previous token's value, and a
    document's first token gets zeros, so nothing crosses a document start (smear, key offset). doc_start None
    (--cross_document_shifts, M L1161): only the sequence's first position gets zeros."""
    previous = F.pad(x[:, :-1], (0, 0) * (x.dim() - 2) + (1, 0))
    return previous if doc_start is None else previous * ~doc_start.view(1, -1, *[1] * (x.dim() - 2))


def offset_stationary_keys(k: Tensor, doc_start: Tensor | None) -> Tensor:
    """2025-12-14_PartialKeyOffset: each key's stationary rotary dims (D/4..D/2 and 3D/4..D, which rotary
    leaves unrotated) are replaced by the previous token's, so one key can answer for two positions (1-layer
    induction). A document's first token gets zeros there: nothing crosses a document start. doc_start None
    (--cross_document_shifts, M L971-974): every position but the sequence's first takes the previous key's
    dims, across documents; the first keeps its own."""
    dim = torch.arange(k.size(-1), device=k.device)
    stationary = dim % (k.size(-1) // 2) >= k.size(-1) // 4
    previous = torch.cat([k[:, :1], k[:, :-1]], dim=1) if doc_start is None else previous_in_document(k, doc_start)
    return torch.where(stationary, previous, k)


def pair_heads(t: Tensor) -> Tensor:
    """(B, T, H, D) -> (B, 2T, H/2, D): heads 2p and 2p+1 become one head over interleaved positions
    (2026-01-07_PairedHeadAttention): position 2i holds token i's head 2p, position 2i+1 its head 2p+1."""
    B, T, H, D = t.shape
    return t.view(B, T, H // 2, 2, D).transpose(2, 3).reshape(B, 2 * T, H // 2, D)


def unpair_heads(t: Tensor) -> Tensor:
    """The inverse of pair_heads."""
    B, T2, H2, D = t.shape
    return t.view(B, T2 // 2, 2, H2, D).transpose(2, 3).reshape(B, T2 // 2, 2 * H2, D)


def paired_tokens(tokens: Tensor) -> Tensor:
    """A token sequence whose masks (document ids, causality, windows) are those of pair_heads' positions:
    token i at 2i and a non-document-start token at 2i+1, so both copies of i share i's document."""
    second = torch.where(tokens == EOT_TOKEN, 0, tokens)
    return torch.stack([tokens, second], dim=1).flatten()


def exclusive_self_attention(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """Gated XSA (record #89, T:1151-1157): each head's output y (1, T, H, D) loses the fraction tanh(alpha)
    (alpha (1, T, H), init 0: a no-op) of its projection on the same token's value v, in y's dtype as the record."""
    dot = (y * v).sum(-1, keepdim=True)
    denom = v.square().sum(-1, keepdim=True).clamp_min(1e-8)
    strength = torch.tanh(alpha).type_as(y)[..., None]
    return y - strength * (dot / denom) * v


def chunk_and_previous(t: Tensor, chunk: int) -> Tensor:
    """(1, T, ...) -> (T/chunk, 2*chunk, ...): chunk c's rows preceded by chunk c-1's (zeros before chunk 0)."""
    rows = t[0].view(t.size(1) // chunk, chunk, *t.shape[2:])
    return torch.cat([torch.cat([torch.zeros_like(rows[:1]), rows[:-1]]), rows], dim=1)


def dc_window_mask(docs: Tensor, keys: int, chunk: int) -> Tensor:
    """(T/chunk, 1, chunk, 2*chunk) mask over chunk_and_previous's keys: key s is in query t's DC window when
    t - keys < s <= t and s is in t's document (DC:313-321); the zero padding before chunk 0 never is."""
    n = docs.numel() // chunk
    q_idx = torch.arange(n * chunk, device=docs.device).view(n, chunk, 1)
    first_key = torch.arange(-1, n - 1, device=docs.device).view(n, 1, 1) * chunk
    kv_idx = first_key + torch.arange(2 * chunk, device=docs.device)  # (n, 1, 2chunk)
    rel = q_idx - kv_idx
    same_doc = docs[q_idx] == docs[kv_idx.clamp_min(0)]
    return ((rel >= 0) & (rel < keys) & (kv_idx >= 0) & same_doc)[:, None]


def dc_composition(q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, docs: Tensor, keys: int,
                   scale: float) -> Tensor:
    """Record #89's DC head composition (T:1142-1149, DC:253-440), the term added to the attention output.

    Each head's softmax over the `keys` keys t-keys+1..t of t's document (q, k, v (1, T, H, D) as attention
    uses them) is mixed over heads by w1 (rms-normalised over heads, eps 1e-6, T:1077), and each head adds
    w2 * (that mix) @ v. The rms, scores and mix are fp32 (fp64 for fp64 inputs); w2 times the mix is cast to v's dtype
    before the product with v (DC:235-236). Queries go in chunks of 128 against their chunk and the one before
    (keys <= 128), so memory is O(T * 256 * H), not a (T, keys, H, D) gather.
    """
    chunk, (T, H, D) = BLOCK_SIZE, q.shape[1:]
    if keys > chunk or T % chunk:
        raise ValueError(f"DC takes a window of at most {chunk} keys over a multiple of {chunk} tokens")
    n, wide = T // chunk, torch.promote_types(v.dtype, torch.float32)
    w1 = F.rms_norm(w1.to(wide), (H,), eps=1e-6).to(v.dtype).to(wide)  # then cast to x's dtype as T:1077
    w1, w2 = (w[0].view(n, chunk, H).permute(0, 2, 1)[..., None] for w in (w1, w2.to(v.dtype).to(wide)))
    q_chunks = q[0].to(wide).view(n, chunk, H, D).transpose(1, 2)  # (n, H, chunk, D)
    k_bands, v_bands = (chunk_and_previous(t, chunk).transpose(1, 2) for t in (k.to(wide), v))  # (n, H, 2chunk, D)
    scores = scale * (q_chunks @ k_bands.transpose(-1, -2))
    probs = scores.masked_fill(~dc_window_mask(docs, keys, chunk), float("-inf")).softmax(-1)
    mix = (w1 * probs).sum(1, keepdim=True)  # (n, 1, chunk, 2chunk): A(t, s) of every head's softmax
    out = (w2 * mix).to(v.dtype) @ v_bands  # (n, H, chunk, D)
    return out.transpose(1, 2).reshape(1, T, H, D)


DC_KEYS = 112  # record #89, T:1146: DC composes heads over each query's last 112 keys


class AttnExtras(typing.NamedTuple):
    """Record #89's per-token additions to one attention block's heads (None: absent), each (1, T, H) but v_extra."""
    ve_gate: Tensor | None = None  # the MUDD block's value-embedding gate, in place of the learned one (T:1606-1610)
    v_extra: Tensor | None = None  # (1, T, D): the MUDD block's value term from earlier streams (T:1604)
    dc: tuple[Tensor, Tensor] | None = None  # DC's (w1, w2) (T:1142-1149)
    docs: Tensor | None = None  # (T,) document ids, for DC's window
    xsa_alpha: Tensor | None = None  # XSA's strength before tanh (T:1151-1157)
    output_gate: Tensor | None = None  # the heads' linear output gate (T:1158-1159)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, uses_value_embed: bool, paired: bool = False, key_offset: bool = False,
                 learned_ve_gate: bool = True):
        super().__init__()
        dim, hdim = cfg.model_dim, cfg.n_head * cfg.head_dim
        self.n_head, self.head_dim, self.scale, self.qk_norm = cfg.n_head, cfg.head_dim, cfg.attn_scale, cfg.qk_norm
        self.paired, self.key_offset, self.output_lambda = paired, key_offset, cfg.attn_output_lambda
        bound = math.sqrt(3) * cfg.qkv_init_gain / math.sqrt(dim)  # uniform with std gain/sqrt(dim)
        self.qkv_w = nn.Parameter(torch.empty(3, hdim, dim).uniform_(-bound, bound))  # Q, K, V kept apart for Muon
        # 2025-12-29_VeSkipGates: with the gate, the value embedding enters at the gate's weight alone (lambda 1).
        # M L1093: (v's 0.5, the output projection's 1.0) in every layer, the value embedding unscaled.
        self.lambdas = nn.Parameter(torch.tensor([0.5, 1.0] if cfg.attn_output_lambda else
                                                 [0.5, 1.0 if cfg.ve_gates else 0.5] if uses_value_embed else [0.5]))
        # paired heads rotate at their interleaved positions, so a pair's two heads sit half a token apart
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len * (2 if paired else 1), cfg.bf16_rotary)
        self.c_proj = CastedLinear(hdim, dim, zero_init=cfg.zero_init and not cfg.attn_proj_uniform_init)
        if cfg.attn_proj_uniform_init:
            nn.init.uniform_(self.c_proj.weight, -bound, bound)  # record #89, T:1293: O sits in vo_bank with V
        gates = cfg.gate_dims
        self.attn_gate = nn.Parameter(torch.zeros(cfg.n_head, gates)) if cfg.attn_gate else None
        self.ve_gate = (nn.Parameter(torch.zeros(cfg.n_head, gates))
                        if cfg.ve_gates and uses_value_embed and learned_ve_gate else None)
        self.ve_gate_reads_value = cfg.ve_gate_reads_value

    def forward(self, x: Tensor, ve: Tensor | None, attend, offset: int = 0, doc_start: Tensor | None = None,
                extras: AttnExtras = AttnExtras()) -> Tensor:
        """attend(q, k, v, scale): this layer's attention (attention_with, or KVCache.layer when decoding)."""
        B, T = x.shape[:2]
        qkv = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * self.n_head, self.head_dim)
        q, k, v = qkv.chunk(3, dim=-2)
        if self.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        v = self.with_value_embed(x, v, ve, extras)
        if self.paired:
            q, k, v = pair_heads(q), pair_heads(k), pair_heads(v)
            offset = 2 * offset
        q, k = self.rotary(q, offset), self.rotary(k, offset)
        if self.key_offset:
            k = offset_stationary_keys(k, doc_start)
        y = attend(q, k, v, self.scale)
        if self.paired:
            y = unpair_heads(y)
        y = self.record_head_outputs(y, q, k, v, extras)
        if self.attn_gate is not None:
            y = y * sigmoid_gate(x, self.attn_gate)[..., None]
        return self.project_out(y.reshape(B, T, -1))

    def with_value_embed(self, x: Tensor, v: Tensor, ve: Tensor | None, extras: AttnExtras) -> Tensor:
        """v scaled by its lambda plus the value embedding: gated per head by the learned gate (2 sigmoid, reading
        x[:G], or [x[:G/2], ve[:G/2]] with --ve_gate_reads_value, T:1613-1614), or by the MUDD block's gate plus
        its extra value term (T:1606-1610)."""
        if ve is None:
            return self.lambdas[0] * v
        if extras.ve_gate is not None:
            ve = ve.view_as(v) * extras.ve_gate.type_as(v)[..., None] + extras.v_extra.view_as(v)
        elif self.ve_gate is not None:
            half = self.ve_gate.size(-1) // 2
            gate_in = torch.cat([x[..., :half], ve[..., :half]], dim=-1) if self.ve_gate_reads_value else x
            ve = ve.view_as(v) * (NEUTRAL_GATE_SCALE * sigmoid_gate(gate_in, self.ve_gate))[..., None]
        return self.lambdas[0] * v + self.value_embed_scale() * ve.view_as(v)

    def record_head_outputs(self, y: Tensor, q: Tensor, k: Tensor, v: Tensor, extras: AttnExtras) -> Tensor:
        """Record #89's order after attention (T:1142-1159): DC added, then XSA, then the output gate."""
        if extras.dc is not None:
            y = y + dc_composition(q, k, v, *extras.dc, extras.docs, DC_KEYS, self.scale)
        if extras.xsa_alpha is not None:
            y = exclusive_self_attention(y, v, extras.xsa_alpha)
        if extras.output_gate is not None:
            y = y * extras.output_gate.type_as(y)[..., None]
        return y

    def value_embed_scale(self) -> Tensor | float:
        """The value embedding's weight in v: the learned lambda, or 1 where the second lambda scales the output
        projection instead (M L977)."""
        return 1.0 if self.output_lambda else self.lambdas[1]

    def project_out(self, y: Tensor) -> Tensor:
        """The output projection; with --attn_output_lambda its weight times the second lambda, pre-multiplied as
        the record does (M L988)."""
        if self.output_lambda:
            return F.linear(y, (self.lambdas[1] * self.c_proj.weight).type_as(y))
        return self.c_proj(y)


# FP8 MLP (record #89, T:1403-1434, T:1640-1680, K:443-566, K:706-713): the training forward's two matmuls read
# e4m3 operands with per-tensor scales; every backward, and evaluation, is bf16.
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MLP_ACT_HEADROOM = 1.80  # T:1674: the next forward's activation scale is 1.8x this forward's amax
FP8_MLP_WEIGHT_HEADROOM = 1.12  # K:754: the next step's W2 scale is 1.12x this step's amax
FP8_MLP_BOOTSTRAP_STEPS = 16  # T:2365: W2's scale from its current amax after training steps 0-15


def fp8_up_projection(n: Tensor, w1: Tensor, up_scale: Tensor) -> Tensor:
    """P = relu(n W1^T)^2 in bf16 from e4m3 n (scaled by its own amax, T:1645-1647) and e4m3 W1 (scaled by
    up_scale, set after each step): the fp32 product dequantized once, then cast to bf16 (K:443-466)."""
    amax = n.abs().max().clamp(min=1e-12)
    n_f8 = (n * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
    w1_f8 = (w1 / up_scale.to(w1.dtype)).to(torch.float8_e4m3fn)
    dequant = up_scale * amax.float() / E4M3_MAX
    pre = torch._scaled_mm(n_f8, w1_f8.T, scale_a=dequant, scale_b=torch.ones_like(dequant),
                           out_dtype=torch.bfloat16, use_fast_accum=True)
    return F.relu(pre).square()


def fp8_down_projection(post: Tensor, w2: Tensor, down_scale: Tensor, act_scale: Tensor) -> Tensor:
    """Y = P W2^T in bf16 from e4m3 P / a (clipped at 448, K:464) and e4m3 W2 / s (clipped at +-448, K:546)."""
    post_f8 = (post.float() * (1.0 / act_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    w2_f8 = (w2.float() / down_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(post_f8, w2_f8.T, scale_a=act_scale, scale_b=down_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=True)


class FP8MLPFunction(torch.autograd.Function):
    """relu(x W1^T)^2 W2^T with an FP8 forward, and amax(P). In bf16, as the record's activations (fp32 ones are
    cast); backward in bf16 from the saved bf16 x, P, W1 and W2 (K:720-729), relu(pre) rebuilt as sqrt(P) (K:470)."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, up_scale: Tensor, down_scale: Tensor,
                act_scale: Tensor) -> tuple[Tensor, Tensor]:
        n = x.flatten(0, -2).bfloat16()
        post = fp8_up_projection(n, w1, up_scale)
        out = fp8_down_projection(post, w2, down_scale, act_scale)
        ctx.save_for_backward(n, post, w1, w2)
        ctx.x_dtype = x.dtype
        return out.view(*x.shape[:-1], -1).to(x.dtype), post.max().float()

    @staticmethod
    def backward(ctx, grad_out: Tensor, _):
        n, post, w1, w2 = ctx.saved_tensors
        g = grad_out.flatten(0, -2).bfloat16()
        grad_w2 = g.T @ post
        dpre = (2 * (g @ w2.bfloat16()) * post.float().sqrt()).bfloat16()
        grad_w1 = dpre.T @ n
        grad_x = (dpre @ w1.bfloat16()).view(*grad_out.shape[:-1], -1).to(ctx.x_dtype)
        return grad_x, grad_w1.to(w1.dtype), grad_w2.to(w2.dtype), None, None, None


class MLP(nn.Module):
    """relu(x W1^T)^2 W2^T (or GELU). With cfg.fp8_mlp it keeps the record's FP8 scales (fp32, saved with the
    model); GPT sets fp8 where the device runs FP8, and then the training forward is FP8MLPFunction's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = CastedLinear(cfg.model_dim, 4 * cfg.model_dim)
        self.c_proj = CastedLinear(4 * cfg.model_dim, cfg.model_dim, zero_init=cfg.zero_init)
        self.act = (lambda h: F.relu(h).square()) if cfg.mlp_act == "relu2" else F.gelu
        self.fp8 = False
        if cfg.fp8_mlp:  # T:1311-1313: W1's scale, W2's scale (used) and next scale, P's scale a
            for name in ("fp8_up_scale", "fp8_down_scale", "fp8_down_next_scale", "fp8_act_scale"):
                self.register_buffer(name, torch.ones((), dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 and self.training:
            out, amax = FP8MLPFunction.apply(x, self.c_fc.weight, self.c_proj.weight, self.fp8_up_scale,
                                             self.fp8_down_scale, self.fp8_act_scale)
            with torch.no_grad():  # T:1670-1675: the next training forward's scale, from this one's amax
                self.fp8_act_scale.copy_(amax.clamp(min=1e-12) * (FP8_MLP_ACT_HEADROOM / E4M3_MAX))
            return out
        return self.c_proj(self.act(self.c_fc(x)))

    @torch.no_grad()
    def quantize_fp8(self, bootstrap: bool) -> None:
        """After an optimizer step (T:1403-1434): W1's current scale; W2 takes its next scale (bootstrap: first set
        from its amax, no headroom) and the next one becomes 1.12x its amax. The e4m3 copies are made in the
        forward from these scales and the unchanged weights, so a checkpoint's scales restore them exactly."""
        w1, w2 = self.c_fc.weight, self.c_proj.weight
        self.fp8_up_scale.copy_(w1.abs().max().clamp(min=1e-12) / E4M3_MAX)  # in W1's dtype, as T:1420
        if bootstrap:
            self.fp8_down_next_scale.copy_(w2.abs().max().clamp(min=1e-12) / E4M3_MAX)
        self.fp8_down_scale.copy_(self.fp8_down_next_scale)
        amax = w2.float().abs().max()
        self.fp8_down_next_scale.copy_(amax.clamp(min=1e-12) * (FP8_MLP_WEIGHT_HEADROOM / E4M3_MAX))


class SublayerInputs(typing.NamedTuple):
    """What one block of record #89's stream (GPT.stream_trunk) reads besides its stream and its value embedding."""
    resid: tuple  # the stream's weight r before (attention, MLP) are added (T:1638, T:1665); 1.0: none
    post: tuple  # the weight p of (attention's, the MLP's) output
    attn_in: Tensor | None = None  # the attention's input when it is a cached stream's, rms(h7) (T:1598)
    injected: Tensor | None = None  # added after attention: the x0 and bigram injections (T:1638-1640)
    extras: AttnExtras = AttnExtras()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, roles: LayerRoles):
        super().__init__()
        mudd_block = cfg.mudd and layer == cfg.n_layer - 1  # its value-embedding gate comes from MUDD (T:1606-1610)
        self.attn = (CausalSelfAttention(cfg, roles.value_embed[layer] is not None,
                                         paired=roles.paired_heads[layer], key_offset=roles.key_offset[layer],
                                         learned_ve_gate=not mudd_block)
                     if roles.attention[layer] else None)
        self.mlp = MLP(cfg)
        # mix of the stream and the embedding x0 (M L1092: the stream's weight starts at 1.05); the x0 weight apart
        # when it has its own lr (track 2, M L1083). Record #89's gates inject x0 and bigrams after attention instead.
        mixed = not cfg.mudd_gate_block
        self.lambdas = nn.Parameter(torch.tensor([cfg.residual_lambda_init, 0.0] if cfg.x0_lambda_lr is None
                                                 else [cfg.residual_lambda_init])) if mixed else None
        self.x0_lambda = nn.Parameter(torch.zeros(1)) if cfg.x0_lambda_lr is not None and mixed else None
        self.x02_lambda = nn.Parameter(torch.zeros(1)) if cfg.second_embed else None  # M L1083: from 0
        self.bigram_lambda = (nn.Parameter(torch.tensor([BIGRAM_LAMBDA_INIT])) if cfg.bigram_vocab_size and mixed
                              else None)

    def forward(self, x: Tensor, x0: Tensor, ve: Tensor | None, attend, offset: int = 0,
                doc_start: Tensor | None = None, bigram: Tensor | None = None, x02: Tensor | None = None) -> Tensor:
        """doc_start: where the key offset stops (None: only at the sequence's start); x02: the second
        embedding (--second_embed), mixed in at x02_lambda as M L1185 does."""
        x = self.input_mix(x, x0, bigram, x02)
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), ve, attend, offset, doc_start)
        return x + self.mlp(rms_norm(x))

    def input_mix(self, x: Tensor, x0: Tensor, bigram: Tensor | None, x02: Tensor | None) -> Tensor:
        """The block's input: the stream and x0 at their lambdas, plus the second embedding and the bigrams."""
        x = self.lambdas[0] * x + (self.lambdas[1] if self.x0_lambda is None else self.x0_lambda[0]) * x0
        if x02 is not None:
            x = x + self.x02_lambda[0] * x02
        if bigram is not None:
            x = x + self.bigram_lambda[0] * bigram  # [0]: a 0-dim factor keeps x in bf16
        return x

    def sublayers(self, x: Tensor, given: SublayerInputs, ve: Tensor | None, attend, offset: int,
                  doc_start: Tensor | None, mix: tuple) -> Tensor:
        """Record #89's block (T:1598-1665): x <- r x + p attention(a) + injections, then x <- r x + p MLP(rms(x));
        mix: (x0, bigram, x02) for the input mix, where the block still has one (no gates)."""
        if self.lambdas is not None:
            x = self.input_mix(x, *mix)
        if self.attn is not None:
            a = rms_norm(x) if given.attn_in is None else given.attn_in
            x = given.resid[0] * x + given.post[0] * self.attn(a, ve, attend, offset, doc_start, given.extras)
            if given.injected is not None:
                x = x + given.injected
        return given.resid[1] * x + given.post[1] * self.mlp(rms_norm(x))


def next_multiple(n: float, k: int) -> int:
    return int(math.ceil(n / k) * k)


def token_pairs(tokens: Tensor, across_documents: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(current, previous, first) for the bigram hashes: int64 ids, the ids shifted one later, and where a pair
    must not be formed (the sequence's first token and every document start; across_documents, record #89
    T:1786-1793: the sequence's first token only)."""
    current = tokens.to(torch.int64)
    first = torch.zeros_like(tokens, dtype=torch.bool) if across_documents else tokens == EOT_TOKEN
    first[0] = True
    return current, F.pad(current[:-1], (1, 0)), first


def bigram_rows(tokens: Tensor, rows: int, across_documents: bool = False) -> Tensor:
    """2026-01-19_BigramHashEmbedding: the table row of each (previous, current) token pair,
    (36313 * current) xor (27191 * previous) mod (rows - 1). Row rows - 1 is kept for a document's first token
    (the record keeps it for the sequence's first only, as across_documents): a pair never spans two documents."""
    current, previous, first = token_pairs(tokens, across_documents)
    row = torch.bitwise_xor(BIGRAM_HASH[0] * current, BIGRAM_HASH[1] * previous) % (rows - 1)
    return torch.where(first, rows - 1, row)


def bigram_sign_table(dim: int) -> Tensor:
    """2026-05-20_BigramsSignTrick: BIGRAM_SIGN_ROWS fixed random +-1 vectors. Drawn from a fixed seed, so every
    rank and every reload has the same table without storing it."""
    return torch.randn(BIGRAM_SIGN_ROWS, dim, generator=torch.Generator().manual_seed(0), device="cpu").sign()


def bigram_sign_rows(tokens: Tensor, across_documents: bool = False) -> Tensor:
    """Same record: the sign vector of each (previous, current) pair, (previous xor current) % BIGRAM_SIGN_ROWS
    (a different hash from bigram_rows'), row 0 at a document's first token. Two pairs sharing a table row
    then mostly add their embeddings with different signs, and interfere less (across_documents: as token_pairs)."""
    current, previous, first = token_pairs(tokens, across_documents)
    return torch.where(first, 0, torch.bitwise_xor(previous, current) % BIGRAM_SIGN_ROWS)


def smear(x: Tensor, gate: Tensor, doc_start: Tensor) -> Tensor:
    """2025-09-18_Smear: x[i] + gate[i] * x[i - 1] over (1, T, D) embeddings, where gate is (1, T, 1);
    a document's first token takes nothing from the token before it."""
    return x + gate * previous_in_document(x, doc_start)


SKIP_LAMBDA_INIT = -1.5  # track 2, M L1096: a skip starts at weight sigmoid(-1.5) = 0.18


def skip_pairs(spec: str) -> tuple[tuple[int, int], ...] | None:
    """--skip_connections 'a>b,...' as (a, b) pairs ordered by b (the order of their weights and gates, M's
    skip_idx); None where the text is not such a list or names a target twice."""
    pairs = []
    for item in spec.split(","):
        parts = item.strip().split(">")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            return None
        pairs.append((int(parts[0]), int(parts[1])))
    targets = [b for _, b in pairs]
    return tuple(sorted(pairs, key=lambda pair: pair[1])) if len(set(targets)) == len(targets) else None


def unet_skips(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The U-net skips as (from, into) pairs: the stream after block `from` is added before block `into`. R: each
    encoder block feeds its mirror (the last encoder block the first decoder block, and so on)."""
    if cfg.skip_connections:
        return skip_pairs(cfg.skip_connections)
    n_enc = cfg.n_layer // 2
    return tuple((n_enc - 1 - j, n_enc + j) for j in range(n_enc))


RESID_LAMBDA_INIT = 1.1 ** 0.5  # record #89, T:1338: the stream grows 1.1x per block, sqrt(1.1) per sublayer
MUDD_SCALE = 0.1  # record #89, T:1372: MUDD's coefficients are 0.1 x (W2 GELU(W1 x) + b), a fixed scale
MUDD_DIM = 64  # T:1373, T:1440: the hidden width of MUDD's and the gate generators' two-layer maps
MUDD_BLOCK_COEFS = 14  # T:1374: the last block's coefficients (T:1359-1366)
MUDD_EXIT_COEFS = 5  # T:1677: after the last block, over c0, h7, h9, the first value table and h3
GATE_SCALE_INIT = 0.1  # T:1437: the gate generators' learned scale s_g
# T:1450-1466: each gate kind's value at init (the bias is value / s_g); the XSA alphas, x0 gates and DC w2 start at 0
GATE_INITS = {"output_gate": 0.25, "bigram": 0.05, "skip": 0.5, "dc1": 1.0}


def mudd_block_bias() -> Tensor:
    """The last block's MUDD bias, value / 0.1 (T:1380-1392): VE gates 2 (mu6, mu7), the sublayers' r sqrt(1.1)
    (mu8, mu12) and p 1 (mu9, mu13), the bigram's 0.05 (mu11); the stream and value sources (mu0-mu5) and x0 0."""
    values = [0.0] * 6 + [2.0, 2.0, RESID_LAMBDA_INIT, 1.0, 0.0, BIGRAM_LAMBDA_INIT, RESID_LAMBDA_INIT, 1.0]
    return torch.tensor(values) / MUDD_SCALE


def gate_columns(cfg: ModelConfig, roles: LayerRoles, skips: tuple) -> tuple[dict, dict]:
    """Record #89's per-token gate columns (T:1443-1484) of the pre gate (from x0: blocks before --mudd_gate_block)
    and the post gate (from the stream entering it: the blocks from there, the skips), each {(kind, block or skip):
    slice}. The record's order: XSA alphas and output gates (n_head each), each attention block's x0 and bigram
    injections (the MUDD block has its own), the skips, DC's w1s then w2s (n_head each)."""
    sides: tuple[dict, dict] = ({}, {})
    side = [int(i >= cfg.mudd_gate_block) for i in range(cfg.n_layer)]

    def add(at: int, key: tuple[str, int], width: int) -> None:
        start = sum(sl.stop - sl.start for sl in sides[at].values())
        sides[at][key] = slice(start, start + width)

    for kind in ("xsa", "output_gate"):
        for i in (i for i, on in enumerate(getattr(roles, kind)) if on):
            add(side[i], (kind, i), cfg.n_head)
    for i in range(cfg.n_layer):
        if roles.attention[i] and not (cfg.mudd and i == cfg.n_layer - 1):
            add(side[i], ("x0", i), 1)
            if cfg.bigram_vocab_size:
                add(side[i], ("bigram", i), 1)
    for j in range(len(skips)):
        add(1, ("skip", j), 1)
    for kind in ("dc1", "dc2"):
        for i in (i for i, on in enumerate(roles.dc) if on):
            add(side[i], (kind, i), cfg.n_head)
    return sides


def gate_bias(columns: dict, width: int) -> Tensor:
    """One gate generator's bias: each column's GATE_INITS value / GATE_SCALE_INIT, zero where it has none."""
    bias = torch.zeros(width)
    for (kind, _), where in columns.items():
        bias[where] = GATE_INITS.get(kind, 0.0) / GATE_SCALE_INIT
    return bias


def kaiming_rows(n: int, rows: int, cols: int) -> Tensor:
    """n (rows, cols) matrices, Kaiming-uniform with a = sqrt(5) as nn.Linear: U(+-1/sqrt(cols)) (T:1377, T:1445)."""
    return torch.empty(n, rows, cols).uniform_(-cols ** -0.5, cols ** -0.5)


class GPT(nn.Module):
    """The model of a ModelConfig. What the machine decides comes in from build_model: the attention backend
    (attention_backend: banded or flex, compile_attention), the FP8 head's kernels (fp8_kernels: None for none,
    else how fp8_kernel runs them), whether the MLPs train in FP8 (fp8_mlp, with cfg.fp8_mlp) and the loss path
    (LossPath); the tools' KV cache comes with decode()."""

    def __init__(self, cfg: ModelConfig, attention: str = "banded", compile_attention: bool = False,
                 fp8_kernels: str | None = None, loss: "LossPath | None" = None, fp8_mlp: bool = False):
        super().__init__()
        self.loss = loss = LossPath() if loss is None else loss
        if loss.chunked and fp8_kernels is not None:
            raise ValueError("the chunked head + loss computes the head in the activation dtype, not FP8")
        self.config = cfg
        self.roles = LayerRoles.of(cfg)
        self.backend = attention_backend(attention, compile_attention)
        self.vocab_size, self.unet = cfg.vocab_size, cfg.unet_skips
        self.softcap = Softcap(cfg.logit_softcap, cfg.logit_temperature, cfg.logit_offset)
        self.register_buffer("prefix_table", prefix_token_table(cfg.vocab_size) if loss.prefix_tokens else None,
                             persistent=False)  # record #89 (T:1221): each token's prefix token, -1 for none
        rows = next_multiple(cfg.vocab_size, 128) if cfg.pad_embed_tables else cfg.vocab_size  # M L1046: the head's
        self.embed = nn.Embedding(rows, cfg.model_dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(rows, cfg.model_dim) for _ in range(self.roles.n_value_embeds))
        if cfg.value_embed_zero_init:
            for table in self.value_embeds:
                nn.init.zeros_(table.weight)  # M L1062-1063
        if cfg.value_embed_init_std:
            for table in self.value_embeds:
                nn.init.normal_(table.weight, std=cfg.value_embed_init_std)  # record #89, T:1261
        self.embed2 = nn.Embedding(rows, cfg.model_dim) if cfg.second_embed else None  # N(0, 1), M L1079
        bigram_dim = cfg.bigram_dim or cfg.model_dim
        self.bigram_embed = nn.Embedding(cfg.bigram_vocab_size, bigram_dim) if cfg.bigram_vocab_size else None
        if self.bigram_embed is not None:
            nn.init.zeros_(self.bigram_embed.weight)  # the record: the table starts empty
        self.register_buffer("bigram_signs", bigram_sign_table(bigram_dim) if cfg.bigram_sign else None,
                             persistent=False)
        self.blocks = nn.ModuleList(Block(cfg, i, self.roles) for i in range(cfg.n_layer))
        for block in self.blocks:
            block.mlp.fp8 = fp8_mlp and cfg.fp8_mlp
        self.skips = unet_skips(cfg) if cfg.unet_skips else ()  # (from, into) block pairs, by their target
        plain_skips = cfg.unet_skips and not cfg.skip_sigmoid
        self.skip_weights = nn.Parameter(torch.ones(len(self.skips))) if plain_skips else None
        self.skip_lambdas = (nn.Parameter(torch.full((len(self.skips),), SKIP_LAMBDA_INIT))
                             if cfg.unet_skips and cfg.skip_sigmoid else None)
        self.skip_gate = nn.Parameter(torch.zeros(len(self.skips), cfg.gate_dims)) if cfg.skip_gates else None
        self.smear_gate = nn.Parameter(torch.zeros(1, cfg.gate_dims)) if cfg.smear else None
        self.smear_lambda = nn.Parameter(torch.zeros(1)) if cfg.smear else None  # the record: no smear at first
        self.backout_lambda = nn.Parameter(torch.tensor([BACKOUT_LAMBDA_INIT])) if cfg.backout else None
        self.lm_head = CastedLinear(cfg.model_dim, next_multiple(cfg.vocab_size, 128), zero_init=cfg.zero_init,
                                    fp8=fp8_kernels, fp8_scales=FP8_HEAD_SCALES[cfg.fp8_head_scales])
        if cfg.head_init_std:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=cfg.head_init_std)  # M L1073
        self.embed_from_head = False  # track 2 (M L1148-1152): tokens are looked up in the head's weight while tied
        self.init_streams(cfg)

    def init_streams(self, cfg: ModelConfig) -> None:
        """Record #89's stream parameters, at the model's level (Adam's, not Muon's): the sublayers' r and p (T:1334,
        T:1338), the gate generators (T:1436-1466) and MUDD (T:1367-1396), the first of each pair of maps from x0
        (pre) or the last block's input (MUDD), the second from the gate block's or the final stream."""
        self.streamed = bool(cfg.sublayer_lambdas or cfg.attention_cache_block or cfg.mudd_gate_block or cfg.mudd)
        n, dim = cfg.n_layer, cfg.model_dim
        self.resid_lambdas = nn.Parameter(torch.full((n, 2), RESID_LAMBDA_INIT)) if cfg.sublayer_lambdas else None
        self.post_lambdas = nn.Parameter(torch.ones(n, 2)) if cfg.sublayer_lambdas else None
        self.gate_columns = gate_columns(cfg, self.roles, self.skips) if cfg.mudd_gate_block else ({}, {})
        self.gate_widths = tuple(max((sl.stop for sl in side.values()), default=0) for side in self.gate_columns)
        width = max(self.gate_widths)
        gated = bool(cfg.mudd_gate_block)
        self.mudd_gate_w1 = nn.Parameter(kaiming_rows(2, MUDD_DIM, dim)) if gated else None
        self.mudd_gate_w2 = nn.Parameter(torch.zeros(2, width, MUDD_DIM)) if gated else None
        self.mudd_gate_b2 = (nn.Parameter(torch.stack([gate_bias(side, width) for side in self.gate_columns]))
                             if gated else None)
        self.mudd_gate_scale = nn.Parameter(torch.tensor(GATE_SCALE_INIT)) if gated else None
        self.mudd_w1 = nn.Parameter(kaiming_rows(2, MUDD_DIM, dim)) if cfg.mudd else None
        self.mudd_w2 = nn.Parameter(torch.zeros(2, MUDD_BLOCK_COEFS, MUDD_DIM)) if cfg.mudd else None
        exit_bias = torch.zeros(MUDD_BLOCK_COEFS)
        exit_bias[1] = -BACKOUT_LAMBDA_INIT / MUDD_SCALE  # T:1394: the backout of h7, -0.5
        self.mudd_b2 = nn.Parameter(torch.stack([mudd_block_bias(), exit_bias])) if cfg.mudd else None

    def forward(self, tokens: Tensor, targets: Tensor, windows: Tensor, mtp_weights: Tensor | None = None) -> Tensor:
        """Mean cross-entropy of one flat sequence (T,) of documents. windows: the (long, short) window
        sizes in blocks, a (2,) tensor from the schedule (attention_windows). mtp_weights (training only):
        the weights of the next 1, 2, ... tokens' losses (mtp_loss_weights), then with a prefix table (LossPath's
        prefix_tokens) the prefix token's (stage_loss_weights); none: the next token's alone."""
        if tokens.numel() % BLOCK_SIZE:
            raise UsageError(f"sequence length {tokens.numel()} is not a multiple of the {BLOCK_SIZE}-token block")
        if not torch.compiler.is_compiling():
            check_model_inputs(tokens, targets, windows, self.vocab_size)
        if mtp_weights is not None:
            targets = self.loss_targets(targets, mtp_weights.numel())
        # M's training form (bf16 logits, summed) in training mode; validation (eval) takes the fp32 mean (of the
        # bf16 softcap with --bf16_val_softcap)
        form = (LossForm(self.config.bf16_train_logits, self.config.loss_sum) if self.training
                else LossForm(bf16_softcap=self.config.bf16_val_softcap))
        # Validation (eval, no grad) too: its 262K-token sequence would otherwise hold 26 GB of bf16 logits.
        if self.loss.chunked or not (self.training or torch.is_grad_enabled()):
            return chunked_head_loss(self.final_hidden(tokens, windows)[0], self.lm_head.weight, targets,
                                     self.softcap, self.loss.chunk, mtp_weights, form)
        if mtp_weights is not None:
            return multi_token_cross_entropy(self.logits(tokens, windows), targets, mtp_weights, self.softcap, form)
        return self.loss.full(self.logits(tokens, windows), targets, self.softcap, form)

    def loss_targets(self, targets: Tensor, n_weights: int) -> Tensor:
        """(T,) next-token targets -> (T, n_weights) columns: the next tokens (multi_token_targets), then with a
        prefix table the next token's prefix token (record #89, T:1686), scored by the same logits."""
        if self.prefix_table is None:
            return multi_token_targets(targets, n_weights, self.config.cross_document_shifts)
        columns = multi_token_targets(targets, n_weights - 1, self.config.cross_document_shifts)
        return torch.cat([columns, prefix_targets(targets, self.prefix_table)[:, None]], dim=1)

    def logits(self, tokens: Tensor, windows: Tensor) -> Tensor:
        """Head outputs (1, T, padded vocab) before the softcap: the forward pass without the loss."""
        return self.lm_head(self.final_hidden(tokens, windows))

    def final_hidden(self, tokens: Tensor, windows: Tensor) -> Tensor:
        """The normed residual stream (1, T, model_dim) the head reads."""
        return rms_norm(self.trunk(tokens, self.layer_attention(tokens, windows)))

    def layer_attention(self, tokens: Tensor, windows: Tensor) -> list:
        """Each layer's attention: the backend with the layer's window mask, over paired positions for
        paired-head layers (each kind of mask built once)."""
        kinds = list(zip(layer_windows((0, 1), self.roles), self.roles.paired_heads))
        exact = self.config.token_exact_windows
        masks = {(which, paired): self.backend.build_mask(paired_tokens(tokens) if paired else tokens, windows[which],
                                                          exact=exact)
                 for which, paired in dict.fromkeys(kinds)}
        return [attention_with(self.backend, masks[kind]) for kind in kinds]

    def trunk(self, tokens: Tensor, layer_attention: list, offset: int = 0) -> Tensor:
        """Embeddings through every block (value embeddings, x0 mixing, U-net skips): the residual stream."""
        if self.streamed:
            return self.stream_trunk(tokens, layer_attention, offset)
        # where smear and the key offset stop: document starts, or (M) the sequence's start alone
        doc_start = None if self.config.cross_document_shifts else tokens == EOT_TOKEN
        ve = [emb(tokens)[None] for emb in self.value_embeds]
        x = x0 = self.embedded(tokens, doc_start)
        x02 = rms_norm(self.embed2(tokens)[None]) if self.embed2 is not None else None  # M L1164
        bigram = self.bigram_vector(tokens, x.size(-1))
        into = {b: j for j, (_, b) in enumerate(self.skips)}
        sources, saved, backout = {a for a, _ in self.skips}, {}, None
        for i, block in enumerate(self.blocks):
            if i == self.roles.backout_layer:
                backout = x
            if i in into:
                x = x + self.skip_weight(into[i], x0) * saved[self.skips[into[i]][0]]
            ve_i = self.roles.value_embed[i]
            x = block(x, x0, None if ve_i is None else ve[ve_i], layer_attention[i], offset, doc_start, bigram, x02)
            if i in sources:
                saved[i] = x
        if backout is not None:
            x = x - self.backout_lambda[0] * backout
        return x

    def embedded(self, tokens: Tensor, doc_start: Tensor | None) -> Tensor:
        """x0: the token embeddings (from the head's weight while tied), smeared, rms-normed, (1, T, model_dim)."""
        x = (F.embedding(tokens, self.lm_head.weight).type_as(self.embed.weight) if self.embed_from_head
             else self.embed(tokens))[None]
        if self.smear_gate is not None:
            x = smear(x, self.smear_lambda[0] * sigmoid_gate(x, self.smear_gate), doc_start)
        return rms_norm(x)

    def bigram_vector(self, tokens: Tensor, width: int) -> Tensor | None:
        """The signed bigram embedding of each position, (1, T, width), in the first bigram_dim dims; None without
        the table."""
        if self.bigram_embed is None:
            return None
        across = self.config.cross_document_shifts
        bigram = self.bigram_embed(bigram_rows(tokens, self.bigram_embed.num_embeddings, across))[None]
        if self.bigram_signs is not None:
            bigram = bigram * self.bigram_signs[bigram_sign_rows(tokens, across)].type_as(bigram)
        return F.pad(bigram, (0, width - bigram.size(-1)))  # into the stream's first bigram_dim dims

    def stream_trunk(self, tokens: Tensor, layer_attention: list, offset: int = 0) -> Tensor:
        """Record #89's stream (T:1530-1680; docs/track1-record-fidelity.md section 4.1): per-token gates from x0
        and from the stream entering --mudd_gate_block, x0 and bigram injected after attention, per-sublayer r and
        p, the blocks after --attention_cache_block attending over its stream, MUDD on the last block and after."""
        doc_start = None if self.config.cross_document_shifts else tokens == EOT_TOKEN
        ve = [emb(tokens)[None] for emb in self.value_embeds]
        x0 = self.embedded(tokens, doc_start)
        x02 = rms_norm(self.embed2(tokens)[None]) if self.embed2 is not None else None
        bigram = self.bigram_vector(tokens, x0.size(-1))
        gates = self.gates_from(x0, 0)
        x = c0 = x0 if ("bigram", 0) not in gates else x0 + gates[("bigram", 0)] * bigram  # T:1562: cache 0
        docs = document_ids(tokens) if any(self.roles.dc) else None
        into = {b: j for j, (_, b) in enumerate(self.skips)}
        saved: dict = {"c0": c0}
        for i, block in enumerate(self.blocks):
            if i == self.config.mudd_gate_block:
                gates.update(self.gates_from(x, 1))  # T:1580-1589
            if i in into:
                x = x + self.skip_weight(into[i], x0, gates) * saved[self.skips[into[i]][0]]
            given = self.sublayer_inputs(i, x0, bigram, gates, saved, docs)
            ve_i = self.roles.value_embed[i]
            if self.config.mudd and i == len(self.blocks) - 1:
                x, given = self.mudd_block_entry(x, given, saved, bigram)
            x = block.sublayers(x, given, None if ve_i is None else ve[ve_i], layer_attention[i], offset, doc_start,
                                (x0, bigram, x02))
            saved[i] = x
        return self.mudd_exit(x, saved, ve) if self.config.mudd else x

    def gates_from(self, x: Tensor, j: int) -> dict:
        """Gate generator j's (0: pre, 1: post) per-token coefficients, s_g (G2 GELU(G1 x) + c) (T:1468-1470), as
        {(kind, block or skip): (1, T, width)}; empty without the generators."""
        if self.mudd_gate_w1 is None:
            return {}
        width = self.gate_widths[j]
        hidden = F.gelu(F.linear(x, self.mudd_gate_w1[j].type_as(x)))  # exact (erf) GELU
        out = F.linear(hidden, self.mudd_gate_w2[j, :width].type_as(x)) + self.mudd_gate_b2[j, :width].type_as(x)
        out = out * self.mudd_gate_scale.type_as(x)
        return {key: out[..., where] for key, where in self.gate_columns[j].items()}

    def sublayer_inputs(self, i: int, x0: Tensor, bigram: Tensor | None, gates: dict, saved: dict,
                        docs: Tensor | None) -> SublayerInputs:
        """Block i's r and p, its attention input (rms of the cached stream after the cache block), its x0 and
        bigram injections (the bigram's of block 0 went into c0, T:1639) and its attention's gates."""
        r = p = (1.0, 1.0)
        if self.resid_lambdas is not None:
            r, p = tuple(self.resid_lambdas[i].type_as(x0)), tuple(self.post_lambdas[i].type_as(x0))
        cache = self.config.attention_cache_block
        attn_in = rms_norm(saved[cache]) if cache and i > cache else None
        injected = None
        if ("x0", i) in gates:
            injected = x0 * gates[("x0", i)]
            if ("bigram", i) in gates and i != 0:
                injected = injected + gates[("bigram", i)] * bigram
        extras = AttnExtras(dc=(gates[("dc1", i)], gates[("dc2", i)]) if ("dc1", i) in gates else None, docs=docs,
                            xsa_alpha=gates.get(("xsa", i)), output_gate=gates.get(("output_gate", i)))
        return SublayerInputs(r, p, attn_in, injected, extras)

    def mudd_coefficients(self, x: Tensor, j: int, n: int) -> tuple[Tensor, ...]:
        """MUDD map j's first n per-token coefficients, 0.1 (W2 GELU(W1 x) + b) (T:1398-1401), each (1, T, 1)."""
        hidden = F.gelu(F.linear(x, self.mudd_w1[j].type_as(x)))
        mu = (F.linear(hidden, self.mudd_w2[j, :n].type_as(x)) + self.mudd_b2[j, :n].type_as(x)) * MUDD_SCALE
        return mu.split(1, dim=-1)

    def mudd_block_entry(self, h9: Tensor, given: SublayerInputs, saved: dict, bigram: Tensor | None):
        """The last block's MUDD (T:1601-1610, T:1634-1636, T:1662-1663) from the stream entering it, h9: the new
        stream (1 + mu5) h9 + mu3 c0 + mu4 h7, the value term mu0 c0 + mu1 h7 + mu2 h9 with the value-embedding gate
        mu6 (first half of the heads) / mu7 (second half), and the sublayers' r, p and injections from mu8-mu13."""
        mu = self.mudd_coefficients(h9, 0, MUDD_BLOCK_COEFS)
        c0, h7 = saved["c0"], saved[self.config.attention_cache_block]
        saved["h9"] = h9
        half = self.config.n_head // 2
        ve_gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(half, dim=-1)
        extras = given.extras._replace(ve_gate=ve_gate, v_extra=mu[0] * c0 + mu[1] * h7 + mu[2] * h9)
        injected = mu[10] * c0 if bigram is None else mu[10] * c0 + mu[11] * bigram
        x = (1 + mu[5]) * h9 + mu[3] * c0 + mu[4] * h7
        return x, given._replace(resid=(mu[8], mu[12]), post=(mu[9], mu[13]), injected=injected, extras=extras)

    def mudd_exit(self, x: Tensor, saved: dict, ve: list[Tensor]) -> Tensor:
        """After the last block (T:1677-1680): x + nu0 c0 + nu1 h7 + nu2 h9 + nu3 ve0 + nu4 h3, h3 the skip's source
        and ve0 the first value table."""
        nu = self.mudd_coefficients(x, 1, MUDD_EXIT_COEFS)
        sources = (saved["c0"], saved[self.config.attention_cache_block], saved["h9"], ve[0].type_as(x),
                   saved[self.skips[0][0]])
        for n, source in zip(nu, sources):
            x = x + n * source
        return x

    def skip_weight(self, j: int, x0: Tensor, gates: dict | None = None) -> Tensor:
        """Skip j's weight: its learned weight, or sigmoid of its lambda (--skip_sigmoid, M L1179), times the gate
        2 * sigmoid(W_j x0[:gate_dims]) with --skip_gates, or record #89's per-token skip gate (T:1593-1594)."""
        weight = torch.sigmoid(self.skip_lambdas[j]) if self.skip_lambdas is not None else self.skip_weights[j]
        if gates and ("skip", j) in gates:
            return weight * gates[("skip", j)]
        if self.skip_gate is None:
            return weight
        return weight * NEUTRAL_GATE_SCALE * sigmoid_gate(x0, self.skip_gate[j:j + 1])

    @property
    def decodes_from_history(self) -> bool:
        """Whether a technique reads the token before or interleaves positions (Technique.reads_previous_token):
        the KV cache cannot extend those, so decode() runs the whole history instead."""
        return any(t.is_on(self.config) for t in TECHNIQUES if t.reads_previous_token)

    @torch.no_grad()
    def decode(self, tokens: Tensor, cache: "KVCache") -> Tensor:
        """Head outputs (padded vocab) after the last of tokens (n,), which continue the cached sequence.

        The same modules and weights as logits(); each attention layer reads its keys and values
        from the cache, so a new token costs O(window) instead of a pass over the whole prefix.
        """
        start = cache.extend(tokens)
        if self.decodes_from_history:
            history = cache.tokens[:cache.length]
            padded = F.pad(history, (0, -cache.length % BLOCK_SIZE), value=EOT_TOKEN)  # later tokens: no effect
            return self.logits(padded, cache.window_pair)[0, cache.length - 1]
        x = self.trunk(tokens, [cache.layer(i) for i in range(len(self.blocks))], offset=start)
        return self.lm_head(rms_norm(x[0, -1]))

    @property
    def context_len(self) -> int:
        """Positions the rotary tables cover: the longest sequence the model can take."""
        return self.config.max_seq_len

    yarn_changes_applied = 0  # how many of yarn_state's changes the rotary tables and scales hold (follow_yarn)

    def set_yarn(self, freqs: Tensor, scale: float, changes: int) -> None:
        """Every attention layer's rotary tables rebuilt for freqs and its softmax scale set (yarn_state). The scale
        is a Python float, as M's softmax_scale: a compiled model recompiles once for each new value."""
        for block in self.blocks:
            if block.attn is not None:
                block.attn.rotary.set_frequencies(freqs)
                block.attn.scale = scale
        self.yarn_changes_applied = changes

    # What a caller outside training (evaluation.py, tools/) builds its inputs with: every document starts with
    # eot_token, a sequence is whole blocks, and windows are (long, short) pairs of blocks.
    eot_token = EOT_TOKEN
    block_size = BLOCK_SIZE

    def window(self, windows: tuple[int, int]) -> Tensor:
        """The windows input for a (long, short) pair of attention_windows, on the model's device."""
        return torch.tensor(windows, dtype=torch.int64, device=self.embed.weight.device)

    def kv_cache(self, windows: tuple[int, int], max_len: int | None = None) -> "KVCache":
        """An empty cache for decode() with a (long, short) pair of attention_windows."""
        return KVCache(self, self.window(windows), max_len)

    def softcapped(self, logits: Tensor) -> Tensor:
        """Head outputs as the loss sees them: fp32, through the model's softcap."""
        return apply_softcap(logits, self.softcap)

    def flops_per_token(self, windows: tuple[int, int], seq_len: int) -> float:
        """Model FLOPs of one training token, forward and backward, as MFU counts them (PaLM, arXiv 2204.02311,
        appendix B): 6 per weight of every matrix product, and 12 per attended key and attention channel for the
        scores and the weighted values, each attention layer attending to its window (in whole blocks, one key
        more with --token_exact_windows; at most the sequence). Embedding lookups, norms, gates' elementwise work
        and the loss are left out."""
        tables = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        weights = sum(p.numel() for p in self.parameters() if p.ndim >= 2 and id(p) not in tables)
        extra = 1 if self.config.token_exact_windows else 0  # key q - 128 * w is seen too
        keys = sum(min(BLOCK_SIZE * window + extra, seq_len)
                   for window, attends in zip(layer_windows(windows, self.roles), self.roles.attention)
                   if attends)
        return 6 * weights + 12 * self.config.n_head * self.config.head_dim * keys


class KVCache:
    """Keys and values of every attention layer for one growing sequence: GPT.decode's attention.

    Each layer's attention (layer()) stores its new keys and values at their absolute positions, and the new
    queries attend to the cached ones that attention_allowed admits (causal, same document, within the
    layer's long or short window), exactly as in the full forward.
    """

    def __init__(self, model: GPT, windows: Tensor, max_len: int | None = None):
        self.max_len = model.context_len if max_len is None else max_len
        if self.max_len > model.context_len:
            raise UsageError(f"a cache of {self.max_len} positions exceeds the model's {model.context_len}-token "
                             "context")
        device = model.embed.weight.device
        windows = self.window_pair = windows.to(device)
        self.windows = layer_windows(windows, model.roles)
        self.window_sizes = [int(w) for w in self.windows]  # host copies: no device sync per token
        self.exact = model.config.token_exact_windows
        self.keys: list[Tensor | None] = [None] * len(model.blocks)
        self.values: list[Tensor | None] = [None] * len(model.blocks)
        self.docs = torch.zeros(self.max_len, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(self.max_len, dtype=torch.int64, device=device)  # GPT.decodes_from_history
        self.start, self.length = 0, 0

    def extend(self, tokens: Tensor) -> int:
        """Appends tokens' document ids; returns the position of the first one."""
        n = tokens.numel()
        if self.length + n > self.max_len:
            raise RunFailed(f"sequence of {self.length + n} tokens exceeds the cache's {self.max_len} positions")
        previous = self.docs[self.length - 1] if self.length else 0
        self.docs[self.length:self.length + n] = previous + document_ids(tokens)
        self.tokens[self.length:self.length + n] = tokens
        self.start, self.length = self.length, self.length + n
        return self.start

    def layer(self, layer: int):
        """Layer's attention, attend(q, k, v, scale), reading and extending this cache."""
        return lambda q, k, v, scale: self.attend(q, k, v, layer, scale)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float) -> Tensor:
        if self.keys[layer] is None:
            self.keys[layer] = k.new_zeros(1, self.max_len, *k.shape[2:])
            self.values[layer] = v.new_zeros(1, self.max_len, *v.shape[2:])
        self.keys[layer][:, self.start:self.length] = k
        self.values[layer][:, self.start:self.length] = v
        window = self.windows[layer]
        first = first_key_in_window(self.start, self.window_sizes[layer], self.exact)  # the new queries' oldest key
        q_idx = torch.arange(self.start, self.length, device=q.device)[:, None]
        kv_idx = torch.arange(first, self.length, device=q.device)[None, :]
        mask = attention_allowed(self.docs, q_idx, kv_idx, window, self.exact)
        return dense_attention(q, self.keys[layer][:, first:self.length], self.values[layer][:, first:self.length],
                                    mask, scale)


class Softcap(typing.NamedTuple):
    """The head's logit squash, cap * sigmoid((z + offset) / temperature); a cap of 0 leaves logits as they are.
    R: 30 * sigmoid(z / 7.5). 2025-12-26_LogitRescale: 23 * sigmoid((z + 5) / 7.5), asymmetric about 0."""
    cap: float
    temperature: float = 7.5
    offset: float = 0.0


class LossForm(typing.NamedTuple):
    """How the training loss is taken (validation always takes the default): on bf16 logits (M L1204-1221: the
    softcap, logsumexp and cross-entropy in bf16), and summed over the tokens rather than averaged (M L1213-1221)."""
    bf16_logits: bool = False
    summed: bool = False
    bf16_softcap: bool = False  # record #89's validation (T:1689-1691): the softcap in bf16, the cross-entropy fp32


def apply_softcap(logits: Tensor, softcap: Softcap, keep_dtype: bool = False) -> Tensor:
    """fp32 logits squashed into (0, cap); keep_dtype: in the logits' own dtype (bf16 training logits)."""
    logits = logits if keep_dtype else logits.float()
    if softcap.cap > 0:
        shifted = logits + softcap.offset if softcap.offset else logits
        logits = softcap.cap * torch.sigmoid(shifted / softcap.temperature)
    return logits


def token_losses(capped: Tensor, targets: Tensor) -> Tensor:
    """logsumexp(z) - z[target] of softcapped logits (rows, V) against each column of targets (rows, K), in the
    logits' dtype as M computes it on bf16 logits (L1216-1217); 0 where a target is ignored (-100)."""
    valid = targets != -100
    lse = torch.logsumexp(capped, dim=-1, keepdim=True)
    return torch.where(valid, lse - capped.gather(1, torch.where(valid, targets, 0)), 0.0)


def softcapped_cross_entropy(logits: Tensor, targets: Tensor, softcap: Softcap, form: LossForm = LossForm()) -> Tensor:
    """Mean (form.summed: summed) cross-entropy of the softcapped fp32 (form.bf16_logits: bf16) logits."""
    if form.bf16_logits:
        losses = token_losses(apply_softcap(logits, softcap, keep_dtype=True).view(-1, logits.size(-1)),
                              targets.view(-1, 1)).float()
        return losses.sum() if form.summed else losses.sum() / (targets != -100).sum().clamp_min(1)
    logits = apply_softcap(logits, softcap)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                           reduction="sum" if form.summed else "mean")


def multi_token_targets(targets: Tensor, n: int, across_documents: bool = False) -> Tensor:
    """(T,) next-token targets -> (T, n): column k is the token k+1 places after the next, ignored (-100)
    past the sequence's end and once a document has ended (an EOT target) before it; across_documents
    (--cross_document_shifts, M L1213-1218): only past the sequence's end."""
    columns, ended = [targets], torch.zeros_like(targets, dtype=torch.bool)
    for k in range(1, n):
        if not across_documents:
            ended = ended | (columns[-1] == EOT_TOKEN)
        later = F.pad(targets[k:], (0, k), value=-100)
        columns.append(torch.where(ended, -100, later))
    return torch.stack(columns, dim=1)


PREFIX_TABLE = REPO_DIR / "data" / "gpt2_prefix_tokens.npy"  # its one writer: python -m data.prefix_tokens
PREFIX_TABLE_ROWS = 50304  # every id of the head's padded vocabulary
MERGEABLE_TOKENS = 50256  # GPT-2's BPE tokens: no prefix token is EOT (50256) or past it


def load_prefix_table(path: Path = PREFIX_TABLE) -> np.ndarray:
    """The committed prefix-token table (int32, one entry per padded-vocabulary id), checked: a missing or damaged
    file is one line naming the command that rebuilds it."""
    remedy = "rebuild it with python -m data.prefix_tokens"
    try:
        table = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"--prefix_loss_weight reads the prefix-token table {path}, which is missing; "
                         f"{remedy}") from None
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"the prefix-token table {path} is not a .npy file ({type(e).__name__}); {remedy}") from None
    if table.shape != (PREFIX_TABLE_ROWS,) or table.dtype != np.int32:
        raise UsageError(f"the prefix-token table {path} holds {table.dtype} {table.shape}, not int32 "
                         f"({PREFIX_TABLE_ROWS},); {remedy}")
    if table.min() < -1 or table.max() >= MERGEABLE_TOKENS or (table == np.arange(PREFIX_TABLE_ROWS)).any():
        raise UsageError(f"the prefix-token table {path} holds ids outside -1 .. {MERGEABLE_TOKENS - 1} or a token "
                         f"as its own prefix; {remedy}")
    return table


def prefix_token_table(vocab_size: int) -> Tensor:
    """record #89 (T:1175-1198, T:2317): each token id's longest proper-prefix token, -1 for none, from the committed
    table (the trainer has no tokenizer); ids past vocab_size count as none (K:1069)."""
    committed = torch.from_numpy(load_prefix_table().astype(np.int64))
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    rows = min(vocab_size, len(committed))
    table[:rows] = committed[:rows]
    return torch.where(table < vocab_size, table, -1)


def prefix_targets(targets: Tensor, table: Tensor) -> Tensor:
    """The prefix token of each next-token target (K:1066-1069), -100 (ignored) where it has none."""
    prefix = table[targets.clamp_min(0)]
    return torch.where((targets >= 0) & (prefix >= 0), prefix, -100)


def multi_token_cross_entropy(logits: Tensor, targets: Tensor, weights: Tensor, softcap: Softcap,
                              form: LossForm = LossForm()) -> Tensor:
    """2025-12-22_MultiTokenPrediction: sum_k weights[k] * (mean cross-entropy of column k of targets), every
    column scored by the same softcapped logits (the record sums the weighted losses, it does not average them).
    form.summed: sum_k weights[k] * (summed cross-entropy of column k) (M L1219); form.bf16_logits: on bf16
    logits."""
    counts = (targets != -100).sum(0).clamp_min(1)
    if form.bf16_logits:
        capped = apply_softcap(logits, softcap, keep_dtype=True).view(-1, logits.size(-1))
        sums = token_losses(capped, targets).float().sum(0)
    else:
        capped = apply_softcap(logits, softcap).view(-1, logits.size(-1))
        sums = torch.stack([F.cross_entropy(capped, targets[:, k], reduction="sum") for k in range(targets.size(1))])
    return (sums * weights).sum() if form.summed else (sums / counts * weights).sum()


HEAD_CHUNK_ROWS = 512  # rows of fp32 logits alive at once in the chunked head + loss (at least)
MAX_HEAD_CHUNKS = 32  # longer sequences (GPU validation: 262K tokens) take bigger chunks, not more of them


def head_chunks(n_rows: int) -> list[slice]:
    """The row ranges the chunked head + loss takes one at a time."""
    size = max(HEAD_CHUNK_ROWS, -(-n_rows // MAX_HEAD_CHUNKS))
    return [slice(lo, lo + size) for lo in range(0, n_rows, size)]


def softcapped_cross_entropy_chunk(logits: Tensor, targets: Tensor, softcap: Softcap, scales: Tensor,
                                   with_grad: bool, bf16_logits: bool = False,
                                   bf16_softcap: bool = False) -> tuple[Tensor, Tensor | None]:
    """softcapped_cross_entropy of some rows against each column of targets (rows, K), summed per column
    (not averaged), and in closed form the gradient of sum_k scales[k] * (column k's sum) to the logits.

    The gradient is cast to the logits' dtype as autograd would. With one column and scales = 1 / count it is
    d(mean loss)/d(logits) = (softmax - onehot) / count, times cap * s' / temperature. bf16_logits: the loss is
    the plain path's on bf16 logits (token_losses), and the gradient's softmax is taken from its bf16 softcapped
    logits and logsumexp, as autograd's would be. bf16_softcap: the softcap alone in the logits' dtype.
    """
    z = logits.float()
    sig = (torch.sigmoid((z + softcap.offset if softcap.offset else z) / softcap.temperature)
           if softcap.cap > 0 else None)
    valid = targets != -100  # cross_entropy's ignore_index
    if bf16_logits:
        low = apply_softcap(logits, softcap, keep_dtype=True)
        loss_sums = token_losses(low, targets).float().sum(0)
        capped, lse = low.float(), torch.logsumexp(low, dim=-1, keepdim=True).float()
    else:
        capped = (apply_softcap(logits, softcap, keep_dtype=True).float() if bf16_softcap
                  else softcap.cap * sig if softcap.cap > 0 else z)
        lse = torch.logsumexp(capped, dim=-1, keepdim=True)
        picked = capped.gather(1, torch.where(valid, targets, 0))
        loss_sums = torch.stack([torch.where(valid[:, k], (lse - picked)[:, k], 0.0).sum()
                                 for k in range(targets.size(1))])
    if not with_grad:
        return loss_sums, None
    if targets.size(1) == 1:  # the reference's expression, bit for bit
        onehot = torch.arange(capped.size(-1), device=capped.device)[None, :] == targets
        grad = (torch.exp(capped - lse) - onehot.float()) * (valid.float() * scales)
    else:  # softmax * sum_k c_k - sum_k c_k * onehot_k, with c_k = scales[k] where the target counts
        coef = valid.float() * scales
        grad = torch.exp(capped - lse) * coef.sum(1, keepdim=True)
        grad = grad.scatter_add(1, torch.where(valid, targets, 0), -coef)
    if softcap.cap > 0:
        grad = grad * (softcap.cap * sig * (1 - sig) / softcap.temperature)
    return loss_sums, grad.to(logits.dtype)


class ChunkedHeadLoss(torch.autograd.Function):
    """lm_head matmul + softcapped cross-entropy, a chunk of rows at a time (the CPU path).

    Same math as softcapped_cross_entropy(F.linear(h, weight.type_as(h))) (multi_token_cross_entropy for
    several target columns), but only one chunk of fp32 logits exists at a time: each chunk's gradient is
    computed in the forward (closed form) and kept in h's dtype, as the plain path's bf16 logits would be;
    backward is then two matmuls.
    """

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, softcap: Softcap, kernel, weights: Tensor,
                form: LossForm) -> Tensor:
        w = weight.type_as(h)
        counts = (targets != -100).sum(0).clamp_min(1)
        scales = weights if form.summed else weights / counts.float()
        grad_logits = h.new_empty(h.size(0), w.size(0))
        totals = torch.zeros(targets.size(1), dtype=torch.float32, device=h.device)
        for rows in head_chunks(h.size(0)):
            loss_sums, grad_logits[rows] = kernel(F.linear(h[rows], w), targets[rows], softcap, scales, True,
                                                  form.bf16_logits, form.bf16_softcap)
            totals += loss_sums
        ctx.save_for_backward(h, w, grad_logits)
        ctx.weight_dtype = weight.dtype
        return (totals * weights).sum() if form.summed else (totals / counts * weights).sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        h, w, grad_logits = ctx.saved_tensors
        scale = grad_loss.to(h.dtype)
        grad_h = (grad_logits @ w) * scale if ctx.needs_input_grad[0] else None
        grad_w = (grad_logits.T @ h).to(ctx.weight_dtype) * grad_loss if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None


def chunked_head_loss(h: Tensor, weight: Tensor, targets: Tensor, softcap: Softcap, kernel,
                      weights: Tensor | None = None, form: LossForm = LossForm()) -> Tensor:
    """Mean (form.summed: summed) softcapped cross-entropy of F.linear(h, weight) against targets (T,) or (T, K)
    (each column weighted by weights, as multi_token_cross_entropy) without ever holding all fp32 logits."""
    targets = targets[:, None] if targets.dim() == 1 else targets
    weights = torch.ones(1, device=h.device) if weights is None else weights
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedHeadLoss.apply(h, weight, targets, softcap, kernel, weights, form)
    w = weight.type_as(h)
    counts = (targets != -100).sum(0).clamp_min(1)
    totals = torch.zeros(targets.size(1), dtype=torch.float32, device=h.device)
    for rows in head_chunks(h.size(0)):
        totals += kernel(F.linear(h[rows], w), targets[rows], softcap, counts, False, form.bf16_logits,
                         form.bf16_softcap)[0]
    return (totals * weights).sum() if form.summed else (totals / counts * weights).sum()


@dataclass(frozen=True)
class LossPath:
    """How GPT turns the head's output into the loss: the softcapped cross-entropy kernels (compiled or not),
    and whether training too goes through the chunked head, which never holds all fp32 logits (the CPU's
    choice: Runtime.chunked_loss). Validation always does."""
    full: typing.Callable = softcapped_cross_entropy
    chunk: typing.Callable = softcapped_cross_entropy_chunk
    chunked: bool = False
    prefix_tokens: bool = False  # --prefix_loss_weight: the model holds the prefix table; its weight comes last

    @staticmethod
    def compiled(chunked: bool, prefix_tokens: bool = False) -> "LossPath":
        return LossPath(torch.compile(softcapped_cross_entropy, dynamic=False),
                        torch.compile(softcapped_cross_entropy_chunk, dynamic=False), chunked, prefix_tokens)


def check_model_inputs(tokens: Tensor, targets: Tensor, windows: Tensor, vocab_size: int) -> None:
    """Eager-mode guards that would otherwise surface as a wrong mask, a trained padding logit or a
    device-side assert. Targets may hold -100, cross_entropy's ignore index. The value checks run on CPU
    tensors only: on a GPU each would wait for the device, and the trainer's inputs were checked on the
    host already (load_shard's vocabulary check, StepTensors' windows)."""
    if windows.shape != (2,):
        raise ValueError(f"windows must be the (long, short) pair of window sizes, got shape {tuple(windows.shape)}")
    if tokens.device.type != "cpu":
        return
    if int(windows.min()) < 1:
        raise UsageError(f"attention window of {int(windows.min())} blocks is below one {BLOCK_SIZE}-token block")
    top = int(tokens.max())
    if top >= vocab_size or int(tokens.min()) < 0:
        raise UsageError(f"token id {top if top >= vocab_size else int(tokens.min())} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if int(targets.max()) >= vocab_size:
        raise UsageError(f"target id {int(targets.max())} is outside the vocabulary [0, {vocab_size})")


# record #89 (T:2249-2254): MUDD weights and biases stored bf16 (the gates' learned scale stays fp32)
BF16_MUDD_PARAMETERS = ("mudd_w1", "mudd_w2", "mudd_b2", "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2")


def build_model(args: Hyperparameters, rt: Runtime) -> GPT:
    """The model on its device: embeddings in the activation dtype, matrices and scalars in fp32."""
    prefix = args.prefix_loss_weight > 0
    loss = (LossPath.compiled(rt.chunked_loss, prefix) if rt.compile == "loss"
            else LossPath(chunked=rt.chunked_loss, prefix_tokens=prefix))
    fp8_kernels = ("inductor" if rt.compile_fp8 else "eager") if rt.fp8_head else None
    model = GPT(ModelConfig.of(args), attention=rt.attention, compile_attention=rt.compile_attention,
                fp8_kernels=fp8_kernels, loss=loss, fp8_mlp=rt.fp8_mlp).to(rt.device)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.to(rt.dtype)
    if not args.adam_master:  # track 2 (M L1702-1704): the head and the gates too, which its Adam updates in place;
        for name, p in model.named_parameters():  # record #89 (T:2249-2254): and MUDD's weights and biases
            if name == "lm_head.weight" or name.endswith("_gate") or name in BF16_MUDD_PARAMETERS:
                p.data = p.data.to(rt.dtype)
    quantize_mlp_fp8(model, bootstrap=True)  # T:2258: the initial weights' scales
    return model


def quantize_mlp_fp8(model: nn.Module, bootstrap: bool) -> None:
    """The FP8 MLPs' scales after an optimizer step (MLP.quantize_fp8); nothing without --fp8_mlp."""
    for module in model.modules():
        if isinstance(module, MLP) and hasattr(module, "fp8_up_scale"):
            module.quantize_fp8(bootstrap)


# -----------------------------------------------------------------------------
# Optimizers: Muon's and Adam's update math on what each rank owns (the gradient's path: the next section)

def quintic_iterations(G: Tensor, coefficients: list[tuple[float, float, float]], norm_scale: float,
                       eps: float) -> Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, once per (a, b, c), in bf16 on the wide orientation of G,
    after dividing G by its Frobenius norm (times norm_scale) so that every singular value starts <= 1."""
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def newton_schulz(G: Tensor, steps: int = 5) -> Tensor:
    """R's quintic Newton-Schulz iteration pushing every singular value of G towards 1.

    The coefficients trade exactness for speed: singular values land in a band around 1
    (about [0.68, 1.13] for inputs that are not nearly singular), not on 1 exactly.
    """
    return quintic_iterations(G, [(3.4445, -4.7750, 2.0315)] * steps, 1.0, 1e-7)


# 2025-09-29_PolarExpress (Amsel et al., arXiv 2505.16932): each iteration's quintic is the minimax-optimal
# one for the singular-value interval the previous ones leave, so 5 iterations land much closer to 1.
POLAR_EXPRESS_COEFFICIENTS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def polar_express(G: Tensor, steps: int = 5) -> Tensor:
    """Polar Express orthogonalisation; the record divides by 1.02 x the norm as a safety margin for bf16."""
    return quintic_iterations(G, POLAR_EXPRESS_COEFFICIENTS[:steps], 1.02, 1e-6)


class Muon:
    """MomentUm Orthogonalized by Newton-Schulz, for the hidden matrices.

    Rank r owns matrix r of each bucket: it keeps that matrix's momentum and orthogonalises its
    update; the bf16 updates are all-gathered and every rank applies all of them (as the record does:
    half the bytes of gathering fp32 weights, and the same fp32 arithmetic on every rank).
    """

    def __init__(self, buckets: list[Bucket], rank: int, lr: float, ns_steps: int, names: dict[Tensor, str],
                 orthogonalize=None, normuon_beta2: float | None = None, cautious_wd: float = 0.0,
                 lr_muls: dict[Tensor, float] | None = None, per_row: typing.Collection[Tensor] = (),
                 head_pair_rows: dict[Tensor, int] | None = None):
        self.buckets, self.rank, self.base_lr, self.ns_steps = buckets, rank, lr, ns_steps
        self.orthogonalize = orthogonalize or newton_schulz
        self.normuon_beta2, self.cautious_wd = normuon_beta2, cautious_wd
        # Each matrix's lr (and decay) multiplier: the record's max(1, rows/cols)**0.5 on its own shape by default.
        self.lr_muls = {p: (lr_muls or {}).get(p, shape_lr_multiplier(p.shape)) for b in buckets for p in b.real}
        self.index_of = {names[b.params[rank]]: i for i, b in enumerate(buckets) if b.params[rank] is not None}
        self.momentum_buffers = {i: torch.zeros_like(self.owned(i)) for i in self.index_of.values()}
        per_row_ids = {id(p) for p in per_row}
        # record #89 (T:1272-1285): a qkv_w listed here is Muon's 2(H/2) Q and K head-pair matrices and one V
        self.group_rows = {i: rows for p, rows in (head_pair_rows or {}).items()
                           for i in self.index_of.values() if self.owned(i) is p}
        self.second_moments = ({i: self.new_second_moment(i, id(self.owned(i)) in per_row_ids)
                                for i in self.index_of.values()} if normuon_beta2 is not None else {})

    def matrices(self, i: int, t: Tensor) -> list[Tensor]:
        """Owned matrix i (or a tensor shaped like it) as the batches of matrices Muon orthogonalises on their own:
        itself (a 3-dim qkv_w is already Q, K and V), or its head pairs' groups."""
        return [t] if i not in self.group_rows else head_pair_matrices(t, self.group_rows[i])

    def new_second_moment(self, i: int, per_row: bool) -> Tensor:
        """NorMuon's state of owned matrix i: one tensor, flat over its groups' per-neuron moments if it has groups
        (one state tensor per matrix keeps the checkpoint's names)."""
        if i not in self.group_rows:
            return neuron_second_moment(self.owned(i), per_row)
        return torch.cat([neuron_second_moment(m).flatten() for m in self.matrices(i, self.owned(i))])

    def second_moment_views(self, i: int) -> list[Tensor]:
        """Matrix i's NorMuon state as one view per group of matrices (NorMuon updates them in place)."""
        if i not in self.group_rows:
            return [self.second_moments[i]]
        shapes = [neuron_second_moment(m).shape for m in self.matrices(i, self.owned(i).data)]
        views = self.second_moments[i].split([math.prod(shape) for shape in shapes])
        return [v.view(shape) for v, shape in zip(views, shapes, strict=True)]

    def orthogonalized(self, i: int, m: Tensor) -> Tensor:
        """Owned matrix i's momentum-smoothed gradient m orthogonalised per group (then NorMuon, if on)."""
        updates = [self.orthogonalize(g, self.ns_steps) for g in self.matrices(i, m)]
        if self.normuon_beta2 is not None:
            updates = [normuon_normalize(u, s, self.normuon_beta2)
                       for u, s in zip(updates, self.second_moment_views(i), strict=True)]
        return updates[0] if len(updates) == 1 else torch.cat([u.flatten() for u in updates]).view_as(m)

    def owned(self, i: int) -> nn.Parameter | None:
        return self.buckets[i].params[self.rank]

    def step(self, sync: GradientSync, scale: float, lr_mult: float, momentum: float) -> list:
        """Updates owned matrices and starts the all-gathers; returns them for finish_step."""
        lr = self.base_lr * lr_mult
        gathers = []
        for i, bucket in enumerate(self.buckets):
            grad = sync.wait(bucket, scale)
            p = self.owned(i)
            if p is not None:
                buf = self.momentum_buffers[i]
                grad = grad.view_as(p).to(buf.dtype)  # a bf16 gate (track 2) keeps bf16 momentum, as M does
                buf.lerp_(grad, 1 - momentum)
                update = self.orthogonalized(i, grad.lerp_(buf, momentum))  # Nesterov
            if bucket.world_size == 1:
                self._apply(p, update, lr, self.cautious_wd, self.lr_muls[p])
                continue
            if p is not None:
                bucket.gather_in.copy_(update.flatten())
            gathers.append((bucket, all_gather_into(bucket), lr, self.cautious_wd, self.lr_muls))
        return gathers

    @staticmethod
    def finish_step(gathers: list) -> None:
        for bucket, work, lr, wd, lr_muls in gathers:
            work.wait()
            for j, p in enumerate(bucket.params):
                if p is not None:
                    update = bucket.gather_out[j * bucket.shard_numel:(j + 1) * bucket.shard_numel]
                    Muon._apply(p, update, lr, wd, lr_muls[p])

    @staticmethod
    def _apply(p: Tensor, update: Tensor, lr: float, cautious_wd: float, lr_mul: float | None = None) -> None:
        lr_mul = shape_lr_multiplier(p.shape) if lr_mul is None else lr_mul
        update = update.view_as(p).to(p.dtype)
        if cautious_wd:  # 2025-11-10_CautiousWD: the decay (lr * wd) joins the update where their signs agree
            update = update + (lr * cautious_wd) * cautious_mask(update, p.data) * p.data
        p.data.sub_((lr * lr_mul) * update)

    def state_tensors(self) -> dict[str, Tensor]:
        """The momenta (and NorMuon's second moments) of the matrices this rank owns, as muon/<parameter name>
        (normuon/<name>): which rank owns a matrix depends on the world size, its state's name does not."""
        return {**{f"muon/{name}": self.momentum_buffers[i] for name, i in self.index_of.items()},
                **{f"normuon/{name}": self.second_moments[i] for name, i in self.index_of.items()
                   if i in self.second_moments}}


def head_pair_matrices(qkv: Tensor, rows: int) -> list[Tensor]:
    """A (3, H * D, dim) qkv_w-shaped tensor as record #89's Muon groups (T:1272-1285): Q's and then K's head pairs,
    (2 * H/2, rows = 2D, dim), and V whole (1, H * D, dim); views, in qkv's element order."""
    return [qkv[:2].reshape(-1, rows, qkv.size(-1)), qkv[2:]]


def cautious_mask(update: Tensor, param: Tensor) -> Tensor:
    """Where the step (param -= lr * update) and the decay pull the weight the same way (sign agreement,
    zero included, as the records have it); elsewhere decaying would fight the gradient."""
    return (update * param >= 0).to(param.dtype)


def shape_lr_multiplier(shape: typing.Sequence[int]) -> float:
    """The record's Muon lr multiplier of a matrix stored as `shape`: max(1, rows/cols)**0.5."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def neuron_second_moment(p: Tensor, per_row: bool = False) -> Tensor:
    """NorMuon's fp32 state: one mean square per row of a tall or square matrix, per column of a wide one;
    per row always for a gate (track 2, M L614-619: one per head)."""
    shape = (*p.shape[:-1], 1) if per_row or p.size(-2) >= p.size(-1) else (*p.shape[:-2], 1, p.size(-1))
    return torch.zeros(shape, dtype=torch.float32, device=p.device)


def normuon_normalize(update: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """2025-10-24_NorMuon: after orthogonalisation the rows of a wide matrix (columns of a tall one) have
    equal norms, the neurons along its long side do not. Their mean squares are averaged over steps
    (second_moment, updated in place) and divided out, then the update gets its Frobenius norm back."""
    u = update.float()
    per_row = second_moment.size(-1) == 1 and second_moment.size(-2) == u.size(-2)  # its shape says which
    second_moment.lerp_(u.square().mean(dim=-1 if per_row else -2, keepdim=True), 1 - beta2)
    normed = u * second_moment.clamp_min(1e-10).rsqrt()
    norm, normed_norm = u.norm(dim=(-2, -1), keepdim=True), normed.norm(dim=(-2, -1), keepdim=True)
    return normed * (norm / normed_norm.clamp_min(1e-10))


@dataclass
class AdamGroup:
    """One parameter's Adam settings."""
    param: nn.Parameter
    lr: float
    weight_decay: float = 0.0  # decoupled (AdamW)
    cautious_wd: float = 0.0  # 2025-12-18_CautiousWDAdam: lr * wd, only where update and weight agree in sign
    betas: tuple[float, float] | None = None  # None: the optimizer's


def adam_slots(buckets: list[Bucket], names: dict[Tensor, str]) -> tuple[list, list[Tensor], list[str]]:
    """Each Adam parameter's (bucket, parameter, offset of its slice in the bucket's shard), with the parameters
    and their names in that order: the layout both Adams keep their per-parameter state in."""
    slots = [(bucket, p, offset) for bucket in buckets for p, offset in zip(bucket.real, bucket.offsets)]
    params = [p for _, p, _ in slots]
    return slots, params, [names[p] for p in params]


class ShardedAdam:
    """Adam for the rank-owned slice of each parameter, on an fp32 master copy of that slice.

    The update itself is torch's fused AdamW (decoupled weight decay, zero for most groups)
    over the master slices; the new slices are cast to the parameter dtype and all-gathered. Every master is
    fed and read at its parameter's offset in its bucket, so several small parameters share one bucket.
    """

    def __init__(self, buckets: list[Bucket], groups: dict[Tensor, AdamGroup], rank: int,
                 betas: tuple[float, float], eps: float, names: dict[Tensor, str]):
        self.buckets, self.rank = buckets, rank
        # One master per parameter: its slice sits at offset in the bucket's shard (Bucket.offsets).
        self.slots, self.params, self.names = adam_slots(buckets, names)
        self.masters = [owned_slice(p, rank, bucket.world_size).float().clone() for bucket, p, _ in self.slots]
        param_groups = [dict(params=[master], lr=groups[p].lr, base_lr=groups[p].lr,
                             weight_decay=groups[p].weight_decay, cautious_wd=groups[p].cautious_wd,
                             betas=groups[p].betas or betas) for master, p in zip(self.masters, self.params)]
        fused = all(m.device.type in ("cpu", "cuda") for m in self.masters)
        self.adam = torch.optim.AdamW(param_groups, betas=betas, eps=eps, fused=fused)

    def step(self, sync: GradientSync, scale: float, lr_mult: float, frozen: typing.Collection[Tensor] = ()) -> list:
        """Updates the master slices (not those of frozen parameters: no gradient, step or decay) and starts the
        all-gathers; returns them for finish_step."""
        shards = {id(bucket): sync.wait(bucket, scale) for bucket in self.buckets if sync.launches(bucket)}
        for (bucket, p, offset), master in zip(self.slots, self.masters):
            master.grad = None if p in frozen else shards[id(bucket)][offset:offset + master.numel()]
        for group in self.adam.param_groups:
            group["lr"] = group["base_lr"] * lr_mult
            if group["cautious_wd"] and group["params"][0].grad is not None:
                self._cautious_decay(group)
        self.adam.step()
        for (bucket, p, offset), master in zip(self.slots, self.masters):
            master.grad = None
            if bucket.world_size == 1:
                p.data.view(-1).copy_(master)
            else:
                bucket.gather_in[offset:offset + master.numel()].copy_(master)
        return [(bucket, all_gather_into(bucket)) for bucket in self.buckets
                if bucket.world_size > 1 and sync.launches(bucket)]

    @staticmethod
    def finish_step(gathers: list) -> None:
        for bucket, work in gathers:
            work.wait()
            bucket.copy_gathered()

    def _cautious_decay(self, group: dict) -> None:
        """master -= lr * (lr * wd) * master where this step's Adam update has the master's sign. That sign
        is the new first moment's (Adam divides it by positive numbers), so it is known before the step,
        and the decay can be applied before AdamW, whose update does not depend on the weight."""
        master = group["params"][0]
        exp_avg = self.adam_state(master)["exp_avg"]
        new_exp_avg = exp_avg.lerp(master.grad, 1 - group["betas"][0])
        master.sub_((group["lr"] * group["lr"] * group["cautious_wd"]) * cautious_mask(new_exp_avg, master) * master)

    def adam_state(self, master: Tensor) -> dict[str, Tensor]:
        """AdamW's state of a master slice, created as AdamW would create it (zeros, step 0) if it has not
        stepped yet, so that a checkpoint has one layout whenever it is taken."""
        state = self.adam.state[master]
        if not state:
            fused = self.adam.defaults["fused"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device if fused else "cpu")
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(master), torch.zeros_like(master)
        return state

    def param_state(self, p: Tensor) -> dict[str, Tensor]:
        """p's master slice and AdamW state (exp_avg, exp_avg_sq slices and the step count)."""
        master = next(m for q, m in zip(self.params, self.masters) if q is p)
        return {"master": master, **self.adam_state(master)}

    def state_tensors(self) -> dict[str, Tensor | FlatShard]:
        """adam/<parameter name>/<master|exp_avg|exp_avg_sq|step>: the slices as pieces of the flat
        parameter, which any world size can cut again; the step count is the same on every rank."""
        return adam_state_tensors(self.names, self.params, [self.param_state(p) for p in self.params])


def adam_state_tensors(names: list[str], params: list[Tensor], states: list[dict[str, Tensor]]) -> dict:
    """adam/<name>/<key> for each parameter's state: its slices as FlatShards of the flat parameter, the step as is."""
    return {f"adam/{name}/{key}": x if key == "step" else FlatShard(x, p.numel())
            for name, p, state in zip(names, params, states) for key, x in state.items()}


class RecordAdam:
    """Track 2's DistAdam (2025-12-31_BulkSmallTrackTransfer, M L700-830): each rank updates its slice of every
    parameter in place, in the parameter's dtype (bf16 for the head, embeddings and gates), with no fp32 master;
    the moments are bf16 too (record #89's: fp32, moment_dtype). The step is M's: lr * sqrt(1 - b2^t) / (1 - b1^t)
    * m / (sqrt(v) + eps), and the cautious decay joins it where update * p > 0 (strict). The arithmetic runs in
    fp32 and is rounded once when stored, as M's compiled step does."""

    def __init__(self, buckets: list[Bucket], groups: dict[Tensor, AdamGroup], rank: int,
                 betas: tuple[float, float], eps: float, names: dict[Tensor, str],
                 moment_dtype: torch.dtype = torch.bfloat16):
        self.buckets, self.rank, self.eps = buckets, rank, eps
        self.slots, self.params, self.names = adam_slots(buckets, names)
        self.groups = [dataclasses.replace(groups[p], betas=groups[p].betas or betas) for p in self.params]
        self.states = []
        for bucket, p, _ in self.slots:
            moment = torch.zeros_like(owned_slice(p, rank, bucket.world_size), dtype=moment_dtype)
            self.states.append({"exp_avg": moment, "exp_avg_sq": torch.zeros_like(moment),
                                "step": torch.zeros((), dtype=torch.float32)})  # on the host: M's int

    def step(self, sync: GradientSync, scale: float, lr_mult: float, frozen: typing.Collection[Tensor] = ()) -> list:
        """Updates this rank's slices in place (not those of frozen parameters) and starts the all-gathers."""
        shards = {id(bucket): sync.wait(bucket, scale) for bucket in self.buckets if sync.launches(bucket)}
        for (bucket, p, offset), group, state in zip(self.slots, self.groups, self.states):
            piece = owned_slice(p, self.rank, bucket.world_size)
            if p not in frozen:
                state["step"] += 1
                record_adam_update(piece, shards[id(bucket)][offset:offset + piece.numel()], state,
                                   group.lr * lr_mult, group.betas, self.eps, group.cautious_wd)
            if bucket.world_size > 1:
                bucket.gather_in[offset:offset + piece.numel()].copy_(piece)
        return [(bucket, all_gather_into(bucket)) for bucket in self.buckets
                if bucket.world_size > 1 and sync.launches(bucket)]

    finish_step = ShardedAdam.finish_step

    def param_state(self, p: Tensor) -> dict[str, Tensor]:
        return next(state for q, state in zip(self.params, self.states) if q is p)

    def state_tensors(self) -> dict[str, Tensor | FlatShard]:
        """adam/<parameter name>/<exp_avg|exp_avg_sq|step>, as ShardedAdam's (which adds the master)."""
        return adam_state_tensors(self.names, self.params, self.states)


def record_adam_update(p: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float, betas: tuple[float, float],
                       eps: float, cautious_wd: float) -> None:
    """M L806-829 on one slice p (updated in place) with its state (moments stored in their dtype, step already
    counted): the decay lr * (lr * wd) * p joins the update where update * p > 0."""
    b1, b2 = betas
    t = state["step"].double()  # a host tensor read as M's Python number, never .item(): fake tensors run it too
    m = state["exp_avg"].float().mul(b1).add_(grad, alpha=1 - b1)  # new tensors: fp32 moments stay the state's
    v = state["exp_avg_sq"].float().mul(b2).addcmul_(grad, grad, value=1 - b2)
    state["exp_avg"].copy_(m)
    state["exp_avg_sq"].copy_(v)
    update = m.div_(v.sqrt_().add_(eps)).mul_(lr * ((1 - b2 ** t) ** 0.5 / (1 - b1 ** t)))
    weight = p.float()
    if cautious_wd:
        update.addcmul_(weight, (update * weight > 0).float(), value=lr * cautious_wd * lr)
    p.copy_(weight.sub_(update))


def owned_slice(p: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank's slice of p flattened: torch.chunk's split (ceil(numel / world_size) each), as FlatShard records it."""
    flat, chunk = p.data.view(-1), -(-p.numel() // world_size)
    lo = min(rank * chunk, flat.numel())
    return flat[lo:min(lo + chunk, flat.numel())]


# -----------------------------------------------------------------------------
# The gradient's path: hooks -> buckets -> reduce-scatter -> optimizer step -> all-gather
#
# build_optimizers sorts the parameters into buckets: Muon's matrices world_size of one shape to a bucket, each
# large Adam parameter alone, and all the small ones (scalars, gates, lambdas) in one bucket. In backward, a hook
# on each parameter counts its bucket's gradients; the last one launches the bucket's reduce-scatter
# (GradientSync), so that rank r receives the summed segment r of the bucket. Optimizers.step waits for each
# bucket's segment, Muon or Adam updates what the rank owns (whole matrices; a slice of every parameter), and
# all-gathers the result, which every rank copies into its parameters. A step issues one reduce-scatter and one
# all-gather per bucket; bucket_summary says how many there are, in the run log's header.

class Bucket:
    """Parameters whose summed gradient is reduce-scattered as one flat tensor, with its persistent buffers.

    The flat tensor is world_size segments of shard_numel elements, and rank r receives segment r. A Muon bucket
    (kind "muon") holds world_size same-shape matrices (None pads the last one): segment r is matrix r, whole. An
    Adam bucket holds one parameter ("adam") or all the small ones ("small"): segment r holds slice r of each
    (owned_slice), parameter i's at offsets[i], so the per-element math is that of one bucket per parameter.
    The communication buffers live as long as the bucket, so a step allocates nothing for them.
    """

    def __init__(self, params: list[nn.Parameter | None], kind: str, world_size: int):
        self.params, self.kind, self.world_size = params, kind, world_size
        self.real = [p for p in params if p is not None]
        ref = self.real[0]
        self.chunks = [p.numel() if self.muon else -(-p.numel() // world_size) for p in self.real]
        self.offsets = [0] * len(self.chunks) if self.muon else [sum(self.chunks[:i]) for i in range(len(self.chunks))]
        self.shard_numel = self.chunks[0] if self.muon else sum(self.chunks)
        self.ready = 0
        self.work = None
        self.shard: Tensor | None = None
        # Reduce-scatter input: a copy only where the gradient is not already one flat tensor.
        needs_copy = (not self.muon and len(self.real) > 1 or
                      world_size > 1 and (self.muon or self.shard_numel * world_size != ref.numel()))
        self.grads_in = ref.new_zeros(self.shard_numel * world_size) if needs_copy else None
        self.grad_out = ref.new_empty(self.shard_numel) if world_size > 1 else None
        # All-gather buffers: Muon sends bf16 updates (as the record does), Adam the parameter's dtype.
        gather_dtype = torch.bfloat16 if self.muon else ref.dtype
        self.gather_in = ref.new_zeros(self.shard_numel, dtype=gather_dtype) if world_size > 1 else None
        self.gather_out = ref.new_empty(self.shard_numel * world_size, dtype=gather_dtype) if world_size > 1 else None

    @property
    def muon(self) -> bool:
        return self.kind == "muon"

    def numel(self) -> int:
        """The elements of its parameters (without padding)."""
        return sum(p.numel() for p in self.real)

    def segments(self, flat: Tensor) -> Tensor:
        """flat (world_size * shard_numel elements) as one row per rank's segment."""
        return flat.view(self.world_size, self.shard_numel)

    def flat_grads(self) -> Tensor:
        """The gradients to reduce, flattened; a missing gradient or padding slot counts as zero."""
        if self.grads_in is None:
            g = self.real[0].grad
            return torch.zeros(self.shard_numel * self.world_size, device=self.real[0].device,
                               dtype=self.real[0].dtype) if g is None else g.view(-1)
        if self.muon:
            for j, p in enumerate(self.params):  # matrix j in slot j
                if p is not None:
                    dest = self.grads_in[j * p.numel():(j + 1) * p.numel()]
                    dest.zero_() if p.grad is None else dest.copy_(p.grad.view(-1))
            return self.grads_in
        rows = self.segments(self.grads_in)
        for p, offset, chunk in zip(self.real, self.offsets, self.chunks):  # slice r of each into segment r
            if p.grad is None:
                rows[:, offset:offset + chunk].zero_()
            else:
                copy_slices(p.grad.view(-1), rows, offset, chunk, into_rows=True)
        return self.grads_in

    def copy_gathered(self) -> None:
        """An Adam bucket's all-gathered slices into its parameters."""
        rows = self.segments(self.gather_out)
        for p, offset, chunk in zip(self.real, self.offsets, self.chunks):
            copy_slices(p.data.view(-1), rows, offset, chunk, into_rows=False)


def copy_slices(flat: Tensor, rows: Tensor, offset: int, chunk: int, into_rows: bool) -> None:
    """Between a flat parameter (or gradient) and its slices, slice r at rows[r, offset:offset + chunk]: the
    whole slices in one copy, then the shorter last one."""
    whole = flat.numel() // chunk
    pairs = [(flat[:whole * chunk].view(whole, chunk), rows[:whole, offset:offset + chunk])]
    if flat.numel() > whole * chunk:
        pairs.append((flat[whole * chunk:], rows[whole, offset:offset + flat.numel() - whole * chunk]))
    for param_side, row_side in pairs:
        row_side.copy_(param_side) if into_rows else param_side.copy_(row_side)


def muon_buckets(matrices: list[nn.Parameter], world_size: int) -> list[Bucket]:
    """The hidden matrices, world_size of one shape to a bucket (rank r orthogonalises matrix r)."""
    by_shape: dict[tuple, list] = {}
    for p in matrices:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    buckets = []
    for same in by_shape.values():
        same = same + [None] * (-len(same) % world_size)
        buckets += [Bucket(same[i:i + world_size], "muon", world_size) for i in range(0, len(same), world_size)]
    return buckets


def adam_buckets(params: list[nn.Parameter], small: list[nn.Parameter], world_size: int) -> list[Bucket]:
    """Each large parameter alone; the small ones together (one bucket per dtype), where the first of them stands:
    one collective for all of them instead of one each."""
    small_ids = {id(p) for p in small}
    groups: dict[object, list] = {}
    for p in params:
        groups.setdefault(p.dtype if id(p) in small_ids else id(p), []).append(p)
    return [Bucket(ps, "small" if id(ps[0]) in small_ids else "adam", world_size) for ps in groups.values()]


def bucket_summary(buckets: list[Bucket], world_size: int) -> str:
    """One line for the run log's header: how many buckets (collectives per step) of each kind, and their sizes."""
    def size(n: int) -> str:
        return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n / 1e3:.1f}K" if n >= 10**3 else str(n)
    kinds = []
    for kind in ("muon", "adam", "small"):
        sizes = sorted(b.numel() for b in buckets if b.kind == kind)
        if sizes:
            span = size(sizes[0]) if size(sizes[0]) == size(sizes[-1]) else f"{size(sizes[0])}-{size(sizes[-1])}"
            kinds.append(f"{kind} {len(sizes)} x {span}")
    return f"gradient buckets: {len(buckets)} on {world_size} rank(s) ({', '.join(kinds)} elements)"


class GradientSync:
    """Reduce-scatters each bucket's gradient as early as the autograd engine allows.

    Eager backward (CPU, --compile=loss/off): each bucket is launched from post-accumulate-grad hooks
    the moment its last gradient is ready, so communication overlaps the rest of backward.
    Compiled model (--compile=model): AOTAutograd runs the whole backward as one graph node, and the
    AccumulateGrad nodes (and their hooks) run only after it returns, in one burst (bench/overlap_probe.py
    shows it on CPU). There is no backward left to overlap, so no hooks are registered: finish() launches
    every bucket in the order the optimizers consume them, and the update math of the first buckets
    overlaps the transfer of the later ones. Only the last micro-step of an accumulation step communicates.
    """

    def __init__(self, buckets: list[Bucket], world_size: int, launch_from_hooks: bool = True):
        self.buckets, self.world_size = buckets, world_size
        self.armed = False
        self.idle: set[int] = set()  # buckets left alone this step (their gradients kept, not reduced)
        self.bucket_of = {p: b for b in buckets for p in b.real}
        self.launched: set[int] = set()
        if launch_from_hooks:
            for p in self.bucket_of:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def arm(self, last_micro_step: bool, idle: typing.Collection[Bucket] = ()) -> None:
        self.armed = last_micro_step
        self.idle = {id(b) for b in idle}

    def launches(self, bucket: Bucket) -> bool:
        """Whether this step reduces the bucket (not idle)."""
        return id(bucket) not in self.idle

    def _on_grad_ready(self, p: Tensor) -> None:
        bucket = self.bucket_of[p]
        if not self.armed or not self.launches(bucket):
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.real):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        flat = bucket.flat_grads()
        if self.world_size == 1:
            bucket.shard = flat
        else:
            bucket.shard = bucket.grad_out
            bucket.work = TORCH_API.reduce_scatter_flat(bucket.shard, flat, op=dist.ReduceOp.SUM, async_op=True)
        self.launched.add(id(bucket))

    def finish(self) -> None:
        """Launches the buckets not launched yet (all of them without hooks; else those without a gradient)."""
        for bucket in self.buckets:
            if id(bucket) not in self.launched and self.launches(bucket):
                self._launch(bucket)
        self.armed = False

    def wait(self, bucket: Bucket, scale: float) -> Tensor:
        """This rank's summed gradient shard for the bucket, in fp32, times scale."""
        if bucket.work is not None:
            bucket.work.wait()
        shard = bucket.shard.float() * scale
        bucket.work, bucket.shard, bucket.ready = None, None, 0
        return shard

    def reset(self) -> None:
        self.launched.clear()
        self.idle = set()


def gather_flat(piece: Tensor, numel: int, world_size: int) -> Tensor:
    """The whole flat tensor of numel elements whose owned_slice on each rank is piece (all-gathered)."""
    if world_size == 1:
        return piece
    chunk = -(-numel // world_size)
    padded = piece.new_zeros(chunk)
    padded[:piece.numel()].copy_(piece)
    whole = piece.new_empty(chunk * world_size)
    TORCH_API.all_gather_flat(whole, padded)
    return whole[:numel]


def all_gather_into(bucket: Bucket):
    """Starts the all-gather of every rank's bucket.gather_in into bucket.gather_out."""
    return TORCH_API.all_gather_flat(bucket.gather_out, bucket.gather_in, async_op=True)


@dataclass
class Optimizers:
    sync: GradientSync
    muon: Muon | None
    adam: ShardedAdam | RecordAdam
    world_size: int
    adam_every: int = 1  # track 2: Adam steps on every adam_every-th step, on the gradients summed since its last
    frozen: set = dataclasses.field(default_factory=set)  # parameters Adam leaves alone (a tied embedding)
    adam_now: bool = True  # whether Adam steps at the current step (start_step)
    held_accum: int | None = None  # the micro-steps the gradients Adam holds were summed over, if it holds any

    def start_step(self, step: int, accum: int) -> None:
        """Before step's first backward: whether Adam steps now; held gradients (summed over held_accum micro-steps)
        are rescaled to this step's accum, so that each step's gradient enters the sum as its own mean."""
        self.adam_now = (step + 1) % self.adam_every == 0
        if self.held_accum is not None and self.held_accum != accum:
            for p in self.adam.params:
                if p.grad is not None:
                    p.grad.mul_(accum / self.held_accum)
        self.held_accum = None if self.adam_now else accum

    def arm(self, last_micro_step: bool) -> None:
        """Before each backward: Adam's buckets (all of them between its steps, a frozen one always) stay idle."""
        idle = [b for b in self.adam.buckets if not self.adam_now or all(p in self.frozen for p in b.real)]
        self.sync.arm(last_micro_step, idle)

    def step(self, lr_mult: float, momentum: float, accum: int) -> None:
        """Muon first (its Newton-Schulz overlaps Adam's reduce-scatters), then Adam; the all-gathers
        of both are awaited last, so they overlap the other optimizer's math. The gradients summed over
        ranks and accum micro-steps are divided by the sequence count, which makes them a mean."""
        self.sync.finish()
        scale = 1.0 / (self.world_size * accum)
        muon_gathers = self.muon.step(self.sync, scale, lr_mult, momentum) if self.muon else []
        adam_gathers = self.adam.step(self.sync, scale, lr_mult, self.frozen) if self.adam_now else []
        Muon.finish_step(muon_gathers)
        ShardedAdam.finish_step(adam_gathers)
        self.sync.reset()

    def zero_grad(self, model: nn.Module) -> None:
        """Fresh gradients for the next step, except the ones Adam holds until its next step."""
        if self.adam_now:
            model.zero_grad(set_to_none=True)  # R: the next backward writes fresh gradients, no zeroing kernels
            return
        held = {id(p) for p in self.adam.params}
        for p in model.parameters():
            if id(p) not in held:
                p.grad = None

    def untie(self, head: nn.Parameter, embed: nn.Parameter) -> None:
        """Track 2's split (M L770-779): the embedding takes the head's weight (its first rows) and the head's
        Adam state, moments and step count alike, and Adam updates it from now on."""
        rows = embed.size(0)
        with torch.no_grad():
            embed.copy_(head[:rows])
            source, target = self.adam.param_state(head), self.adam.param_state(embed)
            for key, x in target.items():
                if key == "step":
                    x.copy_(source[key])
                else:  # the head's slices are not the embedding's when their row counts differ
                    whole = gather_flat(source[key], head.numel(), self.world_size)[:embed.numel()]
                    x.copy_(owned_slice(whole, self.adam.rank, self.world_size))
        self.frozen.discard(embed)

    def state_tensors(self) -> dict[str, Tensor | FlatShard]:
        """Every optimizer tensor this rank holds, aliasing the live ones, under world-size-free names."""
        return {**self.adam.state_tensors(), **(self.muon.state_tensors() if self.muon else {})}


MUON_GATES = ("attn_gate", "ve_gate")  # track 2 trains these in Muon (M L949-957); the smear and skip gates in Adam
RECORD_C_PROJ_LR_MUL = 2.0  # M L1001: the MLP's output projection's lr_mul


def record_stored_shape(name: str, p: Tensor, cfg: ModelConfig, qk_head_pairs: bool = False) -> tuple[int, int]:
    """The shape M stores a hidden matrix in, which its Muon lr multiplier reads (M L633-649): Q, K, V and O in
    one (4 * model_dim, heads * head_dim) matrix (M L940), both MLP matrices as (4 * model_dim, model_dim).
    With qk_head_pairs, record #89's banks (T:1272-1285): Q and K head pairs (2 * head_dim, model_dim), V and O
    (heads * head_dim, heads * head_dim), so every attention matrix gets max(1, rows/cols)**0.5 = 1."""
    if qk_head_pairs and name.endswith("attn.qkv_w"):
        return 2 * cfg.head_dim, cfg.model_dim
    if qk_head_pairs and name.endswith("attn.c_proj.weight"):
        return p.shape[-1], p.shape[-2]
    if name.endswith("attn.qkv_w") or name.endswith("attn.c_proj.weight"):
        return 4 * cfg.model_dim, cfg.n_head * cfg.head_dim
    if name.endswith("mlp.c_proj.weight"):
        return p.shape[-1], p.shape[-2]  # stored transposed (M L996-997)
    return p.shape[-2], p.shape[-1]


def muon_lr_multipliers(model: GPT, args: Hyperparameters, muon_params: list[Tensor]) -> dict[Tensor, float]:
    """Each Muon matrix's lr (and decay) multiplier: max(1, rows/cols)**0.5 on its own shape; with
    record_muon_shapes on M's stored shape, times M's lr_mul (2 on the MLP's c_proj; the gates' muon_gate_lr_mul)."""
    out = {}
    for name, p in model.named_parameters():
        if not any(p is q for q in muon_params):
            continue
        shape = (record_stored_shape(name, p, model.config, args.muon_qk_head_pairs) if args.record_muon_shapes
                 else p.shape)
        lr_mul = RECORD_C_PROJ_LR_MUL if args.record_muon_shapes and name.endswith("mlp.c_proj.weight") else 1.0
        if name.endswith(MUON_GATES) and args.muon_gates:
            lr_mul = args.muon_gate_lr_mul
        out[p] = shape_lr_multiplier(shape) * lr_mul
    return out


def head_pair_rows(model: GPT, args: Hyperparameters) -> dict[Tensor, int]:
    """With --muon_qk_head_pairs, each attention's qkv_w and the rows of one head pair's Q (or K) matrix."""
    if not args.muon_qk_head_pairs:
        return {}
    return {p: 2 * model.config.head_dim for name, p in model.named_parameters() if name.endswith("attn.qkv_w")}


def is_x0_lambda(name: str) -> bool:
    """The per-layer weights of the embedding x0 (and of track 2's second embedding x02) in the stream's mix."""
    return name.endswith(("x0_lambda", "x02_lambda"))


# Record #89's stream parameters in Adam (T:2035-2049): (lr_mul on the base lr, which is the head's, betas, decayed).
# MUDD's and the gate generators' matrices decay as the others (lr^2 x adam_cautious_wd); biases, scales and lambdas
# do not (wd_mul 0).
RECORD_STREAM_ADAM = {
    "resid_lambdas": (5.0, (0.9, 0.95), False), "post_lambdas": (1.0, (0.9, 0.95), False),  # T:2035-2036
    "mudd_w1": (0.25, (0.9, 0.99), True), "mudd_w2": (0.25, (0.9, 0.99), True),  # T:2043-2044
    "mudd_b2": (0.25, (0.9, 0.99), False),  # T:2045
    "mudd_gate_w1": (0.1, (0.9, 0.99), True), "mudd_gate_w2": (0.1, (0.9, 0.99), True),  # T:2046-2047
    "mudd_gate_b2": (0.1, (0.9, 0.99), False), "mudd_gate_scale": (0.1, (0.9, 0.99), False),  # T:2048-2049
}


def adam_groups(model: GPT, args: Hyperparameters, in_muon: list[Tensor]) -> list[AdamGroup]:
    """Adam's parameters and settings: the head, the embeddings and the scalars (gates, lambdas) not in Muon, and the
    hidden matrices without Muon. The gates' weights count as scalars, at their technique's gate_lrs share of the
    scalar lr (2025-12-31_GatesToCompiledAdam), unless gate_adam_lr puts them in the main Adam (track 2)."""
    gate_lrs = {name: scale for technique in TECHNIQUES for name, scale in technique.gate_lrs.items()}
    adam_wd = args.adam_cautious_wd if args.cautious_wd else 0.0  # never on the scalars (the record's wd_mul 0)
    scalar_betas = (args.scalar_adam_beta1 if args.scalar_adam_beta1 is not None else args.adam_beta1,
                    args.scalar_adam_beta2 if args.scalar_adam_beta2 is not None else args.adam_beta2)
    main_betas = (args.adam_beta1, args.adam_beta2)
    gate_betas = scalar_betas if args.gate_scalar_betas else main_betas
    table_betas = None if args.table_adam_beta1 is None else (args.table_adam_beta1, args.adam_beta2)
    token_lr = args.embed_lr if args.token_embed_lr is None else args.token_embed_lr
    groups = []
    for name, p in model.named_parameters():
        if any(p is q for q in in_muon):
            continue
        if name in RECORD_STREAM_ADAM:  # record #89's stream, at its own lrs and betas
            lr_mul, betas, decayed = RECORD_STREAM_ADAM[name]
            groups.append(AdamGroup(p, args.head_lr * lr_mul, cautious_wd=adam_wd if decayed else 0.0, betas=betas))
            continue
        if name == "lm_head.weight":
            groups.append(AdamGroup(p, args.head_lr, args.weight_decay, adam_wd * args.head_embed_wd_mul))
        elif name == "embed.weight":
            groups.append(AdamGroup(p, token_lr, cautious_wd=adam_wd * args.head_embed_wd_mul))
        elif name.startswith("value_embeds.") or name.endswith("embed2.weight"):
            groups.append(AdamGroup(p, args.embed_lr, cautious_wd=adam_wd * args.value_embed_wd_mul, betas=table_betas))
        elif name.startswith("bigram_embed."):
            groups.append(AdamGroup(p, args.embed_lr, cautious_wd=adam_wd * args.bigram_wd_mul, betas=table_betas))
        elif name.endswith("ve_gate") and args.ve_gate_lr is not None:
            groups.append(AdamGroup(p, args.ve_gate_lr, cautious_wd=adam_wd, betas=gate_betas))
        elif name.endswith("_gate") and args.gate_adam_lr is not None:
            groups.append(AdamGroup(p, args.gate_adam_lr, betas=gate_betas))
        elif name.endswith("_gate"):
            groups.append(AdamGroup(p, args.scalar_lr * gate_lrs[name.rsplit(".", 1)[-1]], betas=scalar_betas))
        elif is_x0_lambda(name) and args.x0_lambda_lr is not None:
            groups.append(AdamGroup(p, args.x0_lambda_lr, betas=main_betas))
        elif p.ndim < 2:
            groups.append(AdamGroup(p, args.scalar_lr, betas=scalar_betas))
        else:  # a hidden matrix, without Muon
            groups.append(AdamGroup(p, args.matrix_adam_lr, args.weight_decay, adam_wd))
    return groups


def build_optimizers(model: GPT, args: Hyperparameters, rank: int, world_size: int,
                     grad_sync_from_hooks: bool = True, compile_newton_schulz: bool = False) -> Optimizers:
    """Muon for matrices inside the blocks (and, with muon_gates, the attention and value-embedding gates); Adam
    for the rest (adam_groups)."""
    gates = [p for name, p in model.named_parameters() if name.endswith("_gate")]
    muon_gates = [p for name, p in model.named_parameters() if name.endswith(MUON_GATES)] if args.muon_gates else []
    hidden = [p for p in model.blocks.parameters() if p.ndim >= 2 and not any(p is g for g in gates)]
    in_muon = hidden + muon_gates if args.muon else []
    groups = adam_groups(model, args, in_muon)
    stream = [p for name, p in model.named_parameters() if name in RECORD_STREAM_ADAM]  # small, replicated (T:2035)
    small = [g.param for g in groups if g.param.ndim < 2 or any(g.param is q for q in gates + stream)]
    muon_part = muon_buckets(in_muon, world_size)
    adam_part = adam_buckets([g.param for g in groups], small, world_size)
    assert sum(b.numel() for b in muon_part + adam_part) == sum(p.numel() for p in model.parameters())
    # Consumption order (Muon, then Adam): the launch order when the compiled backward leaves no overlap.
    sync = GradientSync(muon_part + adam_part, world_size, launch_from_hooks=grad_sync_from_hooks)
    names = {p: name for name, p in model.named_parameters()}
    # The record compiles Newton-Schulz: its five bf16 iterations fuse into a few kernels per shape.
    orthogonalize = polar_express if args.polar_express else newton_schulz
    orthogonalize = torch.compile(orthogonalize, dynamic=False) if compile_newton_schulz else orthogonalize
    muon = Muon(muon_part, rank, args.muon_lr, args.ns_steps, names, orthogonalize,
                normuon_beta2=args.normuon_beta2 if args.normuon else None,
                cautious_wd=args.muon_cautious_wd if args.cautious_wd else 0.0,
                lr_muls=muon_lr_multipliers(model, args, in_muon), per_row=muon_gates,
                head_pair_rows=head_pair_rows(model, args)) if args.muon else None
    adam_settings = (adam_part, {g.param: g for g in groups}, rank, (args.adam_beta1, args.adam_beta2), args.adam_eps,
                     names)
    adam = (ShardedAdam(*adam_settings) if args.adam_master else
            RecordAdam(*adam_settings, torch.float32 if args.adam_moments_fp32 else torch.bfloat16))
    return Optimizers(sync=sync, muon=muon, adam=adam, world_size=world_size, adam_every=args.adam_every)


# -----------------------------------------------------------------------------
# Schedules

@dataclass(frozen=True)
class BatchSchedule:
    """Global tokens per optimizer step at every step: batch_tokens throughout, or --batch_schedule's stages,
    equal in length (2025-11-29_BatchSizeSchedule: stage int(3 * step / num_iterations)) over the scheduled steps
    (scheduled_steps), the last one on through track 2's extension. Every stage is whole micro-steps of seq_len
    tokens on every rank, so the shapes (and compiled kernels) never change; with --batch_sequences each stage is
    that many sequences of its own length instead (one compile per stage)."""
    stage_tokens: tuple[int, ...]
    stage_accum: tuple[int, ...]  # micro-steps per rank in each stage
    stage_seq_len: tuple[int, ...]  # tokens per sequence (per micro-step) in each stage
    scheduled_steps: int
    batch_tokens: int
    lr_exponent: float
    lr_shares: tuple[float, ...] = ()  # --stage_lr_shares: each stage's lr scale as listed; empty: lr_exponent's
    rounded: bool = False  # --rounded_stages: record #89's stage starts, round(k S / n), for the lr too
    stage_doc_cap: tuple[int, ...] = ()  # --stage_doc_len_caps: each stage's document cap; empty: the loader's

    def stage(self, step: int) -> int:
        return stage_of(step, len(self.stage_tokens), self.scheduled_steps, self.rounded)

    def lr_stage(self, step: int) -> int:
        """The stage whose lr share a step takes (M get_lr): stage k once step / scheduled > k / n, strictly, so it
        starts a step after the batch's stage where k / n lands on a step (M: batch 1175, lr 1176); record #89
        (T:1968-1970): the batch's stage."""
        if self.rounded:
            return self.stage(step)
        n = len(self.stage_tokens)
        return min(max(0, -(-n * step // self.scheduled_steps) - 1), n - 1)

    def doc_cap(self, step: int) -> int | None:
        """The step's document cap under --stage_doc_len_caps (T:1980-1987); None: the loader's --doc_len_cap."""
        return self.stage_doc_cap[self.stage(step)] if self.stage_doc_cap else None

    def tokens(self, step: int) -> int:
        return self.stage_tokens[self.stage(step)]

    def accum(self, step: int) -> int:
        return self.stage_accum[self.stage(step)]

    def seq_len(self, step: int) -> int:
        return self.stage_seq_len[self.stage(step)]

    def lr_scale(self, step: int) -> float:
        """The record scales every lr as batch ** 0.6; batch_tokens' lrs are the base. Track 2: the listed shares."""
        if self.lr_shares:
            return self.lr_shares[self.lr_stage(step)]
        return (self.tokens(step) / self.batch_tokens) ** self.lr_exponent

    def first_step(self, stage: int) -> int:
        return stage_start(stage, len(self.stage_tokens), self.scheduled_steps, self.rounded)

    def tokens_before(self, step: int) -> int:
        """Training tokens of steps 0 .. step-1 (what a validation at `step` has seen), summed stage by stage."""
        starts = [self.first_step(i) for i in range(len(self.stage_tokens))]
        ends = starts[1:] + [step]  # the last stage runs on past num_iterations (a warm-up longer than the run)
        return sum(tokens * max(0, min(step, end) - begin)
                   for tokens, begin, end in zip(self.stage_tokens, starts, ends))


def packed_lengths(args: Hyperparameters) -> list[Fraction]:
    """--batch_sequences: every stage's sequence length, stage tokens / batch_sequences (exact: a stage that does
    not split shows)."""
    fracs = stage_fractions(args.batch_schedule) if args.batch_schedule else [Fraction(1)]
    return [args.batch_tokens * f / args.batch_sequences for f in fracs]


def batch_schedule(args: Hyperparameters, world_size: int) -> BatchSchedule:
    """Every stage's tokens and micro-steps; refuses a world size that cannot split every stage into whole
    sequences per rank, naming the world sizes that can."""
    fracs = stage_fractions(args.batch_schedule) if args.batch_schedule else [Fraction(1)]
    tokens = tuple(int(args.batch_tokens * f) for f in fracs)
    if args.batch_sequences:
        return packed_batch_schedule(args, tokens, world_size)
    sequences = [n // args.seq_len if n % args.seq_len == 0 else 0 for n in tokens]
    if any(n == 0 or n % world_size for n in sequences):
        valid = [w for w in range(1, min(sequences) + 1) if all(n % w == 0 for n in sequences)]
        batch = (f"--batch_tokens={args.batch_tokens}" if len(tokens) == 1
                 else f"the --batch_schedule stages {'/'.join(map(str, tokens))} tokens")
        raise UsageError(f"world size {world_size} cannot split {batch} into sequences of --seq_len={args.seq_len} "
                         f"for every rank; world sizes that work: {valid or 'none (fix the batch size)'}")
    return BatchSchedule(tokens, tuple(n // world_size for n in sequences), (args.seq_len,) * len(tokens),
                         scheduled_steps(args), args.batch_tokens, args.batch_lr_exponent, *stage_options(args))


def stage_options(args: Hyperparameters) -> tuple[tuple[float, ...], bool, tuple[int, ...]]:
    """BatchSchedule's optional per-stage settings: lr shares, the record's rounded starts, document caps."""
    shares = tuple(lr_shares(args.stage_lr_shares)) if args.stage_lr_shares else ()
    caps = tuple(stage_doc_caps(args.stage_doc_len_caps)) if args.stage_doc_len_caps else ()
    return shares, args.rounded_stages, caps


def packed_batch_schedule(args: Hyperparameters, tokens: tuple[int, ...], world_size: int) -> BatchSchedule:
    """--batch_sequences: every step is N sequences of (stage tokens / N), sequence j on rank j % W (M L1351,
    L1718: one buffer per GPU, grad_accum 8 / W); refuses a world size that does not divide N."""
    n = args.batch_sequences
    if n % world_size:
        valid = [w for w in range(1, n + 1) if n % w == 0]
        raise UsageError(f"world size {world_size} cannot split --batch_sequences={n} packed sequences per step "
                         f"evenly over its ranks (the record's one buffer per GPU on {n} GPUs); world sizes that "
                         f"work: {valid}")
    return BatchSchedule(tokens, (n // world_size,) * len(tokens), tuple(t // n for t in tokens),
                         scheduled_steps(args), args.batch_tokens, args.batch_lr_exponent, *stage_options(args))


def lr_multiplier(step: int, num_iterations: int, cooldown_frac: float, final_frac: float) -> float:
    """1 until the cooldown starts, then linear down to final_frac at the last scheduled step (num_iterations: the
    scheduled steps), held there after it (track 2's extension, M get_lr)."""
    if step > num_iterations:
        return final_frac
    progress = step / num_iterations
    if progress < 1 - cooldown_frac:
        return 1.0
    w = (1 - progress) / cooldown_frac
    return w + (1 - w) * final_frac


def stage_share_cooldown_lr(step: int, scheduled: int, cooldown_frac: float, final_frac: float, share: float) -> float:
    """Record #89's get_lr (T:1968-1976): the stage's share until step int((1 - cooldown_frac) S), then
    share (1 - tau) + final_frac tau, tau rising linearly to 1 at S and held there; the floor is a fraction of
    the base lrs, not of the stage's."""
    start = int(scheduled * (1 - cooldown_frac))
    if step < start:
        return share
    tau = min(1.0, (step - start) / max(scheduled - start, 1))
    return share * (1 - tau) + final_frac * tau


def step_lr_multiplier(step: int, args: Hyperparameters, batches: BatchSchedule) -> float:
    """The step's lr multiplier: the cooldown schedule times the batch stage's scale, or record #89's blend of the
    two (--stage_share_cooldown)."""
    if args.stage_share_cooldown:
        return stage_share_cooldown_lr(step, scheduled_steps(args), args.cooldown_frac, args.lr_final_frac,
                                       batches.lr_scale(step))
    cooldown = lr_multiplier(step, scheduled_steps(args), args.cooldown_frac, args.lr_final_frac)
    return cooldown * batches.lr_scale(step)


def muon_momentum(step: int, warmup_steps: int, start: float, end: float, cooldown_steps: int = 0,
                  num_iterations: int = 0) -> float:
    """Warmed up from start to end over warmup_steps; track 2 (M get_muon_momentum): back down to start over the
    last cooldown_steps of the num_iterations training steps (M: 0.948 at 4691 ... 0.852 at 4739)."""
    cooldown_start = num_iterations - cooldown_steps
    if cooldown_steps and step > cooldown_start and step >= warmup_steps:
        return end - (step - cooldown_start) / cooldown_steps * (end - start)
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


def follow_yarn(model: GPT, step: int, args: Hyperparameters) -> tuple[int, float] | None:
    """Brings the model's rotary tables and attention scales to the step's YaRN state (yarn_state) where they hold
    another: the training loop at every step, the tools at their step. Returns (changes applied, the new scale)
    when it rebuilt them, else None."""
    changes = len(yarn_changes(step, args))
    if changes == model.yarn_changes_applied:
        return None
    freqs, scale = yarn_state(step, args)
    model.set_yarn(freqs, scale, changes)
    return changes, scale


def muon_momentum_at(step: int, args: Hyperparameters) -> float:
    """The step's Muon momentum under the run's flags (muon_momentum)."""
    return muon_momentum(step, args.muon_momentum_warmup_steps, args.muon_momentum_start, args.muon_momentum,
                         args.muon_momentum_cooldown_steps, args.num_iterations)


MTP_WEIGHT_RATIO = 0.5  # 2025-12-22_MultiTokenPrediction: weights 1, 0.5, 0.25 for the next 3 tokens


def mtp_loss_weights(step: int, num_iterations: int, n_tokens: int, frac: float = 1.0) -> list[float]:
    """2025-12-22_MultiTokenPrediction: the first frac of training (all of it in the short track; the first quarter
    in track 2's 2025-12-31 record) is cut into n_tokens equal phases; phase p predicts the next n_tokens - p
    tokens with weights 1, 0.5, 0.25, ..., the last of them decaying linearly to 0 over the phase (for 3:
    [1, .5, .25->0] -> [1, .5->0] -> [1]), and the rest of training the next token alone. Always n_tokens weights
    (zeros at the end), so the shapes a compiled model sees never change."""
    progress = min(step / (num_iterations * frac), 1.0) * n_tokens
    phase = min(int(progress), n_tokens - 1)
    live = n_tokens - phase
    weights = [MTP_WEIGHT_RATIO ** k for k in range(live)] + [0.0] * phase
    if live > 1:
        weights[live - 1] *= 1 - (progress - phase)
    return weights


def stage_loss_weights(step: int, batches: BatchSchedule, n_tokens: int, prefix_weight: float = 0.0) -> list[float]:
    """record #89 (T:1950-1958, T:1980-1988): the loss weights by the step's batch stage k and the fraction t of it
    done, t = (step - e_k) / (e_{k+1} - e_k): stage k predicts the next n_tokens - k tokens, weights 1, 0.5, ...,
    the last decaying to 0 over the stage (for 3: [1, .5, .25(1-t)] -> [1, .5(1-t)] -> [1]); then a prefix weight
    w holds w in stage 0, w(1-t) in stage 1, 0 after. Always n_tokens weights (zeros at the end), then the prefix
    weight where there is one, so the shapes a compiled model sees never change."""
    stage, n_stages = batches.stage(step), len(batches.stage_tokens)
    start = batches.first_step(stage)
    end = batches.first_step(stage + 1) if stage + 1 < n_stages else batches.scheduled_steps
    t = min((step - start) / max(end - start, 1), 1.0)  # T:1966: t = 1 past the last stage
    live = max(n_tokens - stage, 1)
    weights = [MTP_WEIGHT_RATIO ** k for k in range(live)] + [0.0] * (n_tokens - live)
    if live > 1:
        weights[live - 1] *= 1 - t
    if prefix_weight:
        weights.append(prefix_weight * (1.0 if stage == 0 else 1 - t if stage == 1 else 0.0))
    return weights


def loss_weights_settle(args: Hyperparameters, batches: BatchSchedule | None) -> int:
    """The first step from which the per-step loss weights no longer change: the end of the MTP phases (mtp_frac),
    or by stage the first step of the stage after the last that decays (the prefix weight's: stage 1)."""
    if not args.loss_weights_by_stage:
        return min(args.num_iterations, math.ceil(scheduled_steps(args) * args.mtp_frac))
    settled = max(args.mtp_tokens - 1, 2 if args.prefix_loss_weight else 0)
    if settled < len(batches.stage_tokens):
        return min(args.num_iterations, batches.first_step(settled))
    return args.num_iterations


MTP_TABLE_ROWS = 65536  # MTP weight rows on the device at once: a longer run refills them once per this many steps


class StepTensors:
    """The schedules' per-step model inputs, made on the device at start-up: a training step indexes them and
    never copies from the host (a copy from pageable memory waits for the device to drain). Nothing here walks
    every step: the windows come from the schedule's stages, the MTP weights a block of steps at a time."""

    def __init__(self, args: Hyperparameters, device: torch.device, batches: BatchSchedule | None = None):
        self.args, self.device = args, device
        if batches is None and args.loss_weights_by_stage:
            batches = batch_schedule(args, 1)  # the stages' steps do not depend on the world size
        self.batches = batches
        self.window_tensors = {pair: torch.tensor(pair, dtype=torch.int64, device=device)
                               for pair in window_pairs(args) or ()}
        # after the MTP phase every step has the same weights (the next token alone): the table ends there
        self.mtp_last = loss_weights_settle(args, self.batches)
        self.mtp_table, self.mtp_first = None, 0
        if args.mtp_tokens > 1 or args.prefix_loss_weight > 0:
            self.mtp_rows(0)

    def windows(self, step: int) -> Tensor:
        """The step's (long, short) windows; past the last step (a warm-up longer than the run) the last one's."""
        pair = attention_windows(min(step, self.args.num_iterations), self.args)
        if pair not in self.window_tensors:  # only where window_pairs gave up: flags far beyond any record's
            self.window_tensors[pair] = torch.tensor(pair, dtype=torch.int64, device=self.device)
        return self.window_tensors[pair]

    def mtp_rows(self, first: int) -> None:
        """The MTP weights of steps first .. first + MTP_TABLE_ROWS - 1 (at most to the end of the phase)."""
        steps = range(first, min(first + MTP_TABLE_ROWS, self.mtp_last + 1))
        self.mtp_table = torch.tensor([self.loss_weights(s) for s in steps], device=self.device)
        self.mtp_first = first

    def loss_weights(self, step: int) -> list[float]:
        """The step's MTP weights (then the prefix weight): by batch stage or in equal phases of mtp_frac."""
        a = self.args
        if a.loss_weights_by_stage:
            return stage_loss_weights(step, self.batches, a.mtp_tokens, a.prefix_loss_weight)
        return mtp_loss_weights(step, scheduled_steps(a), a.mtp_tokens, a.mtp_frac)

    def mtp_weights(self, step: int) -> list[Tensor]:
        """The model's optional loss-weights input: [the step's row] under --mtp_tokens > 1 or a prefix weight,
        else []."""
        if self.mtp_table is None:
            return []
        step = min(step, self.mtp_last)
        if not self.mtp_first <= step < self.mtp_first + len(self.mtp_table):
            self.mtp_rows(step - step % MTP_TABLE_ROWS)
        return [self.mtp_table[step - self.mtp_first]]


# -----------------------------------------------------------------------------
# Data: shards of uint16 tokens behind a 256-int32 header

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_BYTES = 256 * 4


def shard_token_count(path: Path) -> int:
    """Validates a shard's header against its file size and returns its token count."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    except OSError as e:
        raise UsageError(f"cannot read shard {path}: {e.strerror}") from None
    if header.size < 256:
        raise UsageError(f"shard {path} is truncated: {size} bytes is less than its 1024-byte header")
    if header[0] != SHARD_MAGIC:
        raise UsageError(f"shard {path} has magic {header[0]}, expected {SHARD_MAGIC}: not a token shard")
    if header[1] != SHARD_VERSION:
        raise UsageError(f"shard {path} has version {header[1]}, expected {SHARD_VERSION}")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise UsageError(f"shard {path} is truncated or padded: header says {count} tokens "
                         f"({HEADER_BYTES + 2 * count} bytes), file has {size} bytes; download it again")
    return count


def load_shard(path: Path, vocab_size: int) -> np.ndarray:
    """Memory-maps a shard's tokens after checking every id fits the vocabulary."""
    count = shard_token_count(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))
    if count and int(tokens.max()) >= vocab_size:
        raise UsageError(f"shard {path} holds token id {int(tokens.max())} >= vocab size {vocab_size}")
    return tokens


def document_starts(tokens: np.ndarray) -> np.ndarray:
    """Positions of every <|endoftext|> in a shard: where documents begin."""
    return np.flatnonzero(np.asarray(tokens) == EOT_TOKEN)


class ShardReader:
    """One shard read and checked (load_shard: every id in the vocabulary; its document starts) in a
    background thread, so that the ~100M-token scans run while the device trains on the shard before."""

    def __init__(self, index: int, path: Path, vocab_size: int):
        self.index, self.result, self.error = index, None, None
        self.thread = threading.Thread(target=self._read, args=(path, vocab_size), name="shard-reader", daemon=True)
        self.thread.start()

    def _read(self, path: Path, vocab_size: int) -> None:
        try:
            tokens = load_shard(path, vocab_size)
            self.result = (tokens, document_starts(tokens))
        except BaseException as e:  # handed to the training thread, which raises it where the shard is used
            self.error = e

    def get(self) -> tuple[np.ndarray, np.ndarray]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def find_shards(pattern: str, what: str) -> list[Path]:
    """Sorted shards matching a glob (relative to the working directory, else to this script's folder)."""
    matches = sorted(glob.glob(pattern))
    if not matches and not os.path.isabs(pattern):
        matches = sorted(glob.glob(str(REPO_DIR / pattern)))
    if not matches:
        hint = ("run `python -m data.cached_fineweb10B 9` to download them" if "fineweb" in pattern
                else "make shards with `python -m data.fineweb --input ...` or pass --train_files/--val_files")
        raise UsageError(f"no {what} shards match {pattern!r}; {hint}")
    return [Path(m) for m in matches]


class TokenStream:
    """The shards read in order as one stream. At the end it cycles only when asked to."""

    def __init__(self, files: list[Path], vocab_size: int, cycle: bool, read_ahead: bool = False):
        self.files, self.vocab_size, self.cycle = files, vocab_size, cycle
        self.epoch, self.shard, self.pos = 0, 0, 0
        self._tokens: np.ndarray | None = None
        self._bos: np.ndarray | None = None
        self.read_ahead = read_ahead  # the next shard read in the background (training; ShardReader)
        self._reader: ShardReader | None = None

    def state(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "pos": self.pos}

    def load_state(self, state: dict) -> None:
        self.epoch, self.shard, self.pos = state["epoch"], state["shard"], state["pos"]
        self._forget_shard()

    def _forget_shard(self) -> None:
        """Drops the loaded shard and its document starts together (stale starts would misplace documents)."""
        self._tokens, self._bos = None, None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            if self._reader is not None and self._reader.index == self.shard:
                self._tokens, self._bos = self._reader.get()
            else:
                self._tokens = load_shard(self.files[self.shard], self.vocab_size)
            self._read_next_shard_ahead()
        return self._tokens

    def _read_next_shard_ahead(self) -> None:
        self.close()
        following = self.shard + 1 if self.shard + 1 < len(self.files) else (0 if self.cycle else None)
        if self.read_ahead and following is not None and following != self.shard:
            self._reader = ShardReader(following, self.files[following], self.vocab_size)

    def close(self) -> None:
        """Waits for a shard being read ahead and drops it (it may not be the one needed next)."""
        if self._reader is not None:
            self._reader.thread.join()
            self._reader = None

    def _next_shard(self) -> None:
        self.shard, self.pos = self.shard + 1, 0
        self._forget_shard()
        if self.shard == len(self.files):
            if not self.cycle:
                raise RunFailed(f"ran out of training data after {self.epoch + 1} pass(es) over {len(self.files)} "
                                 "shard(s); download more shards or pass --train_cycle=true to repeat them")
            self.shard, self.epoch = 0, self.epoch + 1

    def _next_bos(self, start: int) -> int:
        if self._bos is None:
            self._bos = document_starts(self.tokens)
        i = np.searchsorted(self._bos, start)
        return int(self._bos[i]) if i < len(self._bos) else len(self.tokens)

    def take(self, n: int, bos_align: bool = False, doc_cap: int = 0) -> np.ndarray:
        """The next n tokens plus the one after (the last target); the cursor moves by n. With doc_cap,
        documents are packed from their starts, each cut to doc_cap tokens (the cursor moves past the last)."""
        for _ in range(2 * len(self.files) + 1):
            start = self._next_bos(self.pos) if bos_align else self.pos
            if doc_cap:
                pieces = self._capped_documents(start, n + 1, doc_cap)
                if pieces is not None:
                    self.pos = int(pieces[-1][1])
                    return np.concatenate([self.tokens[a:b] for a, b in pieces])
            elif start + n + 1 <= len(self.tokens):
                self.pos = start + n
                return self.tokens[start:start + n + 1]
            try:
                self._next_shard()
            except RunFailed as e:
                if not bos_align:
                    raise
                raise RunFailed(f"{e}; with --bos_align=true every sequence starts at a document start, so a shard's "
                                f"text after its last start with {n + 1} tokens to go is skipped (one document longer "
                                "than the shard yields one sequence): pass --bos_align=false or add shards") from None
        raise UsageError(f"no shard of {[str(f) for f in self.files]} holds a sequence of {n + 1} tokens")

    def take_together(self, count: int, n: int, bos_align: bool = False, doc_cap: int = 0) -> list[np.ndarray]:
        """count sequences as take() cuts them, all from one shard: where the shard runs out part-way, all of them
        come from the next shard, from its first document (M L1287, L1356-1360: one step's buffers, one shard)."""
        for _ in range(2 * len(self.files) + 1):
            chunks = [self.take(n, bos_align, doc_cap)]
            shard = (self.epoch, self.shard)
            while len(chunks) < count and (self.epoch, self.shard) == shard:
                chunks.append(self.take(n, bos_align, doc_cap))
            if (self.epoch, self.shard) == shard:
                return chunks
            self.pos = 0  # the step starts again at the new shard's start
        raise UsageError(f"no shard of {[str(f) for f in self.files]} holds {count} sequences of {n + 1} tokens")

    def _capped_documents(self, start: int, need: int, cap: int) -> list[tuple[int, int]] | None:
        """[begin, end) of the documents from the one at `start` on, each cut to cap tokens and the last one
        to what fills `need` tokens (2025-09-03_FA3's packing); None if this shard runs out first."""
        self._next_bos(start)  # loads the document starts
        i = int(np.searchsorted(self._bos, start))
        bounds = np.append(self._bos[i:i + need + 1], len(self.tokens))[:need + 1]  # need pieces at most
        begins, ends = bounds[:-1], np.minimum(bounds[1:], bounds[:-1] + cap)
        filled = np.cumsum(ends - begins)
        k = int(np.searchsorted(filled, need))
        if k == len(begins):
            return None
        ends[k] -= filled[k] - need
        return list(zip(begins[:k + 1].tolist(), ends[:k + 1].tolist()))


def to_device(chunk: np.ndarray, device: torch.device) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets; pinned and asynchronous on CUDA."""
    host = torch.from_numpy(chunk.astype(np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    seq = host.to(device, non_blocking=True)
    return seq[:-1], seq[1:]


class DistributedTokenLoader:
    """Cuts each global batch into world_size * accum sequences; rank r takes sequences r, r + W, ...

    Every rank walks the same global layout, so the batch does not depend on the world size. With
    step_in_one_shard (--batch_sequences) a step's sequences all come from one shard, as the record's 8 buffers.
    """

    def __init__(self, stream: TokenStream, rank: int, world_size: int, bos_align: bool, doc_cap: int,
                 device: torch.device, step_in_one_shard: bool = False):
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.bos_align, self.doc_cap, self.device = bos_align, doc_cap, device
        self.step_in_one_shard = step_in_one_shard

    def next_batch(self, accum: int, seq_len: int, doc_cap: int | None = None) -> list[tuple[Tensor, Tensor]]:
        """The step's accum micro-batches of this rank, each seq_len tokens (documents cut to doc_cap if given, the
        stage's cap, else to the loader's)."""
        count, cut = self.world_size * accum, (seq_len, self.bos_align, self.doc_cap if doc_cap is None else doc_cap)
        chunks = (self.stream.take_together(count, *cut) if self.step_in_one_shard
                  else [self.stream.take(*cut) for _ in range(count)])
        return [to_device(chunks[i], self.device) for i in range(self.rank, len(chunks), self.world_size)]


def check_validation_budget(files: list[Path], args: Hyperparameters) -> None:
    """Refuses a --val_tokens the shards cannot fill: a shard of n tokens holds (n - 1) // val_seq_len sequences
    (each takes one token more, its last target, and none spans two shards), as TokenStream.take cuts them."""
    counts = [shard_token_count(f) for f in files]
    have = sum(max(n - 1, 0) // args.val_seq_len for n in counts)
    need = args.val_tokens // args.val_seq_len
    if have < need:
        fix = (f"pass --val_tokens={have * args.val_seq_len} or fewer" if have else
               "pass a smaller --val_seq_len or more validation shards")
        raise UsageError(f"--val_tokens={args.val_tokens} is {need} sequences of --val_seq_len={args.val_seq_len} "
                         f"tokens, each with one token more (its last target), and the validation shards "
                         f"({sum(counts)} tokens in {len(files)} shard(s)) hold {have}: {fix}")


def check_data(args: Hyperparameters, is_master: bool) -> None:
    """Every shard the run reads exists and has a sound header, and the validation shards fill --val_tokens: checked
    before the run's folder exists, so that a refused launch writes nothing."""
    for f in progress_bar(find_shards(args.train_files, "training"), "checking shards", is_master, unit="shard"):
        shard_token_count(f)
    check_validation_budget(find_shards(args.val_files, "validation"), args)


def validation_sequences(files: list[Path], args: Hyperparameters, rank: int, world_size: int) -> list[np.ndarray]:
    """This rank's share of the fixed validation budget (sequence i goes to rank i % world_size)."""
    check_validation_budget(files, args)
    stream = TokenStream(files, args.vocab_size, cycle=False)
    seqs = [np.array(stream.take(args.val_seq_len)) for _ in range(args.val_tokens // args.val_seq_len)]
    return seqs[rank::world_size]


# -----------------------------------------------------------------------------
# The techniques: recipe v2's (the later short-track records) and track 2's, each declared once

@dataclass(frozen=True)
class Refusal:
    """A combination of flags a technique cannot run with, and the one line that says what to pass instead."""
    when: typing.Callable[[Hyperparameters], bool]
    why: typing.Callable[[Hyperparameters], str]


@dataclass(frozen=True)
class OnlyWhen:
    """Flags that do nothing unless a condition on other flags holds: a command line that sets one of them (off
    its default) while the condition fails is refused, since the run would log a value it never uses."""
    flags: tuple[str, ...]
    holds: typing.Callable[[Hyperparameters], bool]
    why: typing.Callable[[Hyperparameters, str], str]  # the one line for a flag set while the condition fails


def only_if(flags: tuple[str, ...], holds: typing.Callable[[Hyperparameters], bool], needs: str,
            has: typing.Callable[[Hyperparameters], str]) -> OnlyWhen:
    """Flags that matter only when `holds`: `needs` says what meets it, `has` what this run has instead."""
    return OnlyWhen(flags, holds, lambda a, name: f"--{name}={flag_text(getattr(a, name))} only matters with {needs}, "
                                                  f"and this run has {has(a)}: drop --{name} or pass {needs}")


def only_with(*flags: str, switch: str, on: bool = True) -> OnlyWhen:
    """Flags that matter only while the boolean flag `switch` is `on`."""
    return only_if(flags, lambda a: getattr(a, switch) == on, f"--{switch}={flag_text(on)}",
                   lambda a: f"--{switch}={flag_text(getattr(a, switch))}")


@dataclass(frozen=True)
class Technique:
    """One technique of recipe v2: validation, the recipes, checkpoints, decoding, the optimizer's gate groups,
    bench/ablation.py's variants and docs/techniques.md's table (a test holds it to this) all read it from here.
    Its flags are Hyperparameters fields (with their comments and defaults, which are the technique off); its
    math lives where the model or the optimizer uses it."""
    name: str  # bench/ablation.py calls its variants v2_without_<name> / v2_with_<name>
    records: tuple[str, ...]  # its modded-nanogpt records/track_1_short/ folders
    part: str  # model (ModelConfig carries its flags) | loss | optimizer | schedule | data
    flags: dict[str, Rule]  # the hyperparameters it owns, and what each accepts
    v2: dict[str, dict]  # preset -> the values recipe v2 sets there (its own flags or others) ...
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # ... or why v2 leaves it out there
    refusals: tuple[Refusal, ...] = ()
    reads_previous_token: bool = False  # the KV cache cannot extend it: decoding reruns the history
    gate_lrs: dict[str, float] = dataclasses.field(default_factory=dict)  # its gates' lr, a fraction of scalar_lr
    optimizer_state: bool = False  # it changes what the optimizer keeps, so a checkpoint must agree on it
    only_when: tuple[OnlyWhen, ...] = ()  # its flags that do nothing unless another setting holds

    @property
    def switch(self) -> str:
        """The flag that turns it on: its first."""
        return next(iter(self.flags))

    def is_on(self, values) -> bool:
        """Whether a run (Hyperparameters or ModelConfig) uses it: its switch is off its default."""
        return getattr(values, self.switch) != getattr(Hyperparameters, self.switch)

    def off(self, preset: str) -> dict[str, object]:
        """The values that leave it out on preset: what the reference recipe has for every flag v2 sets."""
        reference = recipe_values(preset, "reference")
        return {name: reference[name] for name in self.v2.get(preset, {})}


def everywhere(**values) -> dict[str, dict]:
    return {preset: values for preset in PRESETS}


def gates_need_width(flag: str) -> Refusal:
    return Refusal(lambda a: getattr(a, flag) and a.model_dim < a.gate_dims,
                   lambda a: f"--{flag}=true reads the stream's first {a.gate_dims} dims, more than --model_dim="
                             f"{a.model_dim}; switch the gate off, narrow --gate_dims or widen the model")


def skips_out_of_order(a: Hyperparameters) -> str | None:
    """What is wrong with --skip_connections on this depth (a skip backwards or past the last layer), if anything."""
    for source, target in skip_pairs(a.skip_connections) or ():
        if source >= target:
            return f"{source}>{target} points backwards (a skip adds an earlier block's stream to a later block)"
        if target >= a.n_layer:
            return f"{source}>{target} goes past the last layer ({a.n_layer - 1} of --n_layer={a.n_layer})"
    return None


def needs_muon(flag: str) -> Refusal:
    return Refusal(lambda a: getattr(a, flag) and not a.muon,
                   lambda a: f"--{flag}=true changes Muon's update, and --muon=false turns Muon off; pass "
                             f"--muon=true or --{flag}=false")


RECORD_ONLY = "a record #89 technique (--recipe=record)"
BLOCK_LIST = Rule(lambda v: block_list(v) is not None, "empty, or comma-separated block indices such as 1,3,4,7")
NOT_IN_TRACK_2 = "not in the track-2 record (modded-nanogpt PR #188), whose recipe the medium preset is; one flag away"
UNIT_OPEN = number(0.0, 1.0, lo_open=True)


def only_track_2(what: str) -> dict[str, str]:
    """The short-track presets' reason to leave out a technique of track 2's own layout."""
    return {preset: f"a track-2 (medium) technique: the short track's records keep {what}"
            for preset in PRESETS if preset != "medium"}


# Gate lrs are fractions of scalar_lr (0.04 = 5 x the record's Adam lr 0.008): 2025-12-29_VeSkipGates has the
# smear gate at 0.01 x and the skip gate at 0.05 x that Adam lr, 2026-05-20_BigramsSignTrick the others at 1 x.
TECHNIQUES: tuple[Technique, ...] = (
    Technique(
        "batch_schedule", ("2025-11-29_BatchSizeSchedule",), "schedule",
        {"batch_schedule": Rule(lambda v: v == "" or stage_fractions(v) is not None,
                                "empty, or comma-separated fractions in (0, 1] such as 1/3,2/3,1"),
         "batch_lr_exponent": number(0.0)},
        # Its lrs are set for its first batch and scaled up by (batch / 131072) ** 0.6: Muon 0.023 -> 0.0444 at
        # the final batch, ours' base; its cooldown floor is 0.1 of the first stage's lr.
        {"speedrun": dict(batch_schedule="1/3,2/3,1", cooldown_frac=0.55, muon_lr=0.0444, lr_final_frac=0.0518),
         "cpu": dict(batch_schedule="1/3,2/3,1", cooldown_frac=0.55), "medium": {}},
        only_when=(only_if(("batch_lr_exponent",), lambda a: a.batch_schedule != "", "a --batch_schedule",
                           lambda a: "none (one batch size, whose lrs are the base)"),)),
    Technique(  # M L1351, L1364-1368, L1718: one buffer of stage/8 tokens per GPU, grad_accum 1 on 8 GPUs
        "batch_sequences", ("2025-12-31_BulkSmallTrackTransfer",), "data", {"batch_sequences": integer(0)},
        {"medium": {}}, left_out=only_track_2("fixed-length sequences, more micro-steps as the batch grows"),
        refusals=(Refusal(lambda a: a.batch_sequences and any(n % BLOCK_SIZE for n in packed_lengths(a)),
                          lambda a: f"--batch_sequences={a.batch_sequences} cuts the batch stages into sequences of "
                                    f"{'/'.join(dict.fromkeys(f'{float(n):g}' for n in packed_lengths(a)))} "
                                    f"tokens, not whole {BLOCK_SIZE}-token blocks; pass a count that splits every "
                                    "stage into them"),
                  Refusal(lambda a: a.batch_sequences and a.seq_len != max(packed_lengths(a)),
                          lambda a: f"--seq_len={a.seq_len} is not the longest packed sequence of --batch_sequences="
                                    f"{a.batch_sequences} ({max(packed_lengths(a))} tokens: --batch_tokens="
                                    f"{a.batch_tokens} / {a.batch_sequences}); pass --seq_len="
                                    f"{max(packed_lengths(a))}, or --batch_sequences=0 for fixed-length sequences"))),
    Technique(  # sequences start at a document; documents are cut at the record's max_seq_len
        "doc_align", ("2025-07-12_BosAlign", "2025-09-03_FA3"), "data",
        {"bos_align": ANY_BOOL, "doc_len_cap": integer(0)},
        {"speedrun": dict(bos_align=True, doc_len_cap=2048), "medium": {}},
        left_out={"cpu": "the bundled sample's documents are ~7.8K tokens long (median), so aligned sequences "
                         "would drop most of its text"},
        refusals=(Refusal(lambda a: a.doc_len_cap and not a.bos_align,
                          lambda a: f"--doc_len_cap={a.doc_len_cap} packs whole documents from their start, so it "
                                    "needs --bos_align=true (or pass --doc_len_cap=0)"),)),
    Technique(
        "polar_express", ("2025-09-29_PolarExpress",), "optimizer", {"polar_express": ANY_BOOL},
        everywhere(polar_express=True),
        refusals=(needs_muon("polar_express"),
                  Refusal(lambda a: a.polar_express and a.ns_steps > len(POLAR_EXPRESS_COEFFICIENTS),
                          lambda a: f"--polar_express=true has {len(POLAR_EXPRESS_COEFFICIENTS)} iterations' "
                                    f"coefficients, not --ns_steps={a.ns_steps}; pass --ns_steps=5 or fewer"))),
    Technique(
        "normuon", ("2025-10-24_NorMuon", "2025-10-27_FixMuonLR"), "optimizer",
        {"normuon": ANY_BOOL, "normuon_beta2": BETA}, everywhere(normuon=True),
        refusals=(needs_muon("normuon"),), optimizer_state=True,
        only_when=(only_with("normuon_beta2", switch="normuon"),)),
    Technique(
        "cautious_wd", ("2025-11-10_CautiousWD", "2025-12-18_CautiousWDAdam"), "optimizer",
        {"cautious_wd": ANY_BOOL, "muon_cautious_wd": number(0.0), "adam_cautious_wd": number(0.0)},
        everywhere(cautious_wd=True),
        refusals=(Refusal(lambda a: a.cautious_wd and a.weight_decay,
                          lambda a: f"--cautious_wd=true replaces the plain decay --weight_decay={a.weight_decay}; "
                                    "pass one of them"),),
        only_when=(only_with("muon_cautious_wd", "adam_cautious_wd", switch="cautious_wd"),
                   only_with("muon_cautious_wd", switch="muon"))),
    # Track 2's optimizers (2025-12-31_BulkSmallTrackTransfer, M L425-830, L1040-1120, L1480-1600).
    Technique(
        "record_muon_shapes", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer", {"record_muon_shapes": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("Muon's lr from the matrices' own shapes"),
        refusals=(needs_muon("record_muon_shapes"),)),
    Technique(
        "muon_qk_head_pairs", ("2026-04-08_PairedHeadMuon",), "optimizer", {"muon_qk_head_pairs": ANY_BOOL}, {},
        left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        refusals=(needs_muon("muon_qk_head_pairs"),
                  Refusal(lambda a: a.muon_qk_head_pairs and a.n_head % 2,
                          lambda a: f"--muon_qk_head_pairs=true groups Q and K by head pairs, and --n_head={a.n_head} "
                                    "is odd; pass an even --n_head or --muon_qk_head_pairs=false")),
        optimizer_state=True),
    Technique(
        "muon_gates", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer",
        {"muon_gates": ANY_BOOL, "muon_gate_lr_mul": LR}, {"medium": {}},
        left_out=only_track_2("the gates in the scalar Adam (2025-12-31_GatesToCompiledAdam)"),
        refusals=(needs_muon("muon_gates"),), optimizer_state=True,
        only_when=(only_with("muon_gate_lr_mul", switch="muon_gates"),)),
    Technique(
        "adam_every", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer", {"adam_every": integer(1, 1000)},
        {"medium": {}}, left_out=only_track_2("an Adam step every step"),
        refusals=(Refusal(lambda a: a.checkpoint_every % a.adam_every,
                          lambda a: f"--checkpoint_every={a.checkpoint_every} would checkpoint between Adam steps, "
                                    f"which --adam_every={a.adam_every} spaces; pass a multiple of it"),
                  Refusal(lambda a: a.stop_after % a.adam_every,
                          lambda a: f"--stop_after={a.stop_after} would stop between Adam steps, which "
                                    f"--adam_every={a.adam_every} spaces; pass a multiple of it"))),
    Technique(
        "adam_master", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer", {"adam_master": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("an fp32 Adam master"), optimizer_state=True,
        refusals=(Refusal(lambda a: not a.adam_master and a.weight_decay,
                          lambda a: f"--adam_master=false is the record's Adam, whose only decay is the cautious one,"
                                    f" not --weight_decay={a.weight_decay}; pass --weight_decay=0"),)),
    Technique(
        "adam_fp32_moments", ("2026-07-17_FP8DownProjection",), "optimizer", {"adam_moments_fp32": ANY_BOOL}, {},
        left_out=dict.fromkeys(PRESETS, RECORD_ONLY), optimizer_state=True,
        only_when=(only_with("adam_moments_fp32", switch="adam_master", on=False),)),
    Technique(
        "adam_groups", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer",
        {"token_embed_lr": Rule(lambda v: v is None or LR.ok(v), LR.valid + ", or none"),
         "head_embed_wd_mul": number(0.0), "value_embed_wd_mul": number(0.0),
         "gate_adam_lr": Rule(lambda v: v is None or LR.ok(v), LR.valid + ", or none")},
        {"medium": {}}, left_out=only_track_2("the reference's Adam groups")),
    Technique(
        "x0_lambda_apart", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer",
        {"x0_lambda_lr": Rule(lambda v: v is None or LR.ok(v), LR.valid + ", or none")},
        {"medium": {}}, left_out=only_track_2("the x0 lambdas among the scalars"), optimizer_state=True),
    Technique(
        "tied_embed", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer", {"tied_embed_steps": integer(0)},
        {"medium": {}}, left_out=only_track_2("an embedding of its own from the start"),
        refusals=(Refusal(lambda a: a.tied_embed_steps and a.tied_embed_steps >= a.num_iterations,
                          lambda a: f"--tied_embed_steps={a.tied_embed_steps} unties the embedding after a step "
                                    f"past the last (--num_iterations={a.num_iterations}); pass fewer or 0"),)),
    Technique(
        "record_adam_groups", ("2026-07-17_FP8DownProjection",), "optimizer",
        {"table_adam_beta1": OPTIONAL_BETA, "bigram_wd_mul": number(0.0), "gate_scalar_betas": ANY_BOOL,
         "ve_gate_lr": Rule(lambda v: v is None or LR.ok(v), LR.valid + ", or none")},
        {}, left_out=dict.fromkeys(PRESETS, RECORD_ONLY)),
    Technique(
        "smoothed_scalars", ("2025-12-21_SmoothedScalars",), "optimizer",
        {"scalar_adam_beta1": OPTIONAL_BETA, "scalar_adam_beta2": OPTIONAL_BETA},
        everywhere(scalar_adam_beta1=0.9, scalar_adam_beta2=0.99)),
    # 15 x 50304 rows of 192 dims (a quarter of the stream); the bundled sample has about 10^5 distinct
    # bigrams, so the cpu preset takes 5 x 50304 rows of a quarter of its stream.
    Technique(
        "bigram", ("2026-01-19_BigramHashEmbedding", "2026-05-20_BigramsSignTrick"), "model",
        {"bigram_vocab_size": integer(0), "bigram_dim": integer(0), "bigram_sign": ANY_BOOL},
        {"speedrun": dict(bigram_vocab_size=15 * 50304, bigram_dim=192, bigram_sign=True),
         "cpu": dict(bigram_vocab_size=5 * 50304, bigram_dim=64, bigram_sign=True)},
        left_out={"medium": NOT_IN_TRACK_2},
        refusals=(
            Refusal(lambda a: a.bigram_sign and not a.bigram_vocab_size,
                    lambda a: "--bigram_sign=true signs the bigram embedding, which --bigram_vocab_size=0 turns "
                              "off; pass --bigram_sign=false or a table size"),
            Refusal(lambda a: a.bigram_vocab_size == 1,
                    lambda a: "--bigram_vocab_size=1 leaves no row besides the one kept for document starts; "
                              "pass 0 (off) or at least 2"),
            Refusal(lambda a: a.bigram_dim > a.model_dim,
                    lambda a: f"--bigram_dim={a.bigram_dim} is wider than the stream it is added to (--model_dim="
                              f"{a.model_dim}); pass at most that, or 0 for the full width")),
        reads_previous_token=True,
        only_when=(only_if(("bigram_dim",), lambda a: a.bigram_vocab_size > 0, "a --bigram_vocab_size above 0",
                           lambda a: "--bigram_vocab_size=0 (no bigram table)"),)),
    # the MLP in FP8: its up projection (2026-05-19), then its down projection (2026-07-17); record #89 only
    Technique(
        "fp8_mlp", ("2026-05-19_FP8MLPUpProj", "2026-07-17_FP8DownProjection"), "model", {"fp8_mlp": ANY_BOOL}, {},
        left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        refusals=(
            Refusal(lambda a: a.fp8_mlp and a.mlp_act != "relu2",
                    lambda a: f"--fp8_mlp=true is the record's FP8 relu^2 MLP and this run has --mlp_act={a.mlp_act}; "
                              "pass --mlp_act=relu2 or --fp8_mlp=false"),)),
    # the head's FP8 scales of record #89 (x and g since the retied head, W since the value-embedding gates)
    Technique(
        "fp8_head_scales", ("2025-12-19_RetieLMHead", "2025-12-29_VeSkipGates"), "model",
        {"fp8_head_scales": one_of(*FP8_HEAD_SCALES)}, {},
        left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        refusals=(
            Refusal(lambda a: a.fp8_head_scales == "record" and not a.loss_sum,
                    lambda a: "--fp8_head_scales=record scales the gradient of the summed loss, and this run has "
                              "--loss_sum=false; pass --loss_sum=true or --fp8_head_scales=reference"),),
        only_when=(only_if(("fp8_head_scales",), lambda a: a.fp8_head, "--fp8_head=true",
                           lambda a: "--fp8_head=false (a bf16 head)"),)),
    Technique(
        "smear", ("2025-09-18_Smear",), "model", {"smear": ANY_BOOL}, everywhere(smear=True),
        refusals=(gates_need_width("smear"),), reads_previous_token=True, gate_lrs={"smear_gate": 0.01 / 5}),
    Technique(
        "attn_gate", ("2025-08-23_SparseAttnGate",), "model", {"attn_gate": ANY_BOOL}, everywhere(attn_gate=True),
        refusals=(gates_need_width("attn_gate"),), gate_lrs={"attn_gate": 1 / 5}),
    Technique(
        "ve_skip_gates", ("2025-12-29_VeSkipGates",), "model", {"ve_gates": ANY_BOOL, "skip_gates": ANY_BOOL},
        everywhere(ve_gates=True, skip_gates=True),
        refusals=(
            gates_need_width("ve_gates"), gates_need_width("skip_gates"),
            Refusal(lambda a: a.ve_gates and not a.value_embeds,
                    lambda a: "--ve_gates=true gates the value embeddings, which --value_embeds=false removes; pass "
                              "--ve_gates=false or --value_embeds=true"),
            Refusal(lambda a: a.skip_gates and not a.unet_skips,
                    lambda a: "--skip_gates=true gates the U-net skips, which --unet_skips=false removes; pass "
                              "--skip_gates=false or --unet_skips=true")),
        gate_lrs={"ve_gate": 1 / 5, "skip_gate": 0.05 / 5}),
    Technique("backout", ("2025-10-04_Backout",), "model", {"backout": ANY_BOOL}, everywhere(backout=True)),
    Technique(
        "key_offset", ("2025-12-14_PartialKeyOffset",), "model", {"key_offset": ANY_BOOL},
        everywhere(key_offset=True), reads_previous_token=True),
    Technique(
        "paired_heads", ("2026-01-07_PairedHeadAttention",), "model", {"paired_heads": ANY_BOOL},
        {"speedrun": dict(paired_heads=True), "cpu": dict(paired_heads=True)}, left_out={"medium": NOT_IN_TRACK_2},
        refusals=(
            Refusal(lambda a: a.paired_heads and a.n_head % 2,
                    lambda a: f"--paired_heads=true pairs heads, so --n_head={a.n_head} must be even; pass "
                              "--paired_heads=false or an even --n_head"),
            Refusal(lambda a: a.paired_heads and
                    not any(LayerRoles.for_depth(a.n_layer, paired_heads=True).paired_heads),
                    lambda a: f"--paired_heads=true pairs the short-window layers, and --n_layer={a.n_layer} has "
                              "none; pass --paired_heads=false or --n_layer=4 or more")),
        reads_previous_token=True),  # its interleaved positions do not extend token by token
    # The logit rescale and multi-token prediction pay only at scale: on the cpu preset they are one flag away.
    Technique(
        "logit_rescale", ("2025-12-26_LogitRescale",), "model",
        {"logit_offset": number(-math.inf, lo_open=True, hi_open=True)},
        {"speedrun": dict(logit_softcap=23.0, logit_offset=5.0), "medium": {}},
        left_out={"cpu": "it costs 0.10 of validation loss at this scale, beyond the seed noise (bench/results/v2)"},
        refusals=(Refusal(lambda a: a.logit_offset != 0 and a.logit_softcap == 0,
                          lambda a: f"--logit_offset={a.logit_offset} shifts the logits inside the softcap, which "
                                    "--logit_softcap=0 turns off; pass --logit_offset=0 or a softcap"),)),
    Technique(
        "mtp", ("2025-12-22_MultiTokenPrediction",), "loss", {"mtp_tokens": integer(1), "mtp_frac": UNIT_OPEN},
        {"speedrun": dict(mtp_tokens=3), "medium": {}},
        left_out={"cpu": "it does not pay at this scale: +0.015 of validation loss, inside the seed noise, for 9.5% "
                         "more time per step (bench/results/v2)"},
        refusals=(Refusal(lambda a: a.mtp_tokens > a.seq_len,
                          lambda a: f"--mtp_tokens={a.mtp_tokens} predicts more tokens than a --seq_len={a.seq_len} "
                                    f"sequence holds; pass at most {a.seq_len} (the records use 3)"),),
        only_when=(only_if(("mtp_frac",), lambda a: a.mtp_tokens > 1, "--mtp_tokens=2 or more",
                           lambda a: "--mtp_tokens=1 (the next-token loss alone)"),)),
    Technique(
        "prefix_tokens", ("2026-07-13_PrefixTokenPrediction",), "loss", {"prefix_loss_weight": number(0.0)},
        {}, left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        refusals=(Refusal(lambda a: a.prefix_loss_weight > 0 and not a.loss_weights_by_stage,
                          lambda a: f"--prefix_loss_weight={a.prefix_loss_weight:g} decays by the batch stages "
                                    "(record #89, T:1981-1983); pass --loss_weights_by_stage=true"),)),
    Technique(
        "stage_loss_weights", ("2025-12-22_MultiTokenPrediction", "2026-07-13_PrefixTokenPrediction"), "schedule",
        {"loss_weights_by_stage": ANY_BOOL},
        {}, left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        refusals=(Refusal(lambda a: a.loss_weights_by_stage and a.mtp_frac != 1,
                          lambda a: f"--mtp_frac={a.mtp_frac:g} sets equal MTP phases, which --loss_weights_by_stage"
                                    "=true replaces by the batch stages; drop one of them"),),
        only_when=(only_if(("loss_weights_by_stage",), lambda a: a.mtp_tokens > 1 or a.prefix_loss_weight > 0,
                           "--mtp_tokens=2 or more or a --prefix_loss_weight",
                           lambda a: "--mtp_tokens=1 and no prefix loss (the next-token loss alone)"),)),
    # Track 2's own layout and windows (records/track_2_medium/): the medium preset's record recipe sets them; the
    # short track's records keep the 2025-01-26 layout, so recipe v2 leaves them out there.
    Technique(
        "value_embed_tables", ("2025-08-28_Medium_NewValemb",), "model", {"value_embed_tables": integer(1)},
        {"medium": {}}, left_out=only_track_2("three value-embedding tables"),
        only_when=(only_with("value_embed_tables", switch="value_embeds"),
                   OnlyWhen(("value_embed_tables",), lambda a: a.value_embed_tables <= a.n_layer // 2,
                            lambda a, name: f"--value_embed_tables={a.value_embed_tables} is more tables than "
                            f"--n_layer={a.n_layer} uses (one per encoder layer: {a.n_layer // 2}); pass "
                            f"--value_embed_tables={a.n_layer // 2} or fewer, "
                            f"or --n_layer={2 * a.value_embed_tables}"))),
    Technique(
        "attention_free_layer", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"attention_free_layer": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("the attention-free layer after the middle")),
    Technique(
        "padded_tables", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"pad_embed_tables": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("tables of the vocabulary's rows")),
    Technique(
        "skip_layout", ("2025-12-31_BulkSmallTrackTransfer",), "model",
        {"skip_connections": Rule(lambda v: v == "" or skip_pairs(v) is not None,
                                  "empty, or comma-separated from>into block pairs, one per target, such as 6>9,4>10"),
         "skip_sigmoid": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("the mirrored U-net skips with linear weights"),
        refusals=(Refusal(lambda a: skips_out_of_order(a) is not None,
                          lambda a: f"--skip_connections={a.skip_connections}: {skips_out_of_order(a)}; pass pairs "
                                    "from>into with from < into < --n_layer"),),
        only_when=(only_with("skip_connections", "skip_sigmoid", switch="unet_skips"),)),
    Technique(
        "gate_dims", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"gate_dims": integer(1)},
        {"medium": {}}, left_out=only_track_2("gates that read 12 dims")),
    Technique(
        "second_embed", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"second_embed": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("one input embedding")),
    Technique(
        "residual_lambda_init", ("2025-12-31_BulkSmallTrackTransfer",), "model",
        {"residual_lambda_init": number(-math.inf, lo_open=True, hi_open=True)},
        {"medium": {}}, left_out=only_track_2("the stream's weight from 1")),
    Technique(
        "attn_output_lambda", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"attn_output_lambda": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("a learned weight on the value embedding, none on the output")),
    Technique(
        "cross_document_shifts", ("2025-12-31_BulkSmallTrackTransfer",), "model",
        {"cross_document_shifts": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("shifts that stop at document starts")),
    Technique(
        "record_init", ("2025-12-31_BulkSmallTrackTransfer",), "model",
        {"qkv_init_gain": number(0.0), "head_init_std": number(0.0), "value_embed_zero_init": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("the 2025-01-26 initialisation")),
    Technique(
        "bf16_numerics", ("2025-12-31_BulkSmallTrackTransfer",), "model",
        {"bf16_rotary": ANY_BOOL, "bf16_train_logits": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("fp32 rotary tables and training logits")),
    Technique(
        "bf16_val_softcap", ("2026-07-17_FP8DownProjection",), "model", {"bf16_val_softcap": ANY_BOOL}, {},
        left_out=dict.fromkeys(PRESETS, RECORD_ONLY)),
    Technique(
        "loss_sum", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"loss_sum": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("the mean training loss")),
    # Record #89's layout and residual stream (--recipe=record; docs/track1-record-fidelity.md rows 1-28, 38-52).
    Technique(
        "block_lists", ("2026-01-07_PairedHeadAttention", "2026-06-11_RecursiveFromBest"), "model",
        {"long_window_blocks": BLOCK_LIST, "attention_free_blocks": BLOCK_LIST, "paired_head_blocks": BLOCK_LIST,
         "value_embed_blocks": BLOCK_LIST},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS},
        refusals=(Refusal(lambda a: layout_problem(a) is not None, layout_problem),
                  Refusal(lambda a: a.long_window_blocks and a.paired_heads,
                          lambda a: "--paired_heads=true pairs for_depth's layers, and --long_window_blocks sets the "
                                    "layout by lists; pass --paired_head_blocks instead"),
                  Refusal(lambda a: bool(block_list(a.paired_head_blocks)) and a.n_head % 2 == 1,
                          lambda a: f"--paired_head_blocks pairs heads, so --n_head={a.n_head} must be even; pass "
                                    "an even --n_head")),
        reads_previous_token=True,  # paired blocks interleave positions, which the KV cache cannot extend
        only_when=(only_if(("attention_free_blocks", "paired_head_blocks", "value_embed_blocks"),
                           lambda a: bool(a.long_window_blocks), "--long_window_blocks (the layout by lists)",
                           lambda a: "for_depth's layout"),
                   only_with("value_embed_blocks", switch="value_embeds"),
                   only_if(("value_embed_tables", "attention_free_layer"), lambda a: not a.long_window_blocks,
                           "for_depth's layout (no --long_window_blocks)",
                           lambda a: f"the layout by lists (--long_window_blocks={a.long_window_blocks})"))),
    Technique(
        "ve_gate_reads_value", ("2026-02-03_VeTuned",), "model", {"ve_gate_reads_value": ANY_BOOL},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS},
        refusals=(Refusal(lambda a: a.ve_gate_reads_value and a.gate_dims % 2 == 1,
                          lambda a: f"--ve_gate_reads_value=true splits the gate's --gate_dims={a.gate_dims} dims "
                                    "between the stream and the value embedding; pass an even --gate_dims"),),
        only_when=(only_with("ve_gate_reads_value", switch="ve_gates"),)),
    Technique(
        "record_89_init", ("2026-02-03_VeTuned",), "model",
        {"value_embed_init_std": number(0.0), "attn_proj_uniform_init": ANY_BOOL},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS},
        refusals=(Refusal(lambda a: a.value_embed_init_std and a.value_embed_zero_init,
                          lambda a: f"--value_embed_init_std={a.value_embed_init_std} and --value_embed_zero_init=true "
                                    "both set the value tables' init; pass one"),)),
    Technique(
        "sublayer_lambdas", ("2026-03-06_SimplifyHC",), "model", {"sublayer_lambdas": ANY_BOOL},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS}),
    Technique(
        "attention_cache", ("2026-03-06_SimplifyHC",), "model", {"attention_cache_block": integer(0)},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS},
        refusals=(Refusal(lambda a: a.attention_cache_block >= a.n_layer - 1,
                          lambda a: f"--attention_cache_block={a.attention_cache_block} leaves no later block to "
                                    f"attend over its stream (--n_layer={a.n_layer}); pass at most {a.n_layer - 2}"),)),
    Technique(
        "mudd_gates", ("2026-04-29_XSAGatedLayers", "2026-05-27-MuddGatedAndDC"), "model",
        {"mudd_gate_block": integer(0), "output_gate_blocks": BLOCK_LIST, "xsa_blocks": BLOCK_LIST,
         "dc_blocks": BLOCK_LIST},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS},
        refusals=(Refusal(lambda a: a.mudd_gate_block >= a.n_layer,
                          lambda a: f"--mudd_gate_block={a.mudd_gate_block} is past the last layer ({a.n_layer - 1} "
                                    f"of --n_layer={a.n_layer}); pass a block below {a.n_layer}"),
                  Refusal(lambda a: paired_clash(a) is not None, paired_clash),
                  Refusal(lambda a: a.mudd_gate_block and a.skip_gates,
                          lambda a: "--skip_gates=true gates the skips, and --mudd_gate_block's post gate gates them "
                                    "too; pass --skip_gates=false"),
                  Refusal(lambda a: a.mudd_gate_block and a.x0_lambda_lr is not None,
                          lambda a: "--x0_lambda_lr sets the x0 lambdas' lr, and --mudd_gate_block injects x0 by "
                                    "gates instead; drop --x0_lambda_lr"),
                  Refusal(lambda a: a.mudd_gate_block and a.unet_skips and
                          any(b < a.mudd_gate_block for _, b in skip_pairs(a.skip_connections) or ()),
                          lambda a: f"--skip_connections={a.skip_connections} adds a skip before --mudd_gate_block="
                                    f"{a.mudd_gate_block}, whose post gate weighs it; skip into later blocks")),
        reads_previous_token=True,  # DC reads the keys before the token, which the KV cache's attention hides
        only_when=(only_if(("output_gate_blocks", "xsa_blocks", "dc_blocks"), lambda a: a.mudd_gate_block > 0,
                           "a --mudd_gate_block (the gates come from its generators)",
                           lambda a: "--mudd_gate_block=0"),)),
    Technique(
        "mudd", ("2026-04-22_MuddFormer",), "model", {"mudd": ANY_BOOL},
        {}, left_out={preset: RECORD_ONLY for preset in PRESETS},
        refusals=(Refusal(lambda a: a.mudd and mudd_problem(a) is not None, mudd_problem),
                  Refusal(lambda a: a.mudd and a.backout,
                          lambda a: "--backout=true subtracts a stream before the head, which --mudd=true's exit "
                                    "coefficient on h7 replaces (T:1394); pass --backout=false"))),
    Technique(
        "window_stages", ("2025-12-31_BulkSmallTrackTransfer",), "schedule",
        {"window_stages": Rule(lambda v: v == "" or window_stage_blocks(v) is not None,
                               "empty, or comma-separated positive block counts such as 3,7,11")},
        {"medium": {}}, left_out=only_track_2("the linear window growth"),
        refusals=(Refusal(lambda a: a.window_stages and not a.sliding_window,
                          lambda a: "--window_stages sets the sliding windows, which --sliding_window=false turns "
                                    "off; pass one of them"),
                  Refusal(lambda a: 0 < scheduled_steps(a) < len(window_stage_blocks(a.window_stages) or ()),
                          lambda a: f"--window_stages has {len(window_stage_blocks(a.window_stages))} stages but "
                                    f"{scheduled_steps_text(a)} has fewer steps, so some would never be "
                                    "used; pass fewer stages or more steps"))),
    # Track 2's clock and the record's own schedule shapes (M get_lr, get_muon_momentum, Yarn, get_ws).
    Technique(
        "extension_steps", ("2025-12-31_BulkSmallTrackTransfer",), "schedule", {"extension_steps": integer(0)},
        {"medium": {}}, left_out=only_track_2("one schedule over every step"),
        refusals=(Refusal(lambda a: a.extension_steps >= a.num_iterations,
                          lambda a: f"--extension_steps={a.extension_steps} leaves no scheduled step of "
                                    f"--num_iterations={a.num_iterations}; pass fewer extension steps or more "
                                    "steps"),)),
    Technique(
        "stage_lr_shares", ("2025-12-31_BulkSmallTrackTransfer",), "schedule",
        {"stage_lr_shares": Rule(lambda v: v == "" or lr_shares(v) is not None,
                                 "empty, or comma-separated shares in (0, 1] such as 0.5,0.76,0.865,1")},
        {"medium": {}}, left_out=only_track_2("lrs scaled by the batch's tokens to a power"),
        refusals=(Refusal(lambda a: a.stage_lr_shares and a.batch_schedule and len(lr_shares(a.stage_lr_shares)) !=
                          len(stage_fractions(a.batch_schedule) or ()),
                          lambda a: f"--stage_lr_shares has {len(lr_shares(a.stage_lr_shares))} shares but "
                                    f"--batch_schedule has {len(stage_fractions(a.batch_schedule) or ())} stages; "
                                    "pass one share per stage"),),
        only_when=(only_if(("stage_lr_shares",), lambda a: bool(a.batch_schedule), "a --batch_schedule",
                           lambda a: "no --batch_schedule (one batch throughout)"),)),
    Technique(
        "muon_momentum_cooldown", ("2025-12-31_BulkSmallTrackTransfer",), "optimizer",
        {"muon_momentum_cooldown_steps": integer(0)}, {"medium": {}},
        left_out=only_track_2("Muon's momentum at its peak to the end"),
        refusals=(Refusal(lambda a: a.muon_momentum_cooldown_steps > a.num_iterations,
                          lambda a: f"--muon_momentum_cooldown_steps={a.muon_momentum_cooldown_steps} is longer than "
                                    f"--num_iterations={a.num_iterations}; pass at most {a.num_iterations}"),),
        only_when=(only_with("muon_momentum_cooldown_steps", switch="muon"),)),
    Technique(
        "yarn", ("2025-12-31_BulkSmallTrackTransfer",), "schedule", {"yarn_max_window": integer(0)},
        {"medium": {}}, left_out=only_track_2("fixed rotary frequencies and attention scale"),
        only_when=(only_if(("yarn_max_window",), lambda a: a.sliding_window and bool(a.window_stages),
                           "--window_stages (YaRN follows their changes)",
                           lambda a: "no --window_stages" if a.sliding_window else "--sliding_window=false"),)),
    Technique(
        "final_window_blocks", ("2025-12-31_BulkSmallTrackTransfer",), "schedule",
        {"final_window_blocks": integer(0)}, {"medium": {}},
        left_out=only_track_2("the schedule's window at the last validation"),
        only_when=(only_with("final_window_blocks", switch="sliding_window"),)),
    Technique(
        "token_exact_windows", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"token_exact_windows": ANY_BOOL},
        {"medium": {}}, left_out=only_track_2("windows of whole blocks"),
        only_when=(only_with("token_exact_windows", switch="sliding_window"),)),
    Technique(
        "short_window_cap", ("2025-12-31_BulkSmallTrackTransfer",), "model", {"short_window_cap": integer(0)},
        {"medium": {}}, left_out=only_track_2("short windows of half the long one"),
        only_when=(only_with("short_window_cap", switch="sliding_window"),)),
    Technique(
        "rounded_stages", ("2026-07-17_FP8DownProjection",), "schedule", {"rounded_stages": ANY_BOOL}, {},
        left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        only_when=(only_if(("rounded_stages",), lambda a: bool(a.batch_schedule or a.window_stages),
                           "a --batch_schedule or --window_stages", lambda a: "neither"),)),
    Technique(
        "extension_window", ("2026-07-17_FP8DownProjection",), "schedule", {"extension_window_blocks": integer(0)},
        {}, left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        only_when=(only_if(("extension_window_blocks",), lambda a: a.sliding_window and a.extension_steps > 0,
                           "--extension_steps", lambda a: "no extension steps" if a.sliding_window
                           else "--sliding_window=false"),)),
    Technique(
        "stage_share_cooldown", ("2026-07-17_FP8DownProjection",), "schedule", {"stage_share_cooldown": ANY_BOOL},
        {}, left_out=dict.fromkeys(PRESETS, RECORD_ONLY)),
    Technique(
        "stage_doc_caps", ("2026-07-17_FP8DownProjection",), "data",
        {"stage_doc_len_caps": Rule(lambda v: v == "" or stage_doc_caps(v) is not None,
                                    "empty, or comma-separated token counts such as 896,2048,2048")},
        {}, left_out=dict.fromkeys(PRESETS, RECORD_ONLY),
        refusals=(Refusal(lambda a: a.stage_doc_len_caps and not a.bos_align,
                          lambda a: f"--stage_doc_len_caps={a.stage_doc_len_caps} packs whole documents from their "
                                    "start, so it needs --bos_align=true"),
                  Refusal(lambda a: a.stage_doc_len_caps and a.batch_schedule and len(stage_doc_caps(
                      a.stage_doc_len_caps)) != len(stage_fractions(a.batch_schedule) or ()),
                          lambda a: f"--stage_doc_len_caps has {len(stage_doc_caps(a.stage_doc_len_caps))} caps but "
                                    f"--batch_schedule has {len(stage_fractions(a.batch_schedule) or ())} stages; "
                                    "pass one cap per stage")),
        only_when=(only_if(("stage_doc_len_caps",), lambda a: bool(a.batch_schedule), "a --batch_schedule",
                           lambda a: "no --batch_schedule (one batch throughout)"),)),
)

# Recipe v2's batch geometry per preset, which the batch schedule's stages must split into whole sequences:
# on speedrun 16K-token sequences (1, 2, 3 per GPU on 8 GPUs); on cpu the record's ramp in 512-token
# sequences, 4 -> 8 -> 12, which 1, 2 and 4 ranks split (windows grow to the sequence).
V2_SHAPE = {"speedrun": dict(seq_len=16 * 1024),
            "cpu": dict(batch_tokens=6144, seq_len=512, window_final_tokens=512),
            "medium": {}}  # the medium preset is already its record's recipe


def v2_values(preset: str) -> dict[str, object]:
    """What --recipe=v2 sets on preset: its shape, then every technique's values there."""
    out = dict(V2_SHAPE[preset])
    for technique in TECHNIQUES:
        for name, value in technique.v2.get(preset, {}).items():
            assert name not in out, f"{name} is set by two techniques of recipe v2"
            out[name] = value
    return out


# --recipe=record: the public speedrun's record #89 (modded-nanogpt PR #342, "MLP down projection in FP8 with
# efficient delayed scaling"; KellerJordan/modded-nanogpt at f411b3d3: "T:n" is a line of its train_gpt.py, "K:n" of
# its triton_kernels.py), value for value (docs/track1-record-fidelity.md). Each line: its source, its values;
# --recipe=record --help shows every value with its source.
RECORD_LINES: tuple[tuple[str, dict[str, object]], ...] = (
    # the layout and the residual stream
    ("T:2236 (11 blocks); T:1494 bm_sizes (long windows 3, 10; block 6 attention-free), T:1592",
     dict(n_layer=11, long_window_blocks="3,10", attention_free_blocks="6")),
    ("T:1252 (paired heads); T:1543 (value tables 0-4 in turn)",
     dict(paired_head_blocks="0,2,5,9", value_embed_blocks="1,2,8,9,10")),
    ("T:1496 (key offset on the long windows); T:1216-1261 (tables of 50,304 rows)",
     dict(key_offset=True, value_embeds=True, pad_embed_tables=True)),
    ("T:1592-1595 (the stream after block 3 into block 6), T:1346 (lambda -1.5)",
     dict(unet_skips=True, skip_connections="3>6", skip_sigmoid=True)),
    ("T:1334-1338 (resid and post lambdas); T:1598 (blocks 8-10 attend over h7); T:1352-1401, T:1677 (MUDD)",
     dict(sublayer_lambdas=True, attention_cache_block=7, mudd=True)),
    ("T:1436-1484, T:1580 (gate generators); T:1238-1240 (XSA, DC and output-gate blocks)",
     dict(mudd_gate_block=4, output_gate_blocks="3,10", xsa_blocks="1,3,4,7", dc_blocks="10")),
    ("T:1326-1327, T:1547 (smear); T:1613-1614 (the value gate reads [a[:6], ve[:6]])",
     dict(smear=True, ve_gates=True, ve_gate_reads_value=True)),
    ("T:1103, T:1161 (lambdas on W_qkv and W_O); T:1293 (O uniform in vo_bank); T:1261 (0.01 N(0, 1))",
     dict(attn_output_lambda=True, attn_proj_uniform_init=True, value_embed_init_std=0.01)),
    ("T:1902-1903 (377,280 x 768), T:1331 (sign table)",
     dict(bigram_vocab_size=15 * 50304 // 2, bigram_dim=768, bigram_sign=True)),
    ("T:1225-1226 (the embedding is its transpose while tied: tied_embed_steps)", dict(head_init_std=0.005)),
    # attention's additions (XSA and DC: the blocks above) and Muon's groups
    ("T:1272-1279: Q and K orthogonalised as 3 + 3 (256 x 768) head-pair groups", dict(muon_qk_head_pairs=True)),
    # the loss
    ("T:1980-1988: MTP weights (1, .5, .25) by batch stage", dict(mtp_tokens=3, loss_weights_by_stage=True)),
    ("T:1981-1983: 0.25 in stage 0, 0.25(1-t) in stage 1, 0 after; T:2317 the table", dict(prefix_loss_weight=0.25)),
    ("T:1002-1003, T:1013-1017: rotary's cos and sin stored and applied in bf16", dict(bf16_rotary=True)),
    ("T:1689-1691: validation's softcap on the bf16 logits in bf16, its cross-entropy in fp32",
     dict(bf16_val_softcap=True)),
    ("T:2360: the rank's summed per-token losses (K:1089)", dict(loss_sum=True)),
    ("K:1003-1005: the softcap's sigmoid rounded to bf16 before every use", dict(bf16_train_logits=True)),
    ("T:1690, K:1210: 23 sigmoid((logits + 5) / 7.5)", dict(logit_softcap=23.0, logit_offset=5.0)),
    ("K:1073-1079 (MTP targets cut at the sequence's end only), T:1548 (smear), T:1113 (key offset), T:1786-1793 "
     "and T:1535-1536 (the bigram hashes)",
     dict(cross_document_shifts=True)),
    # FP8
    ("T:1498: FP8 up and down projections in training (bf16 where the GPU has no FP8)", dict(fp8_mlp=True)),
    ("T:1225: x 100/448, W 1.6/448, grad 0.75/448", dict(fp8_head_scales="record")),
    # schedules
    ("T:1890-1891 (1270 + 15 steps), T:1898", dict(num_iterations=1285, extension_steps=15, val_every=250)),
    ("T:1980-1987 (8, 16, 24 x 16K tokens), T:1943 (stages from round(k * 1270 / 3))",
     dict(batch_tokens=393216, batch_schedule="1/3,2/3,1", rounded_stages=True)),
    ("T:1816, T:1821: one varlen sequence per GPU, 16K/32K/48K tokens", dict(batch_sequences=8, seq_len=49152)),
    ("T:1809 (BOS-aligned); T:1980-1987 train_max_seq_len, T:1752", dict(bos_align=True,
                                                                         stage_doc_len_caps="896,2048,2048")),
    ("T:1980-1985 (lr_mul); T:1968-1976 (get_lr)", dict(stage_lr_shares="1,1.52,1.73", stage_share_cooldown=True)),
    ("T:1992 (cooldown_frac 0.60: from int(0.4 x 1270) = 508), T:1975", dict(cooldown_frac=0.6, lr_final_frac=0.15)),
    ("T:1980-1987: (1, 3) (3, 7) (5, 11), extension (6, 13)",
     dict(window_stages="3,7,11", extension_window_blocks=13, short_window_cap=6)),
    ("T:1933, T:2092-2093 (final validation: 20 blocks, short 6, no YaRN); T:1139-1141 (FA3's window)",
     dict(final_window_blocks=20, token_exact_windows=True)),
    ("T:2114-2116 (YaRN at each long-window change), T:1035", dict(yarn_max_window=13, attn_scale=0.1)),
    ("T:1995-2004: 0.85 -> 0.95 over 300 steps, back over the last 50", dict(muon_momentum_cooldown_steps=50)),
    # optimizers
    ("T:2070-2075, T:168-174", dict(muon_lr=0.023, polar_express=True, normuon=True, normuon_beta2=0.9)),
    ("T:509-522, T:1301: lr x max(1, rows/cols)^0.5 of the stored shape x lr_mul: Q, K, V, O 1, c_fc 2, c_proj 4",
     dict(record_muon_shapes=True)),
    ("T:2075, T:2068", dict(cautious_wd=True, muon_cautious_wd=1.2, adam_cautious_wd=0.005)),
    ("T:2104-2106 (odd steps), T:843-862 (in place, strict mask)", dict(adam_every=2, adam_master=False,
                                                                       adam_eps=1e-10)),
    ("T:554-555: fp32 moments", dict(adam_moments_fp32=True)),
    ("T:2033, T:2038, T:2066", dict(adam_beta1=0.5, adam_beta2=0.95, head_lr=0.008, token_embed_lr=0.008)),
    ("T:2033, T:2038 (wd_mul 150); T:1943 (the split at 847 | 1)", dict(head_embed_wd_mul=150.0,
                                                                       tied_embed_steps=847)),
    ("T:2034, T:2037 (lr_mul 75, betas (0.75, 0.95), wd_mul 5)",
     dict(embed_lr=0.6, table_adam_beta1=0.75, value_embed_wd_mul=5.0, bigram_wd_mul=5.0)),
    ("T:2030: lr_mul 5, (0.9, 0.99), wd_mul 0", dict(scalar_lr=0.04, scalar_adam_beta1=0.9, scalar_adam_beta2=0.99)),
    ("T:2031 (lr_mul 0.01), T:2032 (decay 0.005)", dict(gate_adam_lr=8e-5, gate_scalar_betas=True, ve_gate_lr=0.008)),
)
# The record's values that the speedrun preset's defaults already are (the 2025-01-26 reference's): sources only.
RECORD_SHARED_LINES: tuple[tuple[str, dict[str, object]], ...] = (
    ("T:2237-2239, T:1299 (6 heads of 128, 768 wide, MLP 3072), T:1216 (50,257 tokens, padded to 50,304)",
     dict(model_dim=768, n_head=6, head_dim=128, vocab_size=50257)),
    ("T:1106 (rms of q and k before rotary), T:46-48 (relu squared), T:1690 (the softcap's 7.5)",
     dict(qk_norm=True, mlp_act="relu2", logit_temperature=7.5)),
    ("T:1886, T:1888 (10,485,760 validation tokens in 262,144-token sequences per rank)",
     dict(val_tokens=10_485_760, val_seq_len=262_144)),
    ("T:1995-2001: 0.85 -> 0.95 over 300 steps", dict(muon_momentum_start=0.85, muon_momentum=0.95,
                                                      muon_momentum_warmup_steps=300)),
)
# The cpu preset keeps the record's 11 blocks and roles at its width (256 = 4 heads of 64; the gates read 12 dims
# of it) and the record's forms scaled to its 60 steps (never tuned): 59 scheduled + 1 extension (15/1285 of 60),
# stage starts round(59k/3) = 20, 39, the split at 39 | 1, momentum warm-up 300 x 60/1285 = 14 and cool-down 2,
# validation every 250 x 60/1285 = 12; the batch ramp in 4 packed sequences of 512/1024/1536 tokens (1, 2 and 4
# ranks split them, as V2_SHAPE's 6,144 tokens), whose 4/8/12 blocks hold the record's windows.
RECORD_CPU_LINES: tuple[tuple[str, dict[str, object]], ...] = (
    ("cpu: a smaller bigram table (recipe v2's cpu rows), over the whole stream as T:1903",
     dict(bigram_vocab_size=5 * 50304, bigram_dim=0)),
    ("cpu: no FP8 matmul on a CPU", dict(fp8_mlp=False)),
    ("cpu: documents unaligned and uncut, as recipe v2's cpu: the bundled sample's documents are ~7.8K tokens long "
     "(median), and cutting them at 896 tokens used up its training shard by step 46", dict(bos_align=False,
                                                                                             stage_doc_len_caps="")),
    ("cpu: the record's 1285 steps scaled to 60", dict(num_iterations=60, extension_steps=1, val_every=12,
                                                       muon_momentum_warmup_steps=14, muon_momentum_cooldown_steps=2,
                                                       tied_embed_steps=39)),
    ("cpu: the record's 1/3, 2/3, 1 ramp in 4 sequences of 512-1536 tokens",
     dict(batch_tokens=6144, batch_sequences=4, seq_len=1536)),
)


RECORD_PRESET_LINES = {"speedrun": RECORD_LINES, "cpu": RECORD_LINES + RECORD_CPU_LINES,
                       "medium": ()}  # track 2 has its own record: the medium preset
RECORD_VALUES = {preset: {name: value for _, values in lines for name, value in values.items()}
                 for preset, lines in RECORD_PRESET_LINES.items()}
RECORD_SOURCES = {preset: {name: source for source, values in lines + (RECORD_SHARED_LINES if preset == "speedrun"
                                                                        else ()) for name in values}
                  for preset, lines in RECORD_PRESET_LINES.items()}

# A recipe's values per preset, applied on top of the preset (command-line flags win over both).
RECIPES: dict[str, dict[str, dict]] = {
    "reference": {preset: {} for preset in PRESETS},
    "v2": {preset: v2_values(preset) for preset in PRESETS},
    "record": RECORD_VALUES,
}
# What --recipe=auto (the default) runs on each preset: on the speedrun preset (8xH100, the GPU default) the newest
# record; on cpu the reference, which the cpu ablation of the three recipes keeps (docs/recipes.md); medium is
# track 2's record itself.
DEFAULT_RECIPES = {"speedrun": "record", "cpu": "reference", "medium": "reference"}

# Where each recipe value comes from, for --help (the reference's and v2's: the flags' own help)
RECIPE_SOURCES = {recipe: RECORD_SOURCES if recipe == "record" else {preset: {} for preset in PRESETS}
                  for recipe in RECIPES}


def left_out_line(args: Hyperparameters) -> str | None:
    """The run-log line of a recipe-v2 run on a preset that leaves out techniques the speedrun's v2 has: why, and the
    flags that add them (track 2's own techniques are no part of the short track's v2, and go unsaid)."""
    missing = [t for t in TECHNIQUES if args.preset in t.left_out and "speedrun" in t.v2 and not t.is_on(args)]
    if args.recipe != "v2" or not missing:
        return None
    return f"recipe v2 on the {args.preset} preset leaves out " + "; ".join(
        f"{t.name}: {t.left_out[args.preset]} ({' '.join(as_flags(t.v2['speedrun']))} adds it)" for t in missing)


def check_techniques(args: Hyperparameters) -> None:
    """Refuses, in one line, a technique's flags that conflict with each other or with the shape."""
    for technique in TECHNIQUES:
        for refusal in technique.refusals:
            if refusal.when(args):
                raise UsageError(refusal.why(args))


# -----------------------------------------------------------------------------
# Validation: each flag's range, and the relations between flags

MAX_STEPS = 10**9  # years of steps at any speed: a larger count is a typo, and the step counters stay machine-sized
# Every Hyperparameters field and what it accepts (a technique's own flags: its declaration); validate_args
# refuses a field missing here.
FLAG_RULES: dict[str, Rule] = {
    "preset": one_of(*PRESETS), "recipe": one_of("auto", *RECIPES), "seed": integer(0, 2**63 - 1),
    "train_files": NON_EMPTY, "val_files": NON_EMPTY, "val_tokens": integer(1), "train_cycle": ANY_BOOL,
    "batch_tokens": integer(1), "seq_len": integer(BLOCK_SIZE),
    "val_seq_len": integer(BLOCK_SIZE), "num_iterations": integer(1, MAX_STEPS), "cooldown_frac": UNIT,
    "lr_final_frac": UNIT,
    "val_every": integer(0), "window_final_tokens": integer(1), "sliding_window": ANY_BOOL,
    "vocab_size": integer(1), "n_layer": integer(2), "model_dim": integer(1), "n_head": integer(1),
    "head_dim": integer(4), "attn_scale": number(0.0, lo_open=True), "logit_softcap": number(0.0),
    "value_embeds": ANY_BOOL, "unet_skips": ANY_BOOL, "zero_init": ANY_BOOL, "qk_norm": ANY_BOOL,
    "mlp_act": one_of("relu2", "gelu"), "logit_temperature": number(0.0, lo_open=True),
    "muon": ANY_BOOL, "muon_lr": LR, "muon_momentum": BETA,
    "muon_momentum_start": BETA, "muon_momentum_warmup_steps": integer(0), "ns_steps": integer(1),
    "adam_beta1": BETA, "adam_beta2": BETA, "adam_eps": number(0.0, lo_open=True), "head_lr": LR, "embed_lr": LR,
    "scalar_lr": LR, "matrix_adam_lr": LR, "weight_decay": number(0.0), "dtype": one_of("bf16", "fp32"),
    "fp8_head": ANY_BOOL, "attention": one_of("auto", "flex", "banded"),
    "compile": one_of("auto", "model", "loss", "off"), "coordinate_descent_tuning": ANY_BOOL,
    "warmup_steps": integer(0),
    "collective_timeout_s": integer(1), "log_dir": NON_EMPTY, "run_id": PLAIN_NAME, "log_train_loss": ANY_BOOL,
    "profile_steps": integer(0), "target_val_loss": number(0.0, lo_open=True), "stop_at_target": ANY_BOOL,
    "tensorboard": ANY_BOOL, "usd_per_gpu_hour": number(0.0), "checkpoint_every": integer(0),
    "checkpoint_final": ANY_BOOL,
    "checkpoint_keep": integer(1), "resume": ANY_TEXT, "stop_after": integer(0),
    "hellaswag_every": integer(0), "hellaswag_data": ANY_TEXT, "sample_at_end": integer(0),
    **{name: rule for technique in TECHNIQUES for name, rule in technique.flags.items()},
}


# The flags outside TECHNIQUES that do nothing unless another setting holds (a technique declares its own).
ONLY_WHEN: tuple[OnlyWhen, ...] = (
    only_with("muon_lr", "muon_momentum", "muon_momentum_start", "muon_momentum_warmup_steps", "ns_steps",
              switch="muon"),
    only_with("matrix_adam_lr", switch="muon", on=False),
    only_if(("logit_temperature",), lambda a: a.logit_softcap > 0, "a --logit_softcap above 0",
            lambda a: "--logit_softcap=0 (no softcap)"),
    only_if(("window_final_tokens",), lambda a: a.sliding_window and not a.window_stages,
            "--sliding_window=true and no --window_stages",
            lambda a: f"--window_stages={a.window_stages}" if a.window_stages else "--sliding_window=false"),
    only_if(("hellaswag_data",), lambda a: a.hellaswag_every > 0, "a --hellaswag_every above 0",
            lambda a: "--hellaswag_every=0 (no HellaSwag)"),
    OnlyWhen(("stop_after",), lambda a: a.stop_after < a.num_iterations,
             lambda a, name: f"--stop_after={a.stop_after} is at or past the last step (--num_iterations="
                             f"{a.num_iterations}), so it never stops the run: pass a step before it, or drop it"),
    only_if(("coordinate_descent_tuning",), lambda a: a.compile in ("model", "auto"), "--compile=model",
            lambda a: f"--compile={a.compile}"),
    *(rule for technique in TECHNIQUES for rule in technique.only_when),
)


def check_only_when(args: Hyperparameters, explicit: typing.Collection[str]) -> None:
    """Refuses, in one line, a flag the command line sets that this run would never use (ONLY_WHEN): the run log
    would record a value that changed nothing."""
    for rule in ONLY_WHEN:
        for name in rule.flags:
            if name in explicit and not rule.holds(args) and (
                    getattr(args, name) != getattr(Hyperparameters, name)):
                raise UsageError(rule.why(args, name))


def check_flag_ranges(args: Hyperparameters) -> None:
    """Refuses, with one line naming the flag and its valid range, any value outside its FLAG_RULES range."""
    missing = [f.name for f in fields(Hyperparameters) if f.name not in FLAG_RULES]
    assert not missing, f"no validation rule for {missing}"  # a new field needs its entry in FLAG_RULES
    for name, rule in FLAG_RULES.items():
        value = getattr(args, name)
        if not rule.ok(value):
            raise UsageError(f"bad value {value!r} for --{name}; valid: {rule.valid}")


def check_batch_schedule(args: Hyperparameters) -> None:
    """The stages grow to batch_tokens, each whole sequences of seq_len tokens."""
    fracs = stage_fractions(args.batch_schedule) or []
    flag = f"--batch_schedule={args.batch_schedule}"
    if any(later < earlier for earlier, later in zip(fracs, fracs[1:])):
        raise UsageError(f"{flag} shrinks the batch; the stages must grow, each at least the one before (the "
                         "record's is 1/3,2/3,1)")
    if fracs and fracs[-1] != 1:
        raise UsageError(f"{flag} never reaches --batch_tokens={args.batch_tokens}: its last stage must be 1, the "
                         "batch the learning rates are set for (pass --batch_tokens for a smaller batch)")
    if 0 < scheduled_steps(args) < len(fracs):  # equal-length stages: some would get no step and never train
        raise UsageError(f"{flag} has {len(fracs)} stages but {scheduled_steps_text(args)} has fewer steps; every "
                         "stage needs at least one step: pass fewer stages or more steps")
    unit = Fraction(args.seq_len, args.batch_tokens)  # the smallest stage: one sequence
    fixed_length = [] if args.batch_sequences else fracs  # packed sequences' lengths: the batch_sequences technique
    for frac in fixed_length:
        if frac % unit:
            raise UsageError(f"{flag}: stage {frac} of --batch_tokens={args.batch_tokens} is "
                             f"{float(args.batch_tokens * frac):g} tokens, not whole sequences of --seq_len="
                             f"{args.seq_len}; use multiples of {unit} (one sequence) for every stage")


def validate_args(args: Hyperparameters, explicit: typing.Collection[str] | None = None) -> None:
    """Refuses, in one line, any value or combination of values the run would trip over later, and (given the
    flags the command line set) any of them this run would never use."""
    check_flag_ranges(args)
    # Relations between flags, once every flag is in range.
    for name in ("seq_len", "val_seq_len"):
        if getattr(args, name) % BLOCK_SIZE:
            raise UsageError(f"--{name}={getattr(args, name)} is not a multiple of the {BLOCK_SIZE}-token block")
    if args.val_tokens % args.val_seq_len:
        raise UsageError(f"--val_tokens={args.val_tokens} is not a multiple of --val_seq_len={args.val_seq_len}")
    if args.n_layer % 2 and not args.long_window_blocks:
        raise UsageError(f"--n_layer={args.n_layer}: the U-net layout needs an even depth >= 2 (or the layout by "
                         "lists, --long_window_blocks)")
    if args.head_dim % 4:
        raise UsageError(f"--head_dim={args.head_dim} must be a positive multiple of 4 (half-truncated rotary)")
    if args.value_embeds and args.model_dim != args.n_head * args.head_dim:
        raise UsageError(f"--value_embeds=true adds model_dim-wide tables to the values, so --model_dim="
                         f"{args.model_dim} must equal --n_head x --head_dim = {args.n_head * args.head_dim}; "
                         "change one of them or pass --value_embeds=false")
    check_batch_schedule(args)
    check_techniques(args)
    if explicit is not None:
        check_only_when(args, explicit)
    if args.resume == "auto" and not args.run_id:
        raise UsageError("--resume=auto needs --run_id=NAME: a restarted run finds its checkpoints under "
                         "log_dir/NAME (and never another run's)")


# What a resumed run must share with its checkpoint: the model's shape and the optimizers' layout.
MODEL_SHAPE_FIELDS = ("vocab_size", "n_layer", "model_dim", "n_head", "head_dim", "value_embeds", "unet_skips")
# which matrices Muon owns, and what state it keeps for them
OPTIMIZER_STRUCTURE_FIELDS = ("muon",) + tuple(t.switch for t in TECHNIQUES if t.optimizer_state)


def check_compatible(path: Path, meta: dict, args: Hyperparameters) -> None:
    """Refuses a checkpoint this run cannot continue: another model shape or optimizer layout, or no
    steps left to train. Any world size can continue any other's checkpoint."""
    for names, what in ((MODEL_SHAPE_FIELDS, "model"), (OPTIMIZER_STRUCTURE_FIELDS, "optimizer")):
        for name in names:
            saved = meta["hyperparameters"].get(name, getattr(Hyperparameters, name))  # unrecorded: its default then
            if saved != getattr(args, name):
                raise UsageError(f"checkpoint {path} has {name}={saved} but this run has {name}={getattr(args, name)}; "
                                 f"pass the same {what} flags to resume it")
    if meta["step"] >= args.num_iterations:
        raise UsageError(f"checkpoint {path} is at step {meta['step']}, at or past --num_iterations="
                         f"{args.num_iterations}: nothing is left to train; pass a larger --num_iterations")


def structure_flags(args: Hyperparameters) -> dict[str, object]:
    """The hyperparameters that decide which tensors a checkpoint holds (the model's and the optimizers' layout),
    with this run's values: what a checkpoint of other tensors is compared by."""
    names = [f.name for f in fields(ModelConfig)] + list(OPTIMIZER_STRUCTURE_FIELDS)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


# -----------------------------------------------------------------------------
# Distributed setup and device choices (decided once, here)

@dataclass
class Place:
    """Where this process runs: its rank among world_size processes, and its device."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()


@dataclass
class Runtime(Place):
    """The Place and what start-up decided for its device: dtype and kernels."""
    dtype: torch.dtype
    attention: str  # flex | banded
    fp8_head: bool
    compile: str  # model | loss | off
    chunked_loss: bool = False  # head + loss a chunk of rows at a time (ChunkedHeadLoss): the CPU path
    compile_attention: bool = False  # flex_attention compiled on its own: the model around it is not compiled
    host_malloc: str = "default"  # glibc's settings on a CPU run (keep_freed_host_memory)
    fp8_mlp: bool = False  # the MLPs' training forward in FP8 (--fp8_mlp on a device with FP8 matmuls)

    # What a whole-model compile (--compile=model) decides besides the model, each in one place:
    @property
    def compile_fp8(self) -> bool:
        """The FP8 head's insides compiled by inductor (fp8_kernel), as the record compiles them."""
        return self.fp8_head and self.compile == "model"

    @property
    def compile_newton_schulz(self) -> bool:
        """The record compiles Newton-Schulz: its five bf16 iterations fuse into a few kernels per shape."""
        return self.compile == "model"

    @property
    def grad_sync_from_hooks(self) -> bool:
        """Reduce-scatters launched from gradient hooks during backward. Under a compiled backward the hooks fire
        only after all of it (bench/overlap_probe.py), so GradientSync launches every bucket at the end instead,
        in the order the optimizers consume them."""
        return self.compile != "model"

    def resolved(self) -> dict:
        """What start-up decided (not what was asked for): the summary and checkpoints record this."""
        return {"attention": self.attention, "fp8_head": self.fp8_head, "fp8_mlp": self.fp8_mlp,
                "compile": self.compile,
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "chunked_loss": self.chunked_loss, "compile_attention": self.compile_attention,
                "compile_fp8": self.compile_fp8, "compile_newton_schulz": self.compile_newton_schulz,
                "grad_sync_from_hooks": self.grad_sync_from_hooks,
                "host_malloc": self.host_malloc, "world_size": self.world_size}


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


TORCHRUN_HINT = "launch with torchrun (torchrun --standalone --nproc_per_node=N train_gpt.py), which sets them all"


def launch_variable(name: str, default: int, lo: int, hi: int | None = None) -> int:
    """An integer that torchrun sets in the environment; one line naming it when it is malformed or out of range."""
    text = os.environ.get(name, "").strip()
    if text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lo or (hi is not None and value > hi):
        valid = f"an integer at least {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise UsageError(f"environment variable {name}={text!r} is not {valid}: unset it for a one-process run, "
                         f"or {TORCHRUN_HINT}")
    return value


def launch_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables, checked before any of them is used: a process
    group joined with a bad one hangs or fails deep in torch."""
    world_size = launch_variable("WORLD_SIZE", 1, 1)
    rank = launch_variable("RANK", 0, 0, world_size - 1)
    local_rank = launch_variable("LOCAL_RANK", 0, 0, world_size - 1)
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name, "").strip():
                raise UsageError(f"environment variable WORLD_SIZE={world_size} asks for a distributed run, but "
                                 f"{name} is not set: set MASTER_ADDR and MASTER_PORT, or {TORCHRUN_HINT}")
        launch_variable("MASTER_PORT", 0, 1, 65535)
    return rank, local_rank, world_size


def join_process_group(args: Hyperparameters) -> Place:
    """This process's rank and device; joins the process group when launched by torchrun."""
    rank, local_rank, world_size = launch_environment()
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                             "set --nproc_per_node to at most the GPU count")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dcp()  # imported after the group forms, torch's sharded-tensor modules hold it past destroy_process_group
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=args.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return Place(rank, local_rank, world_size, device)


def changed_from_recipe(overrides: dict[str, object], args: Hyperparameters) -> set[str]:
    """The flags the command line sets to other values than the run's preset and recipe give them: a rebuilt run's
    command line (records/rebuild_run.py), which repeats every value, asks for nothing its recipe did not."""
    given = recipe_values(args.preset, args.recipe)
    return {name for name, value in overrides.items() if value != given.get(name)}


def choose_runtime(place: Place, args: Hyperparameters, explicit: typing.Collection[str] = ()) -> Runtime:
    """The device's dtype and kernels for this run's hyperparameters (explicit: the flags the command line set)."""
    kernels = choose_kernels(args, place.device.type, fp8_supported(place.device), explicit)
    if kernels["compile"] == "model":
        configure_inductor(args)
    return Runtime(**vars(place), dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, **kernels,
                   host_malloc=keep_freed_host_memory() if place.device.type == "cpu" else "default")


def setup_runtime(args: Hyperparameters) -> Runtime:
    return choose_runtime(join_process_group(args), args)


def choose_kernels(args: Hyperparameters, device_type: str, fp8_capable: bool,
                   explicit: typing.Collection[str] = ()) -> dict:
    """Runtime's kernel choices for a device: attention, FP8 head and MLP, what is compiled, the head + loss path.
    FP8 a recipe asks for runs in bf16 where the device has none; FP8 the command line asks for is refused there."""
    for name in ("fp8_head", "fp8_mlp"):
        if name in explicit and getattr(args, name) and not fp8_capable:
            raise UsageError(f"--{name}=true needs FP8 matmuls (a CUDA GPU of compute capability >= 8.9, as H100) "
                             f"and this run is on {device_type} without them: drop --{name} (bf16 runs there) "
                             f"or pass --{name}=false")
    attention = args.attention if args.attention != "auto" else ("flex" if device_type == "cuda" else "banded")
    if attention == "flex" and device_type != "cuda":  # torch's flex_attention has no backward off CUDA
        raise UsageError(f"--attention=flex needs a CUDA GPU and this run is on {device_type}: pass --attention=banded "
                         "(or auto, which picks it off CUDA)")
    # Inductor's CPU codegen is not reliable for the whole model; the loss alone is the big CPU win.
    compile_mode = args.compile if args.compile != "auto" else ("model" if device_type == "cuda" else "loss")
    fp8_head = args.fp8_head and fp8_capable
    # On CPU the full fp32 logits cost more than the head matmuls; GPUs and whole-model compiles keep the plain loss.
    # Uncompiled flex_attention materializes the whole score matrix (58 GB per layer at 48K tokens): outside a
    # compiled model it is compiled on its own, as PyTorch's documentation prescribes.
    return dict(attention=attention, fp8_head=fp8_head, fp8_mlp=args.fp8_mlp and fp8_capable, compile=compile_mode,
                chunked_loss=device_type == "cpu" and not fp8_head and compile_mode != "model",
                compile_attention=attention == "flex" and compile_mode != "model")


def configure_inductor(args: Hyperparameters) -> None:
    """The record's compiler settings for a compiled model."""
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = args.coordinate_descent_tuning  # R: tunes each kernel's tiling
    if args.yarn_max_window:  # M L34: room for a graph per YaRN state, training and validation, and more
        import torch._dynamo.config as dynamo_config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)


# -----------------------------------------------------------------------------
# Training loop: start-up, set-up, warm-up, resume, the loop and its step, the finish

@torch.no_grad()
def evaluate(model, val_seqs: list[np.ndarray], window: Tensor, rt: Runtime) -> float:
    """Mean loss over the whole validation budget (every sequence has the same length), across ranks."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=rt.device)
    for seq in val_seqs:
        total += model(*to_device(seq, rt.device), window).double()
    stats = torch.stack([total, torch.tensor(float(len(val_seqs)), dtype=torch.float64, device=rt.device)])
    if rt.world_size > 1:
        dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def mean_over_ranks(value: Tensor, rt: Runtime) -> float:
    value = value.detach().double()
    if rt.world_size > 1:
        dist.all_reduce(value)
        value /= rt.world_size
    return value.item()


@dataclass
class Run:
    """What set-up builds for one launch of a run, and every phase after it uses."""
    args: Hyperparameters
    rt: Runtime
    log: RunLog
    batches: BatchSchedule
    model: GPT  # its parameters are what trains; checkpoints and checks read them
    step_model: nn.Module  # the model as the steps call it: torch.compile'd under --compile=model
    opt: Optimizers
    stream: TokenStream
    loader: DistributedTokenLoader
    schedules: StepTensors
    val_seqs: list[np.ndarray]
    hellaswag_items: list | None  # this rank's share, under --hellaswag_every
    checkpoints: Checkpoints
    energy: EnergyMeter
    metrics: Metrics
    started: float  # when this launch started (time.perf_counter): its wall time
    peak_tflops: float | None  # the device's dense bf16 peak, where runlog knows it: MFU's denominator, per GPU
    earlier_segments: list[dict] = dataclasses.field(default_factory=list)  # of the checkpoint resumed from
    earlier_target: dict | None = None  # where an earlier launch reached the target loss

    def segments(self, start_step: int, step: int, clock: Clock) -> list[dict]:
        """The run's history through `step`: the earlier launches, then this one's steps, time and energy so far
        (the energy is summed over ranks: every rank calls this)."""
        tokens = self.batches.tokens_before(step) - self.batches.tokens_before(start_step)
        return self.earlier_segments + [segment(self.checkpoints.folder.run_id, start_step, step, tokens, clock.ms,
                                                self.energy.totals(self.rt), time.perf_counter() - self.started)]

    def tokens_through(self, start_step: int, step: int) -> int:
        """The run's training tokens through `step`, earlier launches included."""
        earlier = sum(s["tokens"] or 0 for s in self.earlier_segments)
        return earlier + self.batches.tokens_before(step) - self.batches.tokens_before(start_step)

    def earlier_train_ms(self) -> float:
        return sum(s["train_time_ms"] or 0.0 for s in self.earlier_segments)

    def earlier_train_joules(self) -> float | None:
        """The earlier launches' training joules (ranks summed); None if one of them could not measure."""
        known = [s["energy_j"] for s in self.earlier_segments]
        return None if None in known else sum(e["train"] for e in known)

    def save_checkpoint(self, step: int, segments: list[dict], watch: FiniteWatch, target: dict | None) -> None:
        """A checkpoint of the state after `step`, never of a diverged one (FiniteWatch.check)."""
        watch.check(self.model, self.rt, step)
        state = training_state(self.model, self.opt, self.stream, step, segments)
        watch.newest_good = self.checkpoints.save(dataclasses.replace(state, target=target))


@dataclass
class Results:
    """What the loop measured so far: the last val loss, the HellaSwag curve, the target, this launch's FLOPs."""
    val_loss: float = float("nan")
    hellaswag_curve: list = dataclasses.field(default_factory=list)  # [step, acc, acc_norm, examples]
    target: dict | None = None  # where a validation first reached --target_val_loss (target_reached)
    flops: float = 0.0
    last_ms: float = 0.0  # the clock at the previous step's line


def start(argv: list[str]) -> tuple[Hyperparameters, Runtime, RunFolder, Path | None, list[str], list | None]:
    """Start-up, before anything is written: the flags, this process's rank and device, the checkpoint to resume
    (whose hyperparameters the run continues), the device choices and the run's folder. Everything a bad flag,
    world size or checkpoint can fail, fails here. Also returns lines for the run log and this rank's HellaSwag
    examples (None without --hellaswag_every)."""
    overrides = parse_overrides(Hyperparameters, argv)
    check_torch_install(overrides.get("preset"))  # a torch outside the range, or one that cannot use this node's GPUs
    # A resumed run's unused flags are judged on its checkpoint's values, not on this preset's.
    args = resolve_hyperparameters(overrides, torch.cuda.is_available(), check_unused=not overrides.get("resume"))
    place = join_process_group(args)
    batch_schedule(args, place.world_size)  # a world size that cannot split the batch is refused first
    checkpoint, notes = (choose_checkpoint(args.resume, Path(args.log_dir), args.run_id, place) if args.resume
                         else (None, []))
    if checkpoint is not None:
        meta = read_checkpoint_meta(checkpoint)
        args, resumed = resumed_hyperparameters(meta["hyperparameters"], overrides, args, checkpoint)
        check_compatible(checkpoint, meta, args)
        batch_schedule(args, place.world_size)  # the checkpoint's batch on this launch's world size
        notes += resumed
    elif overrides.get("resume"):  # --resume=auto that found nothing is a fresh run: its unused flags count
        check_only_when(args, overrides)
    # a resumed run continues its checkpoint's preset, which its notes name
    if (place.is_master and checkpoint is None and args.preset == "cpu" and not torch.cuda.is_available()
            and "preset" not in overrides):
        print("no GPU found: running the cpu preset (small model, bundled sample data); "
              "pass --preset=speedrun for the GPU default (record #89's recipe)", flush=True)
    rt = choose_runtime(place, args, changed_from_recipe(overrides, args))
    check_data(args, place.is_master)
    hellaswag = downstream_inputs(args, rt)
    folder = claim_run_folder(Path(args.log_dir), args.run_id, args.preset, args.resume, rt, checkpoint)
    return args, rt, folder, checkpoint, notes, hellaswag


def downstream_inputs(args: Hyperparameters, rt: Runtime) -> list | None:
    """The tokenizer and HellaSwag file --sample_at_end and --hellaswag_every need, loaded before the run folder
    exists: a missing one refuses the launch and writes nothing. evaluation.py only for a run that asks for it."""
    if args.sample_at_end <= 0 and args.hellaswag_every <= 0:
        return None
    from evaluation import prepare_downstream
    return prepare_downstream(args.sample_at_end, args.hellaswag_every, args.hellaswag_data, rt,
                              ModelConfig.of(args).max_seq_len)


def set_up(args: Hyperparameters, rt: Runtime, folder: RunFolder, log: RunLog, started: float,
           batches: BatchSchedule, sources: dict[str, str], hellaswag: list | None) -> Run:
    """Data, model and optimizers: everything that can fail on bad input fails here, before step 0."""
    train_files = find_shards(args.train_files, "training")  # start() checked them (check_data)
    val_files = find_shards(args.val_files, "validation")
    val_seqs = validation_sequences(val_files, args, rt.rank, rt.world_size)
    torch.manual_seed(args.seed)
    model = build_model(args, rt)
    step_model = torch.compile(model, dynamic=False) if rt.compile == "model" else model
    opt = build_optimizers(model, args, rt.rank, rt.world_size, rt.grad_sync_from_hooks, rt.compile_newton_schulz)
    log.write(bucket_summary(opt.sync.buckets, rt.world_size), echo=False)  # the header's last line
    stream = TokenStream(train_files, args.vocab_size, cycle=args.train_cycle, read_ahead=True)
    loader = DistributedTokenLoader(stream, rt.rank, rt.world_size, args.bos_align, args.doc_len_cap, rt.device,
                                    step_in_one_shard=args.batch_sequences > 0)
    record = {"run_id": folder.run_id, "hyperparameters": dataclasses.asdict(args), "runtime": rt.resolved(),
              "source_sha256": sources_sha256(sources)}  # the sources the log embeds
    checkpoints = Checkpoints(folder, args.checkpoint_keep, rt, log, record)
    metrics = Metrics(folder.metrics if rt.is_master else None,
                      folder.tensorboard if args.tensorboard and rt.is_master else None, say=log.write)
    schedules = StepTensors(args, rt.device, batches)
    return Run(args, rt, log, batches, model, step_model, opt, stream, loader, schedules, val_seqs, hellaswag,
               checkpoints, EnergyMeter.open(rt), metrics, started, peak_tflops(device_name(rt)))


def warm_up(run: Run) -> None:
    """Compile and warm the kernels on real shapes (training and validation), then forget it happened; its
    energy is counted apart (warmup)."""
    if run.args.warmup_steps <= 0:
        return
    live = training_state(run.model, run.opt, run.stream, 0)
    saved = {name: local_part(x).clone() for name, x in live.tensors.items()}
    with run.energy.measuring("warmup"):
        for step in progress_bar(warm_up_steps(run.args.warmup_steps, run.batches), "compile and warm-up",
                                 run.rt.is_master):
            train_step(run, step)
        evaluate(run.step_model, run.val_seqs[:1], run.schedules.windows(0), run.rt)
        warm_up_graph_changes(run)
        run.rt.synchronize()
    with torch.no_grad():
        for name, x in live.tensors.items():
            local_part(x).copy_(saved[name])
    run.stream.load_state(live.loader)
    run.model.zero_grad(set_to_none=True)  # what Adam held between its steps (adam_every) goes with the rest
    run.opt.held_accum = None
    quantize_mlp_fp8(run.model, bootstrap=True)  # T:2300: the restored weights' scales (P's scale is back at 1)


def warm_up_steps(warmup_steps: int, batches: BatchSchedule) -> list[int]:
    """The first warmup_steps steps, then the first step of each stage whose sequence length none of them has
    (--batch_sequences: one compile per length, before the clock starts, as M warms up its transitions L1722)."""
    steps = list(range(warmup_steps))
    lengths = {batches.seq_len(step) for step in steps}
    for stage in range(len(batches.stage_tokens)):
        first = batches.first_step(stage)
        if batches.seq_len(first) not in lengths:
            steps.append(first)
            lengths.add(batches.seq_len(first))
    return steps


def graph_changes(args: Hyperparameters) -> list[int]:
    """The steps from which a compiled model takes a new graph with no new shape: each YaRN change (its attention
    scale is a Python float, as M's) and the first step after the tie's split (the lookup's switch)."""
    steps = {step for step, _, _ in yarn_changes(args.num_iterations, args)}
    if 0 < args.tied_embed_steps < args.num_iterations - 1:
        steps.add(args.tied_embed_steps + 1)
    return sorted(steps)


def warm_up_graph_changes(run: Run) -> None:
    """A compiled model's graphs at each of graph_changes' steps: one training step and one validation sequence
    there, as M warms up its transition steps, so the timed run does not recompile; then the model back at step 0's
    state."""
    if run.rt.compile != "model":
        return
    for step in graph_changes(run.args):
        follow_yarn(run.model, step, run.args)
        train_step(run, step)
        evaluate(run.step_model, run.val_seqs[:1], run.schedules.windows(step), run.rt)
    follow_yarn(run.model, 0, run.args)


def resume(run: Run, checkpoint: Path | None) -> int:
    """The step to start from: 0, or the checkpoint's step with its full training state restored."""
    if checkpoint is None:
        return 0
    state = run.checkpoints.load(checkpoint, training_state(run.model, run.opt, run.stream, 0))
    run.stream.load_state(state.loader)
    run.earlier_segments, run.earlier_target, target = state.segments, state.target, run.args.target_val_loss
    run.log.write(f"resumed from {checkpoint} at step {state.step} after {run.earlier_train_ms():.0f} ms of training")
    run.metrics.carry_over(checkpoint, state.step)
    if not state.target or state.target["val_loss"] != target:  # another target: the run's validations so far say
        found = target_among(recorded_validations(run.metrics.path, through=state.step), target)
        run.earlier_target = gather_objects(found, run.rt)[0]  # rank 0 has the metrics file
        if state.target:
            run.log.write(f"note: the checkpoint's target, val loss <= {state.target['val_loss']}, was reached at "
                          f"step {state.target['step']}; this launch's --target_val_loss={target} is " + (
                              "reached at an earlier validation" if found else "looked for from here"))
        if run.earlier_target:
            target_reached(run, run.earlier_target)
    return state.step


def lr_multiplier_at(run: Run, step: int) -> float:
    """The step's lr multiplier (step_lr_multiplier) in a run."""
    return step_lr_multiplier(step, run.args, run.batches)


def follow_yarn_logged(run: Run, step: int) -> None:
    """The step's YaRN state on the model (follow_yarn), and a log line where it changes."""
    changed = follow_yarn(run.model, step, run.args)
    if changed is not None:
        run.log.write(f"yarn: from step {step}, {changed[0]} long-window changes applied: rotary rescaled, attention "
                      f"scale {changed[1]:.7g}")


def tie_embedding(run: Run, step: int) -> None:
    """Track 2 (M L1148-1152, L1583-1585): through step tied_embed_steps the tokens are looked up in the head's
    weight, and Adam leaves the embedding alone (no gradient, step or decay) until the split hands it over."""
    tied = 0 < run.args.tied_embed_steps and step <= run.args.tied_embed_steps
    run.model.embed_from_head = tied
    run.opt.frozen = {run.model.embed.weight} if tied else set()


def train_step(run: Run, step: int) -> Tensor:
    """One optimizer step: forward and backward over the stage's micro-batches (the last one's backward launches
    the gradient reduce-scatters), the optimizers at the step's lr and momentum, then fresh gradients. Returns
    this rank's mean loss, on the device (--loss_sum: its summed loss per input token)."""
    args, windows, mtp = run.args, run.schedules.windows(step), run.schedules.mtp_weights(step)
    accum = run.batches.accum(step)
    run.opt.start_step(step, accum)
    tie_embedding(run, step)
    losses = []
    for i, (x, y) in enumerate(run.loader.next_batch(accum, run.batches.seq_len(step), run.batches.doc_cap(step))):
        run.opt.arm(i == accum - 1)
        loss = run.step_model(x, y, windows, *mtp)
        loss.backward()
        losses.append(loss.detach() / x.numel() if args.loss_sum else loss.detach())
    run.opt.step(lr_multiplier_at(run, step), muon_momentum_at(step, args), accum)
    quantize_mlp_fp8(run.model, bootstrap=step < FP8_MLP_BOOTSTRAP_STEPS)  # T:2365
    if args.tied_embed_steps and step == args.tied_embed_steps:
        run.opt.untie(run.model.lm_head.weight, run.model.embed.weight)
    run.opt.zero_grad(run.model)
    return torch.stack(losses).mean()


def train_loop(run: Run, start_step: int, stop: StopSignal, resumed_from: Path | None) -> int:
    """The record's loop: validate (and score HellaSwag) when due and at the end, checkpoint or stop when due,
    one training step and its log line; then the finish. Returns the exit status."""
    args, rt, N = run.args, run.rt, run.args.num_iterations
    clock, recompiles, stop = Clock(rt, run.energy), RecompileWatch().start(), stop.defer()
    results, watch = Results(target=run.earlier_target), FiniteWatch(rt.device, start_step, resumed_from)
    clock.start()
    status, end_step = None, N
    with profiling(run) as profiler, progress_bar(range(start_step, N), "training", rt.is_master) as bar:
        for step in range(start_step, N + 1):
            follow_yarn_logged(run, step)
            tie_embedding(run, step)
            # ---------------- VALIDATION ----------------
            validate_now = step == N or due(step, args.val_every)
            hellaswag_now = run.hellaswag_items is not None and (step == N or due(step, args.hellaswag_every))
            if validate_now or hellaswag_now:
                clock.pause()
                with run.energy.measuring("validation"):
                    if validate_now:
                        validate(run, step, start_step, clock, results, watch)
                    if hellaswag_now:
                        from evaluation import score_during_training
                        point, line = score_during_training(run.model, run.hellaswag_items,
                                                            attention_windows(step, args), rt, step, N)
                        results.hellaswag_curve.append(point)
                        run.log.write(line)
                if step == N or args.stop_at_target and results.target and results.target["step"] <= step:
                    end_step = step
                    break
                clock.start()
            # ---------------- CHECKPOINT OR STOP ----------------
            status = checkpoint_or_stop(run, step, start_step, stop.agreed(rt), clock, watch, results)
            if status is not None:
                break
            # ---------------- TRAINING ----------------
            loss = train_step(run, step)
            watch.observe(loss)
            for reason in recompiles.drain():
                run.log.write(f"warning: torch.compile recompiled after warm-up at step {step + 1}: {reason}")
            if profiler is not None:
                profiler.step()
            log_train_step(run, step + 1, start_step, loss, clock, watch, results)
            bar.update()
    stop.settle()  # every rank started the same agreements, so the last one completes
    run.metrics.close()
    return status if status is not None else finish(run, start_step, end_step, clock, results, watch, recompiles)


def due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def profiling(run: Run):
    """The profiler as a context (started on entry, stopped on every way out), or a stand-in that does nothing."""
    if run.args.profile_steps <= 0:
        return contextlib.nullcontext()
    trace = run.checkpoints.folder.log_dir / f"{run.checkpoints.folder.run_id}_rank{run.rt.rank}.trace.json"
    return make_profiler(run.args.profile_steps, run.rt.is_cuda, trace)


def validate(run: Run, step: int, start_step: int, clock: Clock, results: Results, watch: FiniteWatch) -> None:
    """Validation loss on the whole held-out budget, logged with the training time and energy so far; the first
    one at or below --target_val_loss marks the run (target_reached)."""
    results.val_loss = evaluate(run.step_model, run.val_seqs, run.schedules.windows(step), run.rt)
    energy, earlier = run.energy.totals(run.rt), run.earlier_train_joules()
    joules = energy["train"] if energy else None
    run.log.write(progress_line(step, run.args.num_iterations, val_loss=results.val_loss, train_time=clock.ms,
                                step_avg=clock.ms / max(step - start_step, 1),
                                **({"energy": joules} if joules is not None else {})))
    run_joules = joules + earlier if joules is not None and earlier is not None else None
    val = {"step": step, "tokens": run.tokens_through(start_step, step), "val_loss": results.val_loss,
           "train_time_ms": run.earlier_train_ms() + clock.ms, "energy_j": run_joules}  # the run's, every launch's
    run.metrics.write("val", **val)
    if not math.isfinite(results.val_loss):
        raise RunFailed(f"validation loss is {results.val_loss} at step {step}; the run diverged "
                        f"(lower the learning rates and resume: {watch.hint()})")
    if results.target is None and (reached := target_among({step: val}, run.args.target_val_loss)):
        target_reached(run, reached)
        results.target = reached


def target_reached(run: Run, reached: dict) -> None:
    """Where the run first reached its target loss (runlog.target_among), into the log's target line and the
    metrics: the step, the run's training time, tokens and training energy (ranks and launches summed)."""
    joules = {"energy": reached["energy_j"]} if reached["energy_j"] is not None else {}
    run.log.write(progress_line(None, run.args.num_iterations, head="target:", val_loss=reached["reached_val_loss"],
                                target_val_loss=reached["val_loss"], steps=reached["step"], tokens=reached["tokens"],
                                train_time=reached["train_time_ms"], **joules))
    run.metrics.write("target", **{**reached, "val_loss": reached["reached_val_loss"],
                                   "target_val_loss": reached["val_loss"]})


def checkpoint_or_stop(run: Run, step: int, start_step: int, signum: int | None, clock: Clock,
                       watch: FiniteWatch, results: Results) -> int | None:
    """Before training step+1: write a checkpoint when one is due, a signal came or --stop_after is
    reached; returns the exit status when the run stops here, None to go on."""
    args, log = run.args, run.log
    stop_after = args.stop_after > 0 and step == args.stop_after
    if signum and step % args.adam_every:
        signum = None  # Adam holds gradients between its steps (adam_every): stop at its next step
    if not (due(step, args.checkpoint_every) and step > start_step or signum or stop_after):
        return None
    checkpointing = args.checkpoint_every > 0 or args.checkpoint_final or args.stop_after > 0
    with clock.paused():
        if checkpointing:
            run.save_checkpoint(step, run.segments(start_step, step, clock), watch, results.target)
    if signum:
        log.write(f"stopped by signal {signal.Signals(signum).name} before step {step + 1}"
                  + ("; resume with --resume=latest" if checkpointing else " (no checkpoints enabled)"))
        return 128 + signum
    if stop_after:
        log.write(f"stopped after step {step} as asked (--stop_after); resume with --resume=latest")
        return 0
    return None


def log_train_step(run: Run, step: int, start_step: int, loss: Tensor, clock: Clock, watch: FiniteWatch,
                   results: Results) -> None:
    """The step line and the step's metrics; with --log_train_loss also the loss averaged over ranks (one device
    sync). The times are the host's (no device sync): on a GPU a step's time lands on the step after it."""
    args, rt = run.args, run.rt
    ms = clock.elapsed_ms()
    train_loss = mean_over_ranks(loss, rt) if args.log_train_loss else None
    if train_loss is not None and not math.isfinite(train_loss):
        raise RunFailed(f"training loss is {train_loss} at step {step}; stopping (lower the learning rates and "
                        f"resume: {watch.hint()})")
    loss_field = {"train_loss": train_loss} if train_loss is not None else {}
    run.log.write(progress_line(step, args.num_iterations, **loss_field, train_time=ms,
                                step_avg=ms / (step - start_step)))
    if run.metrics.file is None:  # a rank that writes no metrics (not rank 0) has nothing more to count
        return
    step_ms, tokens = ms - results.last_ms, run.batches.tokens(step - 1)
    flops = run.model.flops_per_token(attention_windows(step - 1, args), run.batches.seq_len(step - 1)) * tokens
    results.flops, results.last_ms = results.flops + flops, ms
    seconds = max(step_ms, 1e-6) / 1000
    tflops, peak = flops / seconds / 1e12, run.peak_tflops
    earlier = run.earlier_train_joules()
    own = run.energy.local_joules() if rt.world_size == 1 else None  # one rank: its counter is the whole run's
    run.metrics.write("train", step=step, tokens=run.tokens_through(start_step, step), train_loss=train_loss,
                      lr_mult=lr_multiplier_at(run, step - 1), step_ms=step_ms,
                      train_time_ms=run.earlier_train_ms() + ms, tokens_per_s=tokens / seconds, tflops=tflops,
                      mfu=tflops / (peak * rt.world_size) if peak else None, peak_memory_mib=peak_memory_mib(rt)[0],
                      energy_j=own + earlier if own is not None and earlier is not None else None)


def run_totals(segments: list[dict], batches: BatchSchedule) -> tuple[int, float | None]:
    """Tokens of all segments (those an old checkpoint did not record, at this run's schedule) and their total
    training time (None when an old checkpoint did not record its part)."""
    tokens = sum(s["tokens"] if s["tokens"] is not None else
                 batches.tokens_before(s["end_step"]) - batches.tokens_before(s["start_step"]) for s in segments)
    times = [s["train_time_ms"] for s in segments]
    return tokens, None if None in times else sum(times)


def run_energy(segments: list[dict]) -> dict | None:
    """Each energy phase's joules over all the run's launches, ranks summed (and the ranks that measured); None
    when a launch could not measure (or an old checkpoint did not record it)."""
    known = [s["energy_j"] for s in segments]
    if None in known:
        return None
    return {**{phase: sum(e[phase] for e in known) for phase in ENERGY_PHASES}, "ranks": known[-1]["ranks"]}


def finish(run: Run, start_step: int, end_step: int, clock: Clock, results: Results, watch: FiniteWatch,
           recompiles: RecompileWatch) -> int:
    """Memory, energy and final lines, end-of-run samples and checkpoint, then the JSON summary and report card."""
    args, rt, log = run.args, run.rt, run.log
    segments = run.segments(start_step, end_step, clock)
    tokens, total_ms = run_totals(segments, run.batches)
    peak_mib, memory_line = peak_memory_mib(rt)
    energy = run_energy(segments)
    log.write(memory_line)
    log.write(energy_line(energy, run.energy.reason, (total_ms or clock.ms) / 1000, tokens))
    resumed = {"total_train_time": total_ms, "resumes": len(segments) - 1} if len(segments) > 1 else {}
    log.write(progress_line(None, args.num_iterations, val_loss=results.val_loss, steps=end_step, tokens=tokens,
                            train_time=clock.ms, **({k: v for k, v in resumed.items() if v is not None})))
    samples = []
    if args.sample_at_end > 0 and rt.is_master:
        from evaluation import log_samples
        samples = log_samples(run.model, args.sample_at_end, attention_windows(end_step, args), args.seed, log)
    if args.checkpoint_final:
        run.save_checkpoint(end_step, segments, watch, results.target)
    if rt.is_master:
        summary = run_summary(run, start_step, end_step, clock, results, recompiles, segments, energy, peak_mib,
                              tokens, total_ms)
        if args.hellaswag_every > 0:
            summary["hellaswag_curve"] = results.hellaswag_curve
        if args.sample_at_end > 0:
            summary["samples"] = samples
        write_summary(run.checkpoints.folder.summary, summary, log)
        write_report(run.checkpoints.folder.report, report_card(summary, args.usd_per_gpu_hour), log)
    return 0


def run_summary(run: Run, start_step: int, end_step: int, clock: Clock, results: Results,
                recompiles: RecompileWatch, segments: list[dict], energy: dict | None, peak_mib: float, tokens: int,
                total_ms: float | None) -> dict:
    """The run's JSON summary (tokens and total_ms: run_totals of its segments): what records/read_records.py and
    the report card read."""
    args, rt = run.args, run.rt
    train_s = (total_ms or clock.ms) / 1000
    kwh = energy["train"] / 3.6e6 if energy else None
    tflops = results.flops / max(clock.ms / 1000, 1e-9) / 1e12
    walls = [s["wall_time_s"] for s in segments]
    stages = [[run.batches.first_step(i), n, a]
              for i, (n, a) in enumerate(zip(run.batches.stage_tokens, run.batches.stage_accum))]
    return {"run_id": run.checkpoints.folder.run_id, "git_commit": git_commit(), "git_dirty": git_dirty(),
            "preset": args.preset, "world_size": rt.world_size, "devices": [device_name(rt)] * rt.world_size,
            "torch": torch.__version__, "python": platform.python_version(), "steps": end_step, "tokens": tokens,
            "final_val_loss": results.val_loss, "train_time_ms": clock.ms, "peak_memory_mib": peak_mib,
            "energy_j": energy["train"] if energy else None, "energy_kwh": kwh,
            "tokens_per_kwh": tokens / kwh if kwh else None, "energy": energy,
            **({} if energy else {"energy_reason": run.energy.reason or "no rank could read an energy counter"}),
            "target": results.target or {"val_loss": args.target_val_loss, "step": None},
            "stopped_at_target": end_step < args.num_iterations, "val_curve": run_curve(run.metrics.path, end_step),
            "segments": segments, "total_train_time_ms": total_ms, "resumes": len(segments) - 1,
            "wall_time_s": None if None in walls else sum(walls), "tokens_per_s": tokens / train_s,
            "tflops": tflops, "mfu": tflops / (run.peak_tflops * rt.world_size) if run.peak_tflops else None,
            "recompiles_after_warmup": recompiles.count, "step_avg_ms": clock.ms / max(end_step - start_step, 1),
            "runtime": {**rt.resolved(), "grad_accum_steps": run.batches.stage_accum[-1], "batch_stages": stages},
            "hyperparameters": dataclasses.asdict(args), "status": "finished"}


def write_log_header(log: RunLog, args: Hyperparameters, rt: Runtime, run_id: str,
                     batches: BatchSchedule) -> dict[str, str]:
    """The sources (this file and the siblings it uses), every resolved hyperparameter and the environment, before
    the first step line. Returns the sources, read once: the checkpoints' source hash is of what the log holds."""
    sources = trainer_sources(Path(__file__))
    accum = "/".join(map(str, batches.stage_accum))  # one number per batch stage
    lengths = {"batch_stage_seq_len": "/".join(map(str, batches.stage_seq_len))} if args.batch_sequences else {}
    write_header(log, sources, dataclasses.asdict(args),
                 {"grad_accum_steps": accum, "batch_stage_tokens": "/".join(map(str, batches.stage_tokens)), **lengths},
                 environment_lines(rt) if rt.is_master else [])
    for line in [f"run {run_id}: preset {args.preset}, {rt.world_size} rank(s) x {accum} micro-step(s), "
                 f"{device_name(rt)}, attention {rt.attention}, fp8 head {rt.fp8_head}, compile {rt.compile}",
                 left_out_line(args), *device_notes(args.fp8_head, rt, args.fp8_mlp)]:
        if line:
            log.write(line)
    return sources


def out_of_memory(e: BaseException, args: Hyperparameters, rt: Runtime) -> UsageError:
    """The one line for a device that cannot hold the run: how much it has, and the micro-batch that halves what a
    micro-step holds while the batch keeps its size (more micro-steps), or what else to try."""
    total = f"{torch.cuda.get_device_properties(rt.device).total_memory / 2**30:.1f} GiB" if rt.is_cuda else "memory"
    fits, times = smaller_micro_batch(args, rt.world_size)
    advice = (f"pass {fits} (the same batch in {times} the micro-steps)" if fits else
              "pass a smaller --seq_len that splits every batch stage, or run on more GPUs")
    reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    return UsageError(f"the {args.preset} preset's {args.n_layer}-layer model does not fit this device's {total} at "
                      f"--seq_len={args.seq_len} ({reason}); {advice}; validation holds --val_seq_len="
                      f"{args.val_seq_len} tokens at once, lower it too if it runs out there")


def smaller_micro_batch(args: Hyperparameters, world_size: int) -> tuple[str, str]:
    """The flags that halve (else quarter) a micro-step's sequence while the batch keeps its size, and how many
    times the micro-steps that is (('', '') if none splits every stage): a shorter --seq_len, with
    --batch_sequences as many times the packed sequences."""
    for k, times in ((2, "twice"), (4, "four times")):
        smaller = dataclasses.replace(args, seq_len=args.seq_len // k, batch_sequences=args.batch_sequences * k)
        try:
            validate_args(smaller)
            batch_schedule(smaller, world_size)
        except UsageError:
            continue
        sequences = f"--batch_sequences={smaller.batch_sequences} " if args.batch_sequences else ""
        return f"{sequences}--seq_len={smaller.seq_len}", times
    return "", ""


def train(argv: list[str], stop: StopSignal) -> int:
    """Start-up, then the run's phases: set-up, warm-up, resume, the loop (which finishes the run)."""
    if "--help" in argv or "-h" in argv:
        print(help_text(parse_overrides(Hyperparameters, [a for a in argv if a not in ("--help", "-h")])))
        return EXIT_OK
    started = time.perf_counter()
    args, rt, folder, checkpoint, notes, hellaswag = start(argv)
    log = RunLog(folder.log if rt.is_master else None)
    lock_run_log(log, folder.run_id)
    try:
        batches = batch_schedule(args, rt.world_size)
        sources = write_log_header(log, args, rt, folder.run_id, batches)
        clean_stale_staging(folder, log)
        for note in notes:
            log.write(note)
        run = set_up(args, rt, folder, log, started, batches, sources, hellaswag)
        try:
            if checkpoint is not None:  # before the warm-up's compiles
                check_same_tensors(checkpoint, training_state(run.model, run.opt, run.stream, 0), rt,
                                   structure_flags(args))
            warm_up(run)
            return train_loop(run, resume(run, checkpoint), stop, checkpoint)
        except torch.OutOfMemoryError as e:  # the warm-up is the first step: this is still start-up
            raise out_of_memory(e, args, rt) from None
        finally:
            run.stream.close()  # no shard reader outlives the run
    except Interrupted as e:
        log.write(stopped_before_training(e.signum).removeprefix("error: "), echo=False)  # main() says it once
        raise
    except Exception as e:  # the log of a failed run says why it ended, then the error propagates
        log.write(f"error: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}",
                  echo=False)
        raise


# -----------------------------------------------------------------------------
# The way out: every ending of a run is one line and a clean end of its process group (lifecycle.py)

def main(argv: list[str] | None = None, stop: StopSignal | None = None) -> int:
    """The run's exit status; every way out is one line (a usage error, a failed run, a signal before training,
    a lost peer) and ends the distributed run cleanly. stop: the stop-signal handler (a test's own, to inspect)."""
    stop = (stop or StopSignal()).install()  # from here on a signal during start-up is one line, not a traceback
    try:
        return train(sys.argv[1:] if argv is None else argv, stop)
    except UsageError as e:  # RunFailed too, with its own status
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    except Interrupted as e:
        print(stopped_before_training(e.signum), file=sys.stderr, flush=True)
        return 128 + e.signum
    except (RuntimeError, dist.DistError) as e:
        if not is_collective_failure(e):
            raise
        reason = str(e).strip().splitlines()[-1][:300]
        print(f"error: a collective failed on rank {os.environ.get('RANK', '0')} ({reason}); another rank died or "
              "stopped answering: see its output, then resume from the last checkpoint", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    finally:
        end_distributed(stop)


if __name__ == "__main__":
    sys.exit(main())
