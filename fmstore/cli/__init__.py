"""The ``fmstore`` command line (typer): thin commands that parse, call the library, print."""
