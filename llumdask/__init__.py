"""llumdask: Llumnix-style LLM serving on Dask. This package is the engine-agnostic core."""

__version__ = "0.1.0"
