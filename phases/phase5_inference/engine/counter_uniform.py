"""Counter-based uniform numbers for the sampler: a draw is a pure function of its counter.

A row's uniform in [0, 1) is a hash of (stream key, counter), where the key is the request's seed,
or, for a request without one, the engine's seed and the number the engine gave the request (its
draw stream: the same on every tensor-parallel rank; a separate domain, so no
seeded request shares an unseeded one's numbers), and the counter is the index of the token being
drawn. No state: the same request draws the same numbers alone or in any batch, after a
preemption, and one step ahead (overlap.py), and a batch's numbers cost a few vectorized host
operations whatever its size. The hash is SplitMix64's finalizer (Steele, Lea and Flood, "Fast
splittable pseudorandom number generators", 2014; the seeding function of Java's SplittableRandom
and of xoshiro), applied in a chain key -> counter; its 53 high bits make the float.
"""
import numpy as np

GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX_1, MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
SEEDED, UNSEEDED = np.uint64(1), np.uint64(2)          # key domains


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's step on uint64 values: add the golden gamma, then its finalizer (wraps mod 2**64)."""
    z = x + GOLDEN_GAMMA
    z = (z ^ (z >> np.uint64(30))) * MIX_1
    z = (z ^ (z >> np.uint64(27))) * MIX_2
    return z ^ (z >> np.uint64(31))


def row_uniforms(seeds: list, streams: list[int], counters: list[int], engine_seed: int) -> np.ndarray:
    """float64 [n] in [0, 1): row i's number at counters[i] in its stream (seeds[i], or engine_seed
    and streams[i] where seeds[i] is None). Seeds and streams are integers in [0, 2**64)."""
    seeded = np.array([s is not None for s in seeds], dtype=bool)
    first = np.array([engine_seed if s is None else s for s in seeds], dtype=np.uint64)
    second = np.array([0 if s is not None else i for s, i in zip(seeds, streams)], dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = mix64(mix64(first ^ np.where(seeded, SEEDED, UNSEEDED)) ^ second)
        bits = mix64(key ^ np.array(counters, dtype=np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53
