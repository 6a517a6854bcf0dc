"""Stand-in for pylatexenc (OpenRLHF math grading only)."""
