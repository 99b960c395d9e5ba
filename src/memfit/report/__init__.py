"""Rendering results: rich tables for people, JSON for tools, plots where a picture says more."""
