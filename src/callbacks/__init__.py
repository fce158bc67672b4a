"""Callbacks Lightning lacks: the one-line run summary, and the batch-size hook for its ThroughputMonitor."""
