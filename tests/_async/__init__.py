"""Conformance and backend tests; _sync is generated from _async."""
