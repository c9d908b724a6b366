"""The stateful OpenAI-compatible HTTP server."""
