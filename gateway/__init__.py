"""The capture gateway: an OpenAI-compatible proxy that records every completion in Redis.

`Gateway` is the ASGI app, `GatewaySettings` its settings, `serve` runs it under uvicorn.
"""

from gateway.app import Gateway
from gateway.server import serve
from gateway.settings import GatewaySettings

__all__ = ["Gateway", "GatewaySettings", "serve"]
