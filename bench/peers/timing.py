"""The timing loop every GPU peer shares: warm-up steps, then the mean of
timed steps between CUDA synchronisations, with the allocator's peak over
the timed steps only."""
import time

import torch


def time_steps(step, warmup, steps):
    """Runs step(i) `warmup` times, then `steps` timed times; returns (seconds per step, last result)."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = None
    for i in range(steps):
        result = step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps, result


def record(peer, gpus, batch, seq, seconds, loss):
    """One run's JSON-ready figures."""
    return {
        "peer": peer, "gpus": gpus, "batch": batch, "seq": seq, "step_ms": seconds * 1e3,
        "tokens_per_s_per_gpu": batch * seq / seconds,
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9, "loss": loss.item(),
    }


def trainer_step_times():
    """A transformers TrainerCallback recording each optimizer step's seconds
    between CUDA synchronisations (its `.seconds`): the Trainer-based peers' timer."""
    from transformers import TrainerCallback

    def synchronize():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds = []
            self.start = None

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.seconds.append(time.perf_counter() - self.start)

    return StepTimes()
