import argparse

from bench import copy_bandwidth, data_plane, fallback, ort_bridge, recovery, session_overhead

BENCHES = (("copy", copy_bandwidth), ("session", session_overhead), ("dataplane", data_plane),
           ("recovery", recovery), ("fallback", fallback), ("ortbridge", ort_bridge))

parser = argparse.ArgumentParser(prog="python -m bench")
parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke run)")
parser.add_argument("which", nargs="*", choices=[name for name, _ in BENCHES], help="which (default: all)")
args = parser.parse_args()
for name, module in BENCHES:
    if not args.which or name in args.which:
        module.main(quick=args.quick)
        print()
