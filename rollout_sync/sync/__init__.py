"""What both sides run at each sync: one rank's membership of the sync group (``endpoint``), the
coordinator's work on trainer rank 0 (``coordination``), the commit after the transfer (``commit``) and who
is who (``roster``). Each side's own part lives with that side: the trainer hook in ``trainer.hook``, a
rollout worker's link in ``rollout.group_link``."""
