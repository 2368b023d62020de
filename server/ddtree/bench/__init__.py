"""`ddtree bench` and the timing helpers the scripts in benchmarks/ share.
"""
