"""The seed write-up's phase 7 figures (A100 SXM4 80GB, PyTorch 2.4), quoted for comparison.

They are the specification of what phase 7 measures, never results of this lab: every table
that shows them labels them with CITATION.
"""
CITATION = "seed write-up (shared/seeds/000_d50e6b73398ffa0d.txt), Phase 7, on an A100 SXM4 80GB"

DATA = {"chars": 1_115_394, "tokens": 338_025, "vocab": 50_257, "chars_per_token": 3.30,
        "train_tokens": 304_222, "val_tokens": 33_803}
MODEL_30M = {"wte": "19.3M (64%)", "wpe": "98K", "blocks": "10.6M", "total": "30.02M",
             "initial_loss": 10.926, "ln_vocab": 10.825, "logits_shape": [4, 64, 50257]}
OVERFIT_30M = [[0, 10.91, 10.91], [500, 2.49, 5.19], [1000, 0.46, 6.94], [2000, 0.14, 8.70], [5000, 0.07, 9.58]]
OVERFIT_7M_VAL_FLOOR = 5.70
TOKENS_PER_S = {"30M": 203e3, "7.25M": 389e3}
SCALING = {  # name: (non-embedding params, best val loss, best at iter, "x underfed" vs Chinchilla)
    "nano": (98_944, 5.3410, 500, 6.5), "micro": (333_120, 4.9774, 750, 21.9),
    "mini": (788_736, 4.7920, 750, 51.8), "small": (2_659_200, 4.8181, 500, 174.8)}
SCALING_FIT = {"a": 7.5929, "alpha": 0.0321, "points": "nano, micro, mini", "error_pct": "1-2.4%"}
FAILURES = {"no_residual_no_layernorm": "loss frozen at 10.81, grad norm 0.0",
            "no_layernorm": "learns, noisy; grad norm spikes to 8.0",
            "no_residual": "learns smoothly, floors at 6.3",
            "control": "lowest loss, 5.50",
            "warmup_none": "final loss 4.2703 (+20% vs full warmup)",
            "warmup_short": "final loss 3.5801 (+4.5%)",
            "warmup_full": "final loss 3.4243",
            "lr_x100": "no NaN; damage in the first 50 iterations persisted"}
