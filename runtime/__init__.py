"""whet.runtime."""
