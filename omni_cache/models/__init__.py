"""Models that are not vLLM engines, and the tiny checkpoints the project writes."""
