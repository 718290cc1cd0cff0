"""Download the fineweb10B GPT-2 shards from the Hugging Face Hub into data/fineweb10B/.

    python -m data.cached_fineweb10B [N] [--local_dir DIR] [--workers W] [--revision REV] [--verify]

N is the number of train shards (100M tokens each) after the val shard; see
data/hub_shards.py for what is checked and data/README.md for the options.
"""

import sys

from data.hub_shards import main

if __name__ == "__main__":
    sys.exit(main("fineweb10B"))
