"""The application: the `specmesh` command and what it drives (launcher, benchmark, embedded Redis).

The core (`specmesh/`) and the services import nothing from here; this package
imports them all.
"""
