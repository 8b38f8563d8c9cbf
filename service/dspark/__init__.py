"""DSpark Serve: confidence-scheduled speculative decoding engine and server."""

__version__ = "0.1.0"
