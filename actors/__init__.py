"""Monarch actors, each a thin shell over a pluggable backend (see actors/registry.py)."""
