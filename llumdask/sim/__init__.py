"""Discrete-event cluster simulator running the same core code on a virtual clock."""
