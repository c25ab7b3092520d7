"""The CPU path: oneDNN linears, thread counts, memory, linear bands."""
