"""Delta syncs: only the elements that changed since the base version move. ``packed_program`` (what is
compared), ``compare`` and ``change_codec`` (finding and coding changes), ``shadow`` (what a sender keeps),
``run`` (a sync's messages, round by round), ``landing`` (where changes land on the receiver), ``state``
(what an executor keeps between syncs, and when it names a base), ``nixl_export`` (the same without a
group, over NIXL)."""
