"""The running pipeline: the orchestrator, the supervisor of its stage processes, the in-flight
requests, what a client gets back."""
