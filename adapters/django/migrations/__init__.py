"""The migrations of the iofence app: its fence register and the register's judge."""
