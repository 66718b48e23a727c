"""``hvd.DistributedOptimizer``, the call a Horovod script makes: Horovod's arguments checked and
turned into hvdp's reduce settings, ``op=hvd.Adasum`` handed to Horovod's own optimizer, and the
user's optimizer wrapped in a class made on the fly from its own (``optimizer.py``)."""
import os
import warnings

import horovod.torch as _hvd

from hvdp.config import compile_codecs_default
from hvdp.reduce.settings import ReduceSettings, is_low_rank, is_two_phase

from .comm import next_instance
from .compression import Compression, resolve
from .optimizer import _DistributedOptimizer


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=_hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=_hvd.global_process_set, policy=None, compile_codecs=None,
                         uneven_inputs=None, hierarchical=False):
    """Wrap a torch optimizer so each step averages gradients across workers first.

    Horovod's arguments keep Horovod's meaning. ``compression`` also takes a codec name
    ("none", "fp16", "bf16", "int8", "topk", "powersgd"), an ``hvd.Compression`` member, or "auto"
    (``hvd.Compression.auto``: hvdp probes the link and codecs at the first step and picks a
    codec per bucket, see ``hvdp.reduce.auto``); ``policy`` an
    :class:`hvdp.CompressionPolicy` (size threshold, name patterns, warm-up, fusion, error feedback);
    ``compile_codecs`` fuses the codec with torch.compile (default: env ``HVDP_COMPILE_CODECS=1``);
    ``uneven_inputs``: ranks with fewer batches may call ``hvd.join()`` with any codec (with a
    bf16/int8/int4/topk codec one tiny allreduce per step tells the ranks whether someone has
    joined; see ``hvdp.reduce.join``). None (default): on wherever supported, off with
    ``hierarchical=True`` or powersgd (``hvd.join()`` then raises ``hvd.JoinRefused`` saying why);
    True: insist (an error where unsupported); False: off (Horovod's behaviour, no per-step
    control; ``hvd.join()`` with a two-phase codec is refused);
    ``hierarchical=True`` reduces in two levels: float32 inside each node, the codec between
    nodes (``hvdp.reduce.hierarchy``; needs Horovod's process sets: ``hvd.init(process_sets="dynamic")``
    or ``hvd.init(process_sets=hvd.hierarchical_process_sets())``).

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression="int8")
    """
    codec, hvd_compressor = resolve(compression)
    if op == _hvd.Adasum:
        if is_two_phase(codec) or is_low_rank(codec):
            raise ValueError(f"op=hvd.Adasum cannot combine with {codec.name} compression (Adasum "
                             "needs whole tensors); use compression 'none' or 'fp16'")
        hc = hvd_compressor or (_hvd.Compression.fp16 if codec.name == "fp16" else _hvd.Compression.none)
        return _hvd.DistributedOptimizer(optimizer, named_parameters, hc, backward_passes_per_step,
                                         op, gradient_predivide_factor, num_groups, groups,
                                         sparse_as_dense, process_set)
    if op not in (_hvd.Average, _hvd.Sum):
        raise ValueError("op must be hvd.Average, hvd.Sum or hvd.Adasum")
    if num_groups:
        warnings.warn("num_groups is deprecated (as in Horovod): use groups=", DeprecationWarning)
        groups = groups if groups is not None else num_groups
    if compile_codecs is None:
        compile_codecs = compile_codecs_default(os.environ)  # HVDP_COMPILE_CODECS, hvdp.config
    settings = ReduceSettings.from_user(codec, hvd_compressor, policy, op_sum=op == _hvd.Sum,
                                        predivide=gradient_predivide_factor,
                                        backward_passes=backward_passes_per_step, sparse_as_dense=sparse_as_dense,
                                        uneven_inputs=uneven_inputs, hierarchical=hierarchical,
                                        instance=next_instance(process_set))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, settings, hvd_compressor, groups, process_set,
               compile_codecs)
