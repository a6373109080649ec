"""Temper Python SDK and the `temper` CLI."""
