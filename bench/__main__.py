import argparse

from bench import (cnn_runs, copy_bandwidth, data_plane, ep_context, external_data, fallback, iobinding, llm,
                   operations, ort_bridge, recovery, session_overhead)

BENCHES = (("copy", copy_bandwidth), ("session", session_overhead), ("dataplane", data_plane), ("cnnruns", cnn_runs),
           ("recovery", recovery), ("fallback", fallback), ("iobinding", iobinding), ("ortbridge", ort_bridge),
           ("epcontext", ep_context), ("extdata", external_data), ("llm", llm), ("operations", operations))


def parse_args(argv=None) -> argparse.Namespace:
    names = [name for name, _ in BENCHES]
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke run)")
    # Checked here rather than by `choices`: argparse checks an empty list of positionals against them too.
    parser.add_argument("which", nargs="*", metavar="BENCH", help=f"which (default: all): {', '.join(names)}")
    args = parser.parse_args(argv)
    unknown = [w for w in args.which if w not in names]
    if unknown:
        parser.error(f"no bench {', '.join(unknown)}; choose from {', '.join(names)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    for name, module in BENCHES:
        if not args.which or name in args.which:
            module.main(quick=args.quick)
            print()


if __name__ == "__main__":
    main()
