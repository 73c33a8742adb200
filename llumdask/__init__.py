"""llumdask: Llumnix-style LLM serving on Dask. This package is the engine-agnostic core."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`llumdask.connect(...)` for notebooks, without importing Dask when the core is imported."""
    if name == "connect":
        from llumdask.api.client import connect

        return connect
    raise AttributeError(f"module 'llumdask' has no attribute {name!r}")
