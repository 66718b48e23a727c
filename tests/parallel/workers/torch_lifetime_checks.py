"""An hvdp torch optimizer's lifetime; run as a check of torch_checks.py (its job)."""
import gc
import weakref

import torch

import hvdp.torch as hvd


def check_dropped_optimizers_are_freed(n=5):
    """An optimizer re-created per fold / phase is freed once dropped (its gradient hooks hold it
    weakly), including after its steps ran; hvd.join() then sees only the live one."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    refs = []
    for i in range(n):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression="int8")
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        refs.append(weakref.ref(opt))
        del opt
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {n} dropped optimizers are still alive"
    # the model's hooks outlive their optimizers: a new one still reduces (others are no-ops)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    x = torch.randn(4, 64) * (hvd.rank() + 1)
    model(x).sum().backward()
    local = model[0].bias.grad.clone()
    opt.synchronize()
    total = hvd.allreduce(local, op=hvd.Sum, name="freed.ref")
    assert torch.allclose(model[0].bias.grad, total / hvd.size(), atol=1e-5)
