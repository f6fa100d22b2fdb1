"""verl 0.9.1 on CPU: the ``cpu`` platform, its two run-time fixes, env and overrides, and
tiny local assets. Importing this package imports nothing heavy; see the submodules."""
