"""Stand-in for torchdata."""
