"""Versions, digests and the all-or-nothing commit: what makes a sync verified and atomic, and what it reports.

A call's options and the versions each member committed (:mod:`._versions`), per-tensor digests computed as the bytes
pass (:mod:`._digest`) and how the members compare them (:mod:`._checks`), one sync on one member after its data phase:
verification and the commit through the mode's store (:mod:`._sync`), and the report every member returns
(:mod:`._report`). Nothing here knows how the bytes moved.

Uses :mod:`..core` only.
"""
