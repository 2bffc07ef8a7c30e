"""``broadcast_state_dict``: full tensors from one source member to every other member.

The call (:mod:`._call`), its handshake (:mod:`._handshake`: every member ends with the same plan or raises the same
error), what one rank can tell of its own arguments (:mod:`._inputs`), the plan built from the source's manifest
(:mod:`._plan`), one member's part once the plan is agreed (:mod:`._assemble`: star or chain route, data phase, what
settles it), the data phase in place (:mod:`._pipeline`) or through a ``load`` callable (:mod:`._loader`), how a unit
moves and what a failure midway says (:mod:`._transport`), and the call's delta phase (:mod:`._delta`).

Uses :mod:`..core`, :mod:`..commit` and :mod:`..delta`; never :mod:`..reshard`.
"""
