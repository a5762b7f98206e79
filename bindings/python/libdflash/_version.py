"""The package version; it equals the C library's (meson.build `version`, which is also the
wheel's), and the package loads only a library of this very version (_lib._load); SOVERSION
names the library file (libdflash.so.1)."""
__version__ = "0.1.0"
SOVERSION = 1
