"""The running pipeline: the orchestrator, its stage supervision, request results."""
