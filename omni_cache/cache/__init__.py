"""The hidden-state prefix cache: the KV-slot mirror (its row kernels, its host copy pipeline, its
CUDA driver calls) and per-request rows."""
