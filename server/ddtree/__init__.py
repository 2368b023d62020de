"""DDTree speculative decoding: engine, OpenAI-compatible server and CLI."""

__version__ = "0.1.0"
