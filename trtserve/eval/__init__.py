"""Evaluation: real-text data, configuration grids, reports."""
