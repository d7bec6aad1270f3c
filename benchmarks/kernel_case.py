"""One kernel-benchmark case run a few times eagerly, for a profiler to attach to:

    ncu --kernel-name regex:_attention_kernel --launch-skip 1 --launch-count 1 --set full \\
        python -m benchmarks.kernel_case smollm2 32 8192 verify

The first launch plans and compiles; ``--launch-skip 1`` profiles the second, a steady one.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import kernels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=list(kernels.SHAPES))
    parser.add_argument("batch", type=int)
    parser.add_argument("context", type=int)
    parser.add_argument("case", choices=list(kernels.OUR_CASES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    launch, _ = kernels.OUR_CASES[args.case](kernels.Case(kernels.SHAPES[args.shape], args.batch, args.context))
    for _ in range(args.repeats):
        launch()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
