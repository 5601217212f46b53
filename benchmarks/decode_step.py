"""The decode step's host launch time next to its device time and the verify's floors, eager (ops enqueued one by
one around the verify graph) against the step graphs (the whole step as one CUDA graph): the `decode_step` rows of
`simharness bench kernels`, alone. Usage (a CUDA machine; `--quick` for the small sizes):

    python3 benchmarks/decode_step.py --out results/kernels/decode-step
"""

import argparse
from pathlib import Path

import pandas as pd
import torch

from simharness.bench import decode_rows, kernel_tables, measure_copy_bandwidth, measure_matmul_tflops, write_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    copy_gbps = measure_copy_bandwidth(device, args.quick)
    peak_tflops = measure_matmul_tflops(device)
    frame = pd.DataFrame(decode_rows(device, args.quick, copy_gbps, peak_tflops, print))
    write_tables(frame, device, args.out, copy_gbps, args.quick, peak_tflops)
    for _, table in kernel_tables(frame):
        print(table.to_string(index=False, float_format="{:.4g}".format))


if __name__ == "__main__":
    main()
