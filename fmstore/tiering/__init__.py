"""When and where copies go: the catalog, policies, the checkpoint mover and the daemon."""
