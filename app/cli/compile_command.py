"""`ephost compile MODEL --ep TARGET [--option KEY=VALUE ...] -o OUT [--embed]`.

Compiles a model across the given EPs, as a session would, and writes the EP context model: each partition an
EP compiled becomes an `EPContext` node carrying that EP's compiled form (in a file beside OUT, or inside it with
--embed), what no EP compiled keeps its nodes. `ephost run OUT --ep TARGET` then restores instead of compiling.
"""
from __future__ import annotations

import os
import time

from ephost import ep_context
from ephost.cli.run_command import (AddEnvironmentOption, AddEp, AddOption, add_environment_arguments, add_eps,
                                 format_table)


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="compile a model and write it with each compiled partition as an EPContext "
                                       "node (ep.context_enable)", description=__doc__.replace("`", ""))
    p.add_argument("model", help="an .onnx file")
    p.add_argument("--ep", action=AddEp, default=[], metavar="TARGET", required=True,
                   help="an EP to compile on (EP name, worker address, inproc:NAME), in order; repeatable")
    p.add_argument("--option", action=AddOption, metavar="KEY=VALUE", help="an option of the --ep before it")
    add_environment_arguments(p, AddEnvironmentOption)
    p.add_argument("-o", "--output", required=True, help="the context model to write (ep.context_file_path)")
    p.add_argument("--embed", action="store_true",
                   help="keep the compiled forms inside the model (ep.context_embed_mode=1; default: files beside it)")
    p.set_defaults(func=main)


def main(args) -> int:
    from ephost import Environment, InferenceSession, SessionOptions

    with Environment() as env:
        options = SessionOptions()
        options.add_session_config_entry(ep_context.ENABLE, "1")
        options.add_session_config_entry(ep_context.FILE_PATH, args.output)
        options.add_session_config_entry(ep_context.EMBED_MODE, "1" if args.embed else "0")
        add_eps(env, options, args.ep)
        start = time.perf_counter()
        with InferenceSession(args.model, options, env=env) as session:
            seconds = time.perf_counter() - start
            rows = [["partition", "registration", "EP", "nodes"]]
            for i, sub in enumerate(session.get_provider_graph_assignment_info()):
                rows.append([str(i), sub.registration, sub.ep_name, str(len(sub.nodes))])
            print(f"model: {args.model}")
            print(format_table(rows))
            print(f"compiled in {seconds:.3f} s (session creation)")
            for path in session.ep_context_files:
                print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    return 0
