"""hvdp's per-rank state in Lightning checkpoints: every rank's error-feedback residuals are
gathered into the optimizer's state (rank 0 writes the file); on resume each rank takes its own
back, by the rule of ``hvdp.torch.save_checkpoint`` (another number of workers included)."""
import hvdp.torch as hvd
from hvdp.torch.checkpoint import own_state

KEY = "hvdp_per_rank"


def gather_residuals(state: dict) -> dict:
    """Collective: the optimizer ``state`` with every rank's hvdp state under ``hvdp_per_rank``."""
    if "hvdp" not in state:
        return state
    state = dict(state)
    state[KEY] = hvd.allgather_object(state.pop("hvdp"), name="hvdp.lightning.ckpt")
    return state


def own_residuals(state: dict, rank: int) -> dict:
    """The saved optimizer ``state`` as this rank's optimizer loads it."""
    state = dict(state)
    per_rank = state.pop(KEY, None)
    if per_rank is not None:
        state["hvdp"] = own_state(per_rank, rank)
    return state
