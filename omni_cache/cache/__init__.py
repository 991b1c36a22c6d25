"""The hidden-state prefix cache: the KV-slot mirror, its CUDA driver calls, per-request rows."""
