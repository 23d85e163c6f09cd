"""server package (filled in by later issues)."""
