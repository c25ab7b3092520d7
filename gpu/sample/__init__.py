"""Sampling: the parameters, the sampler, prompt logprobs, grammar masks."""
