"""When and where copies go: the copy engine, dataset staging and lazy staging; the catalog,
policies, the checkpoint mover and the daemon."""
