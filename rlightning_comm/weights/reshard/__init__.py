"""``reshard_state_dict``: the blocks each member holds straight into the blocks others want, with no gather.

The call and its agreement (:mod:`._call`), blocks of global tensors and what each member holds and wants
(:mod:`._slices`), the static schedule of who sends which block to whom (:mod:`._schedule`, its geometry in
:mod:`._cover`), the data phase on one member (:mod:`._mover`; on NCCL :mod:`._batched`), the digests of pieces
tallied by sender and receiver (:mod:`._tally`), and the call's delta phase (:mod:`._delta`, moved by
:mod:`._delta_mover`).

Uses :mod:`..core`, :mod:`..commit` and :mod:`..delta`; never :mod:`..broadcast`.
"""
