"""Token shards: their format (shardio), the downloaders and the tokenizer, each program run from the project root:
python -m data.cached_fineweb10B 9, python -m data.fineweb ... (data/README.md). No torch."""
