"""When and where copies go: the copy engine, dataset staging and lazy staging."""
