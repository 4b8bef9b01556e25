"""Plugins loaded by the runtime tests through config strings (as a user's own package would be)."""
