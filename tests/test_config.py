"""The speedrun preset is the 2025-01-26 record: every value the record sets, pinned to the record's value
(records/012625_BatchSize of modded-nanogpt and its train_gpt.py; ../shared/SPEEDRUN_RECIPE.md)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as T  # noqa: E402

RECORD_2025_01_26 = dict(
    val_tokens=10485760, batch_tokens=8 * 48 * 1024, seq_len=48 * 1024, val_seq_len=4 * 64 * 1024,
    num_iterations=1770, cooldown_frac=0.4, lr_final_frac=0.1, val_every=125, window_final_tokens=1728,
    sliding_window=True, vocab_size=50257, n_layer=12, model_dim=768, n_head=6, head_dim=128, attn_scale=0.12,
    logit_softcap=30.0, value_embeds=True, unet_skips=True, zero_init=True, qk_norm=True, mlp_act="relu2",
    muon=True, muon_lr=0.05, muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup_steps=300,
    ns_steps=5, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-10, head_lr=0.008, embed_lr=0.6, scalar_lr=0.04,
    weight_decay=0.0, dtype="bf16", fp8_head=True, coordinate_descent_tuning=True)


def test_speedrun_preset_is_the_record():
    args = T.parse_args([], cuda_available=True)
    assert args.preset == "speedrun"
    assert {k: getattr(args, k) for k in RECORD_2025_01_26} == RECORD_2025_01_26
    assert T.FP8_SCALES == dict(x_scale=2.0, w_scale=2.0 ** 9, grad_scale=2.0 ** 19)
    assert args.val_tokens // args.val_seq_len == 40  # 5 val sequences per rank on 8 GPUs
