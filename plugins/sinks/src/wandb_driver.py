# ft's wandb sink runs this with the user's python3: it turns the JSON lines
# ft writes on stdin into calls on the user's own `wandb` client
# (plugins/sinks/src/wandb.rs is the other end). wandb reads its own settings
# from the environment: WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR,
# WANDB_RUN_ID, WANDB_RESUME, WANDB_API_KEY, …
#
#   {"init": {"name": …, "id": … or null, "resume": bool, "config": {key: text}}}
#       answered on stdout with {"id": …}, {"missing": …} (no wandb) or {"error": …}
#   {"log": {"step": n, "values": {key: number or "NaN"/"Infinity"/"-Infinity"}}}
#   {"summary": {…}}
#   {"finish": {"exit_code": n}}
# A client started again after one died gets the run's messages from the
# start; on a resumed run W&B already has the steps before run.step, which
# are skipped (W&B would drop them with a warning each).
import json
import os
import sys


def answer(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def config_value(text):
    # ft's config values are text; W&B compares and plots numbers, so what
    # reads as JSON (numbers, booleans, lists) goes as that.
    try:
        return json.loads(text)
    except ValueError:
        return text


def main():
    try:
        import wandb
    except ImportError as e:
        answer({"missing": f"{sys.executable}: {e}"})
        return 1
    run = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if "init" in message:
                init = message["init"]
                run = wandb.init(
                    project=os.environ.get("WANDB_PROJECT", "ft"),
                    name=init["name"],
                    id=init["id"],
                    resume="allow" if init["resume"] else None,
                    config={key: config_value(value) for key, value in init["config"].items()},
                )
                answer({"id": run.id})
            elif "log" in message:
                log = message["log"]
                # float() reads the non-finite values ft sends as text.
                if log["step"] >= run.step:
                    run.log({key: float(value) for key, value in log["values"].items()}, step=log["step"])
            elif "summary" in message:
                run.summary.update(message["summary"])
            elif "finish" in message:
                run.finish(exit_code=message["finish"]["exit_code"])
                return 0
        except Exception as e:  # noqa: BLE001 — reported to ft, which goes on
            if run is None:
                answer({"error": f"wandb.init failed: {e!r}"})
                return 1
            print(f"ft's wandb sink: {e!r} on {line.strip()[:200]}", file=sys.stderr, flush=True)
    # ft went away without finishing: its run failed.
    if run is not None:
        run.finish(exit_code=1)
    return 0


sys.exit(main())
