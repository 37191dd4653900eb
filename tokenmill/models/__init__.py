"""Model files: only the math of each architecture, built from `tokenmill.layers`. Which file serves
which architecture is `tokenmill.models.registry`."""
