"""opencoti: a serving engine for multi-agent LLM workloads."""

__version__ = "0.1.0"
