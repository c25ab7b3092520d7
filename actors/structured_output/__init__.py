"""Guided decoding: grammar compiles, per-request matchers, the step's bitmask."""
