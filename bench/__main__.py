import argparse

from bench import copy_bandwidth

parser = argparse.ArgumentParser(prog="python -m bench")
parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke run)")
args = parser.parse_args()
copy_bandwidth.main(quick=args.quick)
