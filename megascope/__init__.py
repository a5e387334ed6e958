"""megascope: observability and straggler diagnosis for 3D-parallel LLM training."""

__version__ = "0.1.0"
