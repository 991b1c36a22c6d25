"""What ``GET /metrics`` exposes: per-stage Prometheus families, pacing figures, event-loop lag."""
