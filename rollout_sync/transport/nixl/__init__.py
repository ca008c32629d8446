"""Group-free transfers over NIXL: ``agent`` (the one module that imports NIXL) and ``reads`` (a worker's
read list, pure)."""
