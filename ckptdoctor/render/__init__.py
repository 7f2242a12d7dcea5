"""Renderers: report dataclasses in, text or JSON out. No file reading, no exit decisions."""
