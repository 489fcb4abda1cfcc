"""The runtime's streams and events ([Note: streams and events] in streams.py)."""

from veragged.runtime.streams import (
    Handle,
    Streams,
    current_stream_runtime,
    for_device,
    use_runtime,
)

__all__ = ["Handle", "Streams", "current_stream_runtime", "for_device", "use_runtime"]
