"""The small core both weight-sync calls share; it knows neither call.

What a member keeps between calls (:mod:`._memory`: plans, staging buffers, an unwaited transfer, a delta's snapshot),
the small rounds that give every member every member's few words and raise one member's problem on all
(:mod:`._rounds`), the problems a check returns and the views it compares (:mod:`._checks`), copies between tensors and
staging buffers (:mod:`._staging`), whether messages go point to point and the mode's store (:mod:`._wire`), and
``async_op=True``'s captures and the thread a publish runs on (:mod:`._publish`).

Uses no other room of ``weights``.
"""
