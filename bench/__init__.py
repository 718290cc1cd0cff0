"""Measurements of the trainer, each a program run from the project root: python -m bench.<name> (bench/README.md)."""
