"""The management commands of the iofence app."""
