"""The HTTP face: the OpenAI-compatible app, chat streaming, audio formats, /metrics."""
