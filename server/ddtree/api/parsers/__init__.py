"""Output parsers for chat replies: Hermes tool calls and Qwen3 think blocks.
"""
