"""The pooling endpoints: embeddings, pooling, score and rerank."""
