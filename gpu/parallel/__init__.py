"""Tensor and pipeline parallelism: who holds which heads, layers and vocabulary rows
(``layout``), the collectives between ranks (``comm``), the vocab-parallel embedding
(``layers``) and the per-rank weight slices (``weights``)."""
