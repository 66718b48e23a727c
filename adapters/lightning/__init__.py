"""``hvdp.lightning``: Lightning's Trainer and Fabric on Horovod with hvdp's codecs.

Example::

    import lightning.pytorch as L
    from hvdp.lightning import HorovodStrategy
    trainer = L.Trainer(max_epochs=5, strategy=HorovodStrategy(compression="int8"))
    trainer.fit(model, loader)        # horovodrun -np 2 -H localhost:2 python train.py
"""
from lightning.fabric.strategies import STRATEGY_REGISTRY as _fabric_registry
from lightning.pytorch.strategies import StrategyRegistry as _trainer_registry

from .environment import HorovodEnvironment  # noqa: F401
from .fabric import HorovodFabricStrategy  # noqa: F401  (Fabric(strategy=...))
from .strategy import HorovodStrategy  # noqa: F401  (Trainer(strategy=...))

# Trainer(strategy="hvdp") and Fabric(strategy="hvdp"), once hvdp.lightning is imported
for _registry, _cls in ((_trainer_registry, HorovodStrategy), (_fabric_registry, HorovodFabricStrategy)):
    if _cls.strategy_name not in _registry:
        _cls.register_strategies(_registry)
