"""The runs' records and their one reader, run from the project root: python -m records.read_records logs/,
python -m records.rebuild_run LOG OUT_DIR (records/README.md). No torch."""
