"""What faces the cluster rather than the gradients: ``launch`` (``python -m hvdp run``),
``bootstrap`` (``hvd.init()`` under torchrun, srun, a script's own process group), ``agreement``
(the ranks-agree check), ``failures`` and ``boards`` (failure reports between ranks),
``watchdog`` (the stall deadline), ``mesh`` (DP x TP x PP process sets), ``elastic`` (elastic
sample order)."""
