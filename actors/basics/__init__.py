"""Torch-free basics that actors and mesh share: files on disk, URLs, shares, compute, processes."""
