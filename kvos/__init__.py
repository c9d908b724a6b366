"""kvos: an operating system for the LLM KV cache."""

__version__ = "0.1.0"
