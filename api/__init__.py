"""The user-facing surface: OpenAI-compatible gateway, notebook client, CLI helpers."""
