"""clients package (filled in by later issues)."""
