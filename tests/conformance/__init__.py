"""Kernel conformance: every registered backend against the numpy oracle, for every profile."""
