"""After the run: command-line programs that import the model from train_gpt.py (never a copy of it).

    python -m tools.sample <checkpoint> --prompt "The President"   # text from the model (KV cache)
    python -m tools.hellaswag <checkpoint> [--data FILE.jsonl]      # HellaSwag acc / acc_norm
    python -m tools.export <checkpoint> <out_dir>                   # safetensors + JSON config

<checkpoint> is a step_N/ folder that train_gpt.py wrote (final or mid-run) or a folder export.py wrote.
"""
