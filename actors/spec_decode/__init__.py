"""Speculative decoding on the scheduler's side: its settings and the proposers."""
