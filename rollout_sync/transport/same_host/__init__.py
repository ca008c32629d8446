"""Ranks on one host in other processes (CPU): the probe and the pairs that map or pull each other's memory
(``pairs``, ``pulls`` over ``cross_memory``), shared-memory staging slots (``shared_memory``), and the
copies straight from a sender's storages (``handoff``)."""
