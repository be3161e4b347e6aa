"""The reference scripts' `--serve` mode: one process for a whole test
binary (tests/common's `reference_job`), which imports torch and the
libraries compared with once. Each line of stdin is a job, the JSON list of
its command-line arguments; each is answered on stdout by `ft-reference ok `
and what the job printed, or `ft-reference error: ` and the traceback, each
as a JSON string.
"""

import contextlib
import gc
import io
import json
import sys
import traceback


def serve(run):
    """Runs `run(arguments)` for each job on stdin."""
    # What the imports made, out of the collector's sight: a job's collections
    # (the Trainer's gc.collect() at the end of each training) walk only its own objects.
    gc.freeze()
    for line in sys.stdin:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                run(json.loads(line))
            answer = "ok " + json.dumps(printed.getvalue())
        except BaseException:  # argparse's SystemExit too: the process serves the next job
            answer = "error: " + json.dumps(traceback.format_exc())
        print("ft-reference " + answer, flush=True)


def main(parser, run):
    """Runs `run(args)` on the command line's arguments as `parser` parses
    them, or with --serve on each job's."""
    parser.add_argument("--serve", action="store_true", help="take jobs from stdin, one a line (JSON list of arguments)")
    args = parser.parse_args()
    if args.serve:
        serve(lambda arguments: run(parser.parse_args(arguments)))
    else:
        run(args)
