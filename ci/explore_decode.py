"""Time every split count on a few shapes: the data behind dispatch.num_splits (the
kernels' configs are the tuner's: python -m flash_reasoning.tune). Run on a GPU."""
import sys

import torch

from flash_reasoning import runtime, timing
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.synthetic import paged_problem

SHAPES = [  # (name, seq_lens, qo heads, kv heads, head_dim)
    ("flat_64x2048/q32kv8", [2048] * 64, 32, 8, 128),
    ("flat_64x2048/q32kv32", [2048] * 64, 32, 32, 128),
    ("flat_64x2048/q16kv1", [2048] * 64, 16, 1, 128),
    ("b4x8192/q32kv8", [8192] * 4, 32, 8, 128),
    ("b1x32768/q32kv8", [32768], 32, 8, 128),
    ("b256x2112/q32kv8", [2112] * 256, 32, 8, 128),
    ("flat_64x2048/q32kv8/d64", [2048] * 64, 32, 8, 64),
    ("flat_32x2048/q32kv8/d256", [2048] * 32, 32, 8, 256),
]

SPLITS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    arch, sms = runtime.arch_of(device.index), runtime.num_sms(device.index)
    bw = timing.copy_bandwidth_tbps()
    print(f"{torch.cuda.get_device_name()} {arch} {sms} SMs, copy {bw:.2f} TB/s")
    for name, lens, hq, hkv, dim in SHAPES:
        p = paged_problem(lens, hq, hkv, dim, device="cuda")
        out = torch.empty_like(p.q)
        floor = (sum(lens) * hkv * dim * 4 + 2 * p.q.numel() * 2) / (bw * 1e12) * 1e6

        def time_it(**choice):
            launches = decode_launches(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens,
                                       out, 0.1, arch, sms, **choice)
            return timing.median_us(lambda: runtime.run(launches, device), runs=50)

        splits = {n: time_it(num_splits=n) for n in SPLITS}
        auto = time_it()
        print(f"{name:26} floor {floor:7.1f}  heuristic {auto:7.1f} us ({auto / floor:.2f}x)\n"
              f"   splits  " + "  ".join(f"{n}:{us:.1f}" for n, us in splits.items()),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
