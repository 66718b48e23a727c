"""``hvdp.lightning``: Lightning's Trainer on Horovod with hvdp's codecs.

Example::

    import lightning.pytorch as L
    from hvdp.lightning import HorovodStrategy
    trainer = L.Trainer(max_epochs=5, strategy=HorovodStrategy(compression="int8"))
    trainer.fit(model, loader)        # horovodrun -np 2 -H localhost:2 python train.py
"""
from lightning.pytorch.strategies import StrategyRegistry as _registry

from .environment import HorovodEnvironment  # noqa: F401
from .strategy import HorovodStrategy  # noqa: F401

if HorovodStrategy.strategy_name not in _registry:  # Trainer(strategy="hvdp")
    HorovodStrategy.register_strategies(_registry)
