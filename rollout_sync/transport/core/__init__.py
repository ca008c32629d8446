"""The group path's parts, which every transfer uses: a pair stream cut into messages (``pair_messages``),
rounds and staging slots (``schedule``), parts addressed in storage (``copies``), compiled into a
``program``; the checks before the agreement (``half_check``, ``local_check``) and the ``agreement``
itself (with ``fingerprint``, over ``collectives``); the process group (``groups``, ``network``); the
point-to-point ``Transport`` (``p2p``), which also hands segments over within a process (``in_process``)
and between processes that map each other's storages (``mapped``, ``cuda_ipc``); the staging arena
(``staging``), the target storages of a transfer (``target_streams``) and its options and stats (``stats``)."""
