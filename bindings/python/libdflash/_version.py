"""The package version; it equals the C library's (meson.build `version`), and
the package loads only a library of the same MAJOR.MINOR through SOVERSION."""
__version__ = "0.1.0"
SOVERSION = 1
