"""Reading a live DeepSpeed engine: everything that looks inside one, in one place.

``read`` (``read_engine``: the facts and buffers of this rank's engine) is the entry point. It is built on
``refusals`` (what the sync refuses, decided from plain traits: pure), ``checks`` (those traits and the
per-parameter checks, read from the engine), ``placements`` (AutoTP/AutoEP placements from DeepSpeed's own
descriptions), ``zero_positions`` (this rank's buffers and their ZeRO-1/2/3 flat positions) and ``parts``
(groups, AutoEP layers, ZeRO-3 parameters). DeepSpeed itself is imported only when an engine is read.
"""
