"""The `composer` command line (`python -m composer`)."""
