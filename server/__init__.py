"""HTTP layer: OpenAI protocol, validation, SSE, admin, CLI. Knows actors, never tensors."""
