"""The gradient reduction: everything between "here are this step's gradients" and "here are
their averages".

- ``engine``: the :class:`~hvdp.reduce.engine.Engine` an adapter drives (per bucket, or a step at
  once), built by ``build`` from frozen ``settings``, with ``uniform`` (auto's one codec for a
  traced step) and ``templates`` (a traced step's statistics);
- ``reducer``: the :class:`~hvdp.reduce.reducer.Reducer` contract every reducer follows, and the
  ``Store`` / ``PlainPath`` protocols an adapter fills in;
- the reducers: ``twophase`` (alltoall + allgather of encoded chunks, error feedback),
  ``lowrank`` (powersgd), ``hierarchy`` (two levels), ``mixed`` (a codec per bucket), ``join``
  (uneven inputs);
- ``plan`` (policy, buckets), ``stats`` (wire bytes, phase times), ``collectives`` (the
  collectives an adapter passes in), ``simcomm`` (P simulated workers);
- ``compression="auto"``: ``auto`` decides from a cost table, ``probe`` measures it,
  ``chooser`` runs probe, decision and trial.
"""
