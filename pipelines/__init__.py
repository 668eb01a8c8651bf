"""conveyor's shared vocabulary: wire envelope, key names, stages and settings.

The gateway and the workers both import this package and never each other.
"""
