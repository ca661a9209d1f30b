"""A Django app for the Django integration's tests: a fenced model with a tombstone, a
fenced model without one, and a plain model."""
