"""Metrics of a run: the logger (console, JSONL, TensorBoard) with its summaries, and the PNG curves."""
