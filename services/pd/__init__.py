"""The pd service."""
