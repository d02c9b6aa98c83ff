"""The proxy service."""
