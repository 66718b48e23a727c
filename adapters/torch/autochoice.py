"""The torch pieces of ``compression="auto"``: the reducers the optimizer runs (one factory for a
fixed codec and for auto's per-bucket codecs, so both run the same path), and the probe's
inputs (this optimizer's collectives, torch ops on the gradients' device, Horovod's allgather
for the shared table). The decision itself is the core's (``hvdp.auto``, ``hvdp.chooser``)."""
import torch

from hvdp.chooser import Chooser
from hvdp.codecs.auto import Auto
from hvdp.join import JoinableReducer
from hvdp.mixed import MixedReducer
from hvdp.probe import measure
from hvdp.twophase import TwoPhaseReducer

from .agreement import allgather_fixed
from .compiled import CompiledCodec
from .ops import TorchOps

_OPS = TorchOps()


def two_phase_factory(opt, compile_codecs: bool):
    """``(codec, comm) -> reducer`` as ``opt`` reduces a bucket with ``codec``: its error feedback
    setting, torch.compile'd codec if asked, statistics and the uneven-inputs wrapper on the
    optimizer's own comm (not on the probe's loop-back one)."""
    def make(codec, comm):
        pol = opt._policy
        ef = pol.error_feedback if pol.error_feedback is not None else codec.error_feedback_default
        run = CompiledCodec(codec) if compile_codecs else codec
        own = comm is opt._comm
        r = TwoPhaseReducer(run, _OPS, comm, ef, opt._op, opt._predivide, opt.stats if own else None)
        return JoinableReducer(r, opt._join.joined) if (own and opt._join is not None) else r
    return make


def make_reducer(opt, codec, compile_codecs: bool):
    """-> (reducer or None, Chooser or None) for a codec, auto's settings, or a Horovod compressor."""
    make = two_phase_factory(opt, compile_codecs)
    if isinstance(codec, Auto):
        return MixedReducer(_OPS, opt._comm, make, opt._op, opt._predivide, opt.stats), Chooser(codec)
    if codec is not None and not codec.summable:
        return make(codec, opt._comm), None
    return None, None


def ensure_decided(opt) -> None:
    """Before the step's first collective: auto's decision for the current buckets (probing the
    first time and after an invalidation, then the trial steps; nothing once settled)."""
    chooser = opt._auto
    if chooser is None or chooser.settled:
        return
    buckets = {f"b{b}": sum(opt._params[i].numel() for i in idx) for b, idx in enumerate(opt._plan.buckets)}
    like = opt._params[0].detach() if opt._params else torch.zeros(0)
    sync = torch.cuda.synchronize if like.is_cuda else (lambda: None)
    gather = allgather_fixed(opt._comm.process_set)
    make = two_phase_factory(opt, opt._compile_codecs)

    def probe(sizes):
        return measure(opt._comm, _OPS, like, list(sizes.values()), chooser.settings.candidates, make,
                       gather, sync=sync)
    chooser.ensure(buckets, opt._reducer, opt._comm.size, probe, gather)


def step_done(opt) -> None:
    """After a step's reduction: its time, for auto's trial (the device's queue drained first)."""
    if opt._auto is not None and not opt._auto.settled:
        if opt._params and opt._params[0].is_cuda:
            torch.cuda.synchronize()
        opt._auto.step_done()
