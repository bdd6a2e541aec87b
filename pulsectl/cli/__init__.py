"""The pulsectl command line: a thin layer over the library."""
