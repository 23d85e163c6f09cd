"""simulations package (filled in by later issues)."""
