"""conductor package."""
