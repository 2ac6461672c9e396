"""Reference models the tests hold the compiled code to (not part of the package)."""
