"""Speculative decoding on the device side: the draft model and the rejection sampler."""
