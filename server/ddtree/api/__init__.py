"""The OpenAI-compatible server: protocol, request preparation, serving, scheduler, metrics, `ddtree serve`.
"""
