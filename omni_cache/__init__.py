"""omni_cache: multi-stage omni serving on vLLM with a hidden-state prefix cache."""
