"""messenger package."""
