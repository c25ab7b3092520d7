"""The pooling runner: poolers and their parameters."""
