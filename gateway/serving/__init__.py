"""Serving logic per endpoint: validate -> convert -> stream / complete."""
