"""Seeing what fusednorm did: the explain report, numbered dumps, MLIR."""
