"""The OpenAI-compatible HTTP gateway: `create_app` over a `Backend` (`DaskBackend` for a cluster)."""

from llumdask.api.gateway.app import create_app
from llumdask.api.gateway.backend import Backend, BackendRejected, BackendUnavailable, ModelInfo

__all__ = ["Backend", "BackendRejected", "BackendUnavailable", "ModelInfo", "create_app"]
