"""Device side: model code, weight loading, KV cache tensors, attention backends, sampling."""
