"""Core types and pure functions every layer shares: draft trees, sampling, grammars, round records.

Imports nothing else of ddtree but its errors.
"""
