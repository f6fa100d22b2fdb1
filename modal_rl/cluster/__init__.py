"""Clusters: ClusterSpec, the Ray bootstrap, and the modal / local backends."""
