"""Phase 7's training step for the profiler check (common/kernel_trace_check.py): one eager bf16
step of a scaling size (forward, backward, clipping, fused AdamW, as train.train runs it, on random
tokens) beside its kernel list (kernel_lists.training_step).

    python -m common.kernel_trace_check --exercise phase7.scaling --param size=nano
"""
from common.errors import LabError

from . import kernel_lists


def scaling_step(params: dict, device):
    """(one training step, its workload, a label) of scaling's size `size` (default nano)."""
    import torch

    from .gpt import GPT
    from .scaling import EXERCISE, plan
    from .train import _grad_norm, autocast, make_optimizer
    unknown = sorted(set(params) - {"size"})
    if unknown:
        raise LabError(f"phase 7's trace step has no parameter '{unknown[0]}' (it takes size)")
    sizes = {s["name"]: s for s in EXERCISE.params["sizes"]}
    name = params.get("size", "nano")
    if name not in sizes:
        raise LabError(f"no scaling size '{name}'; known: {', '.join(sizes)}")
    cfg, tc = plan(EXERCISE.params, sizes[name])
    model = GPT(cfg).to(device)
    opt = make_optimizer(model, tc, device)
    weights = list(model.parameters())
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (tc.batch_size, cfg.block_size), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (tc.batch_size, cfg.block_size), device=device, generator=g)

    def step():
        with autocast(device):
            _, loss = model(x, y)
        loss.backward()
        _grad_norm(weights, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()                                   # the loss read back, as a step's synchronize

    w = kernel_lists.training_step(cfg, tc.batch_size, "bf16", clip=bool(tc.grad_clip), data=False)
    return step, w, f"GPT {name} training step, {tc.batch_size} x {cfg.block_size} tokens"


TRACE_STEPS = {"phase7.scaling": scaling_step}
