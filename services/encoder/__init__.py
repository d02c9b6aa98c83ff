"""The encoder service."""
