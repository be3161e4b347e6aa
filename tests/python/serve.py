"""The reference scripts' command line, and their `--serve` mode: one
process for a whole test binary (tests/common's `reference_job`), which
imports torch and the libraries compared with once. Each line of stdin is a
job, the JSON list of its command-line arguments; each is answered on stdout
by `ft-reference ok`, or `ft-reference error: ` and the traceback as a JSON
string.
"""

import json
import sys
import traceback


def main(parser, run):
    """Runs `run(arguments)` on the command line's arguments, or with
    --serve on each job's."""
    parser.add_argument("--serve", action="store_true", help="take jobs from stdin, one a line (JSON list of arguments)")
    args = parser.parse_args()
    if not args.serve:
        run(args)
        return
    for line in sys.stdin:
        try:
            run(parser.parse_args(json.loads(line)))
            answer = "ok"
        except BaseException:  # argparse's SystemExit too: the process serves the next job
            answer = "error: " + json.dumps(traceback.format_exc())
        print("ft-reference " + answer, flush=True)
