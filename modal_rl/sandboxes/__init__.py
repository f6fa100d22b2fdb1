"""Sandboxes: an async SandboxPool over modal / local (bubblewrap) providers."""
