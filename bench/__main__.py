import argparse

from bench import copy_bandwidth, fallback, recovery, session_overhead

parser = argparse.ArgumentParser(prog="python -m bench")
parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke run)")
parser.add_argument("which", nargs="*", choices=["copy", "session", "recovery", "fallback"], help="which (default: all)")
args = parser.parse_args()
for name, module in (("copy", copy_bandwidth), ("session", session_overhead), ("recovery", recovery),
                     ("fallback", fallback)):
    if not args.which or name in args.which:
        module.main(quick=args.quick)
        print()
