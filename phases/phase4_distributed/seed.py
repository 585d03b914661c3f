"""The seed write-up's phase 4 figures (4x A100 SXM 40GB, NVLink, PyTorch 2.4), quoted for comparison.

They are the specification of what phase 4 measures, never results of this lab: every table or
sentence that shows them says so with CITATION. Sizes in the seed's bandwidth table are MiB/GiB
(its 1 GB row: 2 x 3/4 x 2^30 bytes / 7.244 ms = 222 GB/s, the busbw it printed).
"""
CITATION = "seed write-up (shared/seeds/000_d50e6b73398ffa0d.txt), Exercise 4.3, on 4x A100 SXM 40GB"
HARDWARE_KEY = "a100_sxm_40gb"
WORLD_SIZE = 4
RATED_GBPS_USED = 600          # the seed divided busbw by NVLink 3's bidirectional total

# (size in bytes, ms, busbw GB/s) of torch.distributed.all_reduce, as the seed printed them
ALLREDUCE = [(2**20, 0.051, 31.0), (16 * 2**20, 0.202, 124.3), (64 * 2**20, 0.596, 168.8),
             (256 * 2**20, 2.092, 192.5), (512 * 2**20, 3.817, 211.0), (2**30, 7.244, 222.3),
             (2 * 2**30, 14.152, 227.6)]
DDP_STEP_S = (0.21, 0.26)      # fastest and slowest rank's step time
RING_MAX_ABS_DIFF = 9.54e-07   # its ring all-reduce against dist.all_reduce, fp32
