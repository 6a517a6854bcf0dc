"""Benchmark harnesses (`composer bench`): imported only by that command, never on the core path."""
