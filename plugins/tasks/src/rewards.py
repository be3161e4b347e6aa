"""ft's reward child (plugins/tasks/src/rewards.rs): imports the user's reward
functions once and calls them for each batch with TRL's signature.

One JSON message a line on the protocol's input, one answer a line on its
output:
  {"load": [[file, function], ...]} -> {"names": [...]}
  {"score": {"prompts", "completions", "completion_ids", "columns",
             "trainer_state"}} -> {"rewards": [[...], ...], "metrics": {...},
                                   "extra": {...}}
or {"error": message, "function": index or null} for either. The protocol
has file descriptors of its own: fds 0 and 1 are pointed at /dev/null and
stderr, so nothing the user's code reads or prints (Python's print, a C
library, a subprocess) touches it.
"""

import asyncio
import collections.abc
import importlib.util
import inspect
import json
import math
import numbers
import os
import sys
import traceback
import types

protocol_in = os.fdopen(os.dup(0), "r")
protocol_out = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(2, 1)

functions = []  # (name, callable), in the order given
loop = asyncio.new_event_loop()  # one for the run, as TRL keeps one: async clients stay bound to it


class FunctionError(Exception):
    """An error of the function at `index` (its message is the whole story)."""

    def __init__(self, index, message):
        super().__init__(message)
        self.index = index


def user_traceback():
    """The traceback of the exception being handled, from the user's code on: the child's own frame left out."""
    kind, error, trace = sys.exc_info()
    return "".join(traceback.format_exception(kind, error, trace.tb_next))


def load(requests):
    modules = {}
    names = []
    for index, (file, function) in enumerate(requests):
        try:
            if file not in modules:
                # Its folder on the path, so that it imports the modules beside it.
                sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
                spec = importlib.util.spec_from_file_location(f"ft_reward_{len(modules)}", file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module  # as an import would: dataclasses and pickle look it up
                spec.loader.exec_module(module)
                modules[file] = module
        except BaseException:
            raise FunctionError(index, f"importing {file} failed:\n{user_traceback()}")
        func = getattr(modules[file], function, None)
        if func is None:
            raise FunctionError(index, f"{file} has no function `{function}`")
        if not callable(func):
            raise FunctionError(index, f"{file}:{function} is a {type(func).__name__}, not a function")
        functions.append(func)
        names.append(getattr(func, "__name__", function))
    return {"names": names}


def checked(index, output, expected):
    """The rewards of function `index` as floats or None (NaN is None, as TRL takes it)."""
    if hasattr(output, "tolist"):  # a NumPy array or torch tensor
        output = output.tolist()
    if isinstance(output, (str, bytes, collections.abc.Mapping)) or not isinstance(output, collections.abc.Iterable):
        raise FunctionError(index, f"returned a {type(output).__name__} ({output!r:.200}), not a list of {expected} rewards")
    output = list(output)  # any iterable, as TRL takes it
    if len(output) != expected:
        raise FunctionError(index, f"returned {len(output)} rewards for {expected} completions: {output!r:.300}")
    rewards = []
    for position, reward in enumerate(output):
        if reward is None:
            rewards.append(None)
        elif isinstance(reward, numbers.Real):  # bools too, as torch.tensor takes them
            reward = float(reward)
            if math.isinf(reward):
                raise FunctionError(index, f"returned {reward} for completion {position}: rewards are finite, or None where one does not apply")
            rewards.append(None if math.isnan(reward) else reward)
        else:
            raise FunctionError(index, f"returned {reward!r:.200} ({type(reward).__name__}) for completion {position}: a reward is a number, or None where it does not apply")
    return rewards


def score(batch):
    metrics = {}
    extra = {}

    def log_metric(name, value):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"log_metric({name!r}, {value}): a metric is a finite number")
        metrics.setdefault(str(name), []).append(value)

    def log_extra(column, values):
        extra.setdefault(str(column), []).extend(values)

    kwargs = {
        "prompts": batch["prompts"],
        "completions": batch["completions"],
        "completion_ids": batch["completion_ids"],
        **batch["columns"],
        # transformers' TrainerState holds these; a reward function shapes its reward by the progress they give.
        "trainer_state": types.SimpleNamespace(**batch["trainer_state"]),
        "log_extra": log_extra,
        "log_metric": log_metric,
    }
    expected = len(batch["completions"])
    outputs = [None] * len(functions)
    pending = []  # async functions run together, as TRL gathers them
    for index, func in enumerate(functions):
        try:
            output = func(**kwargs)
        except BaseException:
            raise FunctionError(index, f"raised an exception:\n{user_traceback()}")
        if inspect.isawaitable(output):
            pending.append(index)
        outputs[index] = output

    async def awaited(index):
        try:
            return await outputs[index]
        except BaseException:
            raise FunctionError(index, f"raised an exception:\n{user_traceback()}")

    async def gathered():
        return await asyncio.gather(*(awaited(index) for index in pending))

    if pending:
        results = loop.run_until_complete(gathered())
        for index, result in zip(pending, results):
            outputs[index] = result
    rewards = [checked(index, output, expected) for index, output in enumerate(outputs)]
    return {"rewards": rewards, "metrics": metrics, "extra": extra}


for line in protocol_in:
    message = json.loads(line)
    try:
        answer = load(message["load"]) if "load" in message else score(message["score"])
        text = json.dumps(answer, allow_nan=False)
    except FunctionError as error:
        text = json.dumps({"error": str(error), "function": error.index})
    except BaseException:
        text = json.dumps({"error": traceback.format_exc(), "function": None})
    protocol_out.write(text + "\n")
    protocol_out.flush()
