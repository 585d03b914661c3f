"""The host's own time per decode step, measured on this machine's CPU: a ceiling for the summed
model (kernel_lists.decode_step's `host`), never fitted to the rows it predicts.

The lab's engine runs one step at a time with the host on the critical path: between two GPU steps
the scheduler picks the batch (Scheduler.schedule), the runner writes the step's inputs for every
sequence (DecodeInputs.write) and, after the sampled tokens come back, the scheduler appends them
(Scheduler.postprocess). This times exactly those three, with `batch` sequences of `context` cached
tokens, on the CPU alone (no model, no GPU): the scheduler's and the input writer's Python, which no
other ceiling measures. An exercise calls `host_step_us` before its timed rows and stores it in its
summary (`host_step_us`: {batch: µs}); the kernel lists read it from there. Left out still (no
ceiling): the sampler's token copy-back and the server's streaming.
"""
import statistics
import time

PROMPT_TOKEN = 7                      # any id: the scheduler and the input writer never read its value


def host_step_us(batch: int, context: int, steps: int = 200, block_size: int = 16) -> float:
    """Median µs of schedule + write the decode inputs + postprocess, `batch` sequences decoding
    after a prompt of `context` tokens, over `steps` steps (the first 10 not counted)."""
    import torch

    from ..engine.config import EngineConfig
    from ..engine.decode_inputs import DecodeInputs
    from ..engine.scheduler import Scheduler
    from ..engine.sequence import SamplingParams, Sequence
    max_len = context + steps + 16
    blocks_per_seq = -(-max_len // block_size)
    config = EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=block_size,
                          num_kv_blocks=batch * blocks_per_seq + 8, max_num_seqs=batch, max_model_len=max_len,
                          max_num_batched_tokens=max(8192, context))
    scheduler = Scheduler(config)
    for i in range(batch):
        scheduler.add(Sequence(f"host-{i}", [PROMPT_TOKEN] * context, SamplingParams(max_tokens=10**6, ignore_eos=True)))
    while scheduler.waiting:                                   # the prompts' prefills, untimed
        b = scheduler.schedule()
        scheduler.postprocess(b.seqs, [[PROMPT_TOKEN]] * len(b.seqs))
    inputs = DecodeInputs(batch, blocks_per_seq, torch.device("cpu"))
    samples = []
    for _ in range(steps + 10):
        t0 = time.perf_counter()
        b = scheduler.schedule()
        inputs.write(b.seqs, None, block_size)
        scheduler.postprocess(b.seqs, [[PROMPT_TOKEN]] * len(b.seqs))
        samples.append((time.perf_counter() - t0) * 1e6)
    if len(b.seqs) != batch:
        raise RuntimeError(f"host step: {len(b.seqs)} of {batch} sequences decoding")
    return statistics.median(samples[10:])


def host_steps_us(batches, context: int) -> dict:
    """{batch: µs} for each batch: what an exercise stores in its summary as `host_step_us`."""
    return {str(int(b)): host_step_us(int(b), int(context)) for b in batches}
