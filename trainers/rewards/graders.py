"""Reward functions for GRPO and PPO, and the declarative graders that jobs submitted over HTTP use.

A reward function is a plain callable ``(prompts, completions, **columns) -> list[float]``: one score per
completion; ``columns`` are the RL rows' other fields, one list entry per completion. GRPO and PPO take a
list of them plus optional weights. ``build_grader`` turns an OpenAI-shaped grader dict into one:

- ``string_check``: ``{"type": "string_check", "name", "operation": "eq" | "ne" | "like" | "ilike",
  "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}`` -> 1.0 or 0.0 (``like``: the
  reference is a substring of the input; ``ilike``: the same, ignoring case);
- ``text_similarity``: ``{..., "evaluation_metric": "fuzzy_match" | "bleu"}`` -> [0, 1];
- ``score_model``: ``{..., "model": <local folder of a sequence-classification reward model>}`` -> the
  model's scalar score of prompt + completion;
- ``multi``: ``{"graders": {"a": {...}, ...}, "calculate_output": "0.5 * a + 0.5 * b"}``, the formula
  allowing numbers, + - * /, the sub-graders' names, ``min``, ``max`` and ``abs``;
- ``python``: ``{"source": "def grade(sample, item) -> float: ..."}``, tenant code: refused unless the
  operator passes ``allow_python=True``, run per batch in an operating-system sandbox
  (``trainers.rewards.sandbox``: no network, no other processes, no files but a read-only runtime and a
  private /tmp, uid 65534) under wall-time, CPU, process and address-space limits.

Templates: ``{{sample.output_text}}`` is the completion's content (without its reasoning or tool-call
markup), ``{{sample.output_tools}}`` its tool calls as a chat completion's ``tool_calls``
(``trainers.rewards.samples``; ``{{sample.output_tools[0].function.name}}``, empty where the completion
calls no tool), ``{{item.FIELD}}`` a column of the row; dotted paths reach into objects and ``[i]`` into
lists, a value that is not a string is written as JSON; text without ``{{...}}`` is a literal.
``validate_grader`` checks a spec without running anything (the API calls it when a job is created);
``GraderError.param`` names the offending field, e.g. ``"grader.graders.a.operation"``.

    python -c "from trainers.rewards.graders import build_grader; g = build_grader({'type': 'string_check',
    'name': 'n', 'operation': 'like', 'input': '{{sample.output_text}}', 'reference': 'Lima'});
    print(g(['Capital of Peru?'], ['It is Lima.']))"
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from trainers.core.errors import DataError
from trainers.rewards import formula as formula_checker
from trainers.rewards import sandbox
from trainers.rewards.formula import eval_formula
from trainers.rewards.samples import SAMPLE_FIELDS, sample_namespace

__all__ = [
    "GRADER_TYPES",
    "GraderError",
    "RewardFunc",
    "build_grader",
    "fuzzy_match",
    "reward_name",
    "sentence_bleu",
    "validate_grader",
]

GRADER_TYPES = ("string_check", "text_similarity", "score_model", "multi", "python")
STRING_OPERATIONS = ("eq", "ne", "like", "ilike")
SIMILARITY_METRICS = ("fuzzy_match", "bleu")
_TEMPLATE = re.compile(r"\{\{\s*(sample|item)\.([A-Za-z0-9_.\-]+(?:\[\d+\][A-Za-z0-9_.\-]*)*)\s*\}\}")
_PATH_PART = re.compile(r"\[(\d+)\]|([^.\[\]]+)")
_BRACED = re.compile(r"\{\{.*?\}\}")


class RewardFunc(Protocol):
    """One score per completion; ``None`` where it cannot judge one (see ``trainers.families.rl``)."""

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: list[Any]
    ) -> Sequence[float | None]: ...


class GraderError(DataError):
    """A grader spec is malformed, or grading failed in a way that blames the job (tenant code, data).

    ``param`` names the field at fault, e.g. ``"grader.graders.a.operation"``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param)


def reward_name(func: Callable[..., Any], index: int) -> str:
    """A reward function's name for metrics: a grader's ``name``, a function's ``__name__``."""
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name != "<lambda>" else f"reward_{index}"


# -- templates ----------------------------------------------------------------------------------------
def path_parts(path: str) -> list[str | int]:
    """A template variable's path as keys and list indexes.

    >>> path_parts("output_tools[0].function.name")
    ['output_tools', 0, 'function', 'name']
    """
    return [int(index) if index else key for index, key in _PATH_PART.findall(path)]


def lookup(value: Any, path: str) -> tuple[bool, Any]:
    """(whether ``path`` reaches something in ``value``, what it reaches)."""
    for part in path_parts(path):
        in_list = isinstance(value, list) and isinstance(part, int) and part < len(value)
        if not in_list and not (isinstance(value, Mapping) and part in value):
            return False, None
        value = value[part]
    return True, value


def render(template: str, completion: str, item: Mapping[str, Any], *, param: str) -> str:
    """Substitute ``{{sample.*}}`` and ``{{item.*}}`` in ``template``.

    >>> render("{{ item.answer }}!", "x", {"answer": "Lima"}, param="p")
    'Lima!'
    >>> render("{{sample.output_text}}", "It is Lima", {}, param="p")
    'It is Lima'
    >>> render("[{{sample.output_tools[0].function.name}}]", "It is Lima", {}, param="p")
    '[]'
    """
    sample: dict[str, Any] | None = None

    def substitute(match: re.Match[str]) -> str:
        nonlocal sample
        scope, path = match.group(1), match.group(2)
        if scope == "sample":
            if path_parts(path)[0] not in SAMPLE_FIELDS:
                raise GraderError(f"unknown template variable sample.{path}", param)
            sample = sample_namespace(completion) if sample is None else sample
            # what the sample lacks (a tool call it did not make) reads as nothing: it scores, not fails
            found, value = lookup(sample, path)
            return "" if not found else value if isinstance(value, str) else json.dumps(value)
        found, value = lookup(item, path)
        if not found:
            raise GraderError(f"the row has no field item.{path}", param)
        return value if isinstance(value, str) else json.dumps(value)

    return _TEMPLATE.sub(substitute, template)


def _items(n: int, columns: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    return [{key: values[i] for key, values in columns.items()} for i in range(n)]


# -- string_check ---------------------------------------------------------------------------------------
class StringCheck:
    """1.0 when ``input`` and ``reference`` compare as ``operation`` says, else 0.0.

    >>> check = StringCheck("has_lima", "ilike", "{{sample.output_text}}", "{{item.answer}}")
    >>> check(["Capital of Peru?", "Capital of Peru?"], ["It is LIMA.", "Quito"], answer=["Lima", "Lima"])
    [1.0, 0.0]
    """

    def __init__(self, name: str, operation: str, input: str, reference: str, param: str = "grader") -> None:
        self.__name__ = name
        self.operation, self.input, self.reference, self.param = operation, input, reference, param

    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
        scores = []
        for completion, item in zip(completions, _items(len(completions), columns), strict=True):
            text = render(self.input, completion, item, param=f"{self.param}.input")
            ref = render(self.reference, completion, item, param=f"{self.param}.reference")
            if self.operation == "eq":
                ok = text == ref
            elif self.operation == "ne":
                ok = text != ref
            elif self.operation == "like":
                ok = ref in text
            else:
                ok = ref.lower() in text.lower()
            scores.append(1.0 if ok else 0.0)
        return scores


# -- text_similarity ------------------------------------------------------------------------------------
def fuzzy_match(hypothesis: str, reference: str) -> float:
    """difflib's ``SequenceMatcher`` ratio, 2 * matches / total length, in [0, 1].

    >>> fuzzy_match("Lima", "Lima"), round(fuzzy_match("Lima", "Lime"), 2)
    (1.0, 0.75)
    """
    return difflib.SequenceMatcher(None, hypothesis, reference).ratio()


def sentence_bleu(hypothesis: str, reference: str, max_n: int = 4) -> float:
    """Sentence BLEU on whitespace tokens (Papineni et al. 2002, eq. 1-2) with add-one smoothing of the
    2..4-gram precisions (Lin & Och 2004), so that short hypotheses score above 0.

        BLEU = BP * exp(mean_n log p_n),   BP = min(1, exp(1 - r / c))

    >>> sentence_bleu("the capital of peru is lima", "the capital of peru is lima")
    1.0
    >>> round(sentence_bleu("the capital is lima", "the capital of peru is lima"), 3)
    0.361
    >>> sentence_bleu("", "lima")
    0.0
    """
    hyp, ref = hypothesis.split(), reference.split()
    if not hyp or not ref:
        return 1.0 if hyp == ref else 0.0
    log_precision = 0.0
    for n in range(1, max_n + 1):
        hyp_ngrams = Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
        ref_ngrams = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
        matches = sum(min(count, ref_ngrams[gram]) for gram, count in hyp_ngrams.items())
        total = max(0, len(hyp) - n + 1)
        smooth = 0 if n == 1 else 1
        if matches + smooth == 0:
            return 0.0
        log_precision += math.log((matches + smooth) / (total + smooth)) / max_n
    brevity = min(1.0, math.exp(1 - len(ref) / len(hyp)))
    return brevity * math.exp(log_precision)  # <= 1: every factor is


class TextSimilarity:
    """Similarity of ``input`` to ``reference`` in [0, 1] (``fuzzy_match`` or ``bleu``).

    >>> sim = TextSimilarity("close", "fuzzy_match", "{{sample.output_text}}", "Lima")
    >>> sim(["q", "q"], ["Lima", "Lime"])
    [1.0, 0.75]
    """

    def __init__(self, name: str, metric: str, input: str, reference: str, param: str = "grader") -> None:
        self.__name__ = name
        self.metric = fuzzy_match if metric == "fuzzy_match" else sentence_bleu
        self.input, self.reference, self.param = input, reference, param

    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
        scores = []
        for completion, item in zip(completions, _items(len(completions), columns), strict=True):
            text = render(self.input, completion, item, param=f"{self.param}.input")
            ref = render(self.reference, completion, item, param=f"{self.param}.reference")
            scores.append(float(self.metric(text, ref)))
        return scores


# -- score_model ----------------------------------------------------------------------------------------
class ScoreModel:
    """The scalar output of a reward model (a ``reward_model`` run's final ``model/`` folder) on prompt +
    completion: ``trainers.rewards.scorer.load_reward_scorer``, which encodes the pair exactly as reward-model
    training does. ``prompts`` are the prompts as the policy saw them (chat template applied), so prompt +
    completion is the text the policy produced.

    >>> scorer = ScoreModel("rm", "/path/to/reward-model")  # doctest: +SKIP
    >>> scorer(["<|user|>\\nHi<|end|><|assistant|>\\n"], ["Hello!"])  # doctest: +SKIP
    [0.73]
    """

    def __init__(self, name: str, model_path: str, *, batch_size: int = 16, param: str = "grader") -> None:
        from trainers.rewards.scorer import load_reward_scorer

        self.__name__ = name
        try:
            self.score = load_reward_scorer(model_path, batch_size=batch_size)
        except (OSError, ValueError) as exc:
            raise GraderError(
                f"cannot load the reward model at {model_path}: {exc}", f"{param}.model"
            ) from exc

    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
        return self.score(prompts, completions)


# -- multi ----------------------------------------------------------------------------------------------
def parse_formula(formula: str, names: Sequence[str], *, param: str) -> ast.Expression:
    """``trainers.rewards.formula.parse_formula``, its ``FormulaError`` as a ``GraderError`` naming
    ``param``."""
    try:
        return formula_checker.parse_formula(formula, names)
    except formula_checker.FormulaError as exc:
        raise GraderError(str(exc), param) from exc


class MultiGrader:
    """Combine sub-graders with a formula over their names.

    >>> a = StringCheck("a", "like", "{{sample.output_text}}", "Lima")
    >>> b = TextSimilarity("b", "fuzzy_match", "{{sample.output_text}}", "Lima")
    >>> multi = MultiGrader("m", {"a": a, "b": b}, "0.5 * a + 0.5 * b")
    >>> multi(["q", "q"], ["Lima", "Lime"])
    [1.0, 0.375]
    """

    def __init__(
        self, name: str, graders: Mapping[str, RewardFunc], formula: str, param: str = "grader"
    ) -> None:
        self.__name__ = name
        self.graders = dict(graders)
        self.tree = parse_formula(formula, list(graders), param=f"{param}.calculate_output")

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: list[Any]
    ) -> list[float | None]:
        scores = {name: g(prompts, completions, **columns) for name, g in self.graders.items()}
        out: list[float | None] = []
        for i in range(len(completions)):
            values = {name: s[i] for name, s in scores.items()}
            judged = {name: v for name, v in values.items() if v is not None}
            # a sub-grader that could not judge leaves the combination unjudged (None, see
            # trainers.families.rl)
            out.append(eval_formula(self.tree, judged) if len(judged) == len(values) else None)
        return out


# -- python ---------------------------------------------------------------------------------------------
# Runs in the child (`python -I -S`): its rlimits first (trainers.rewards.sandbox.limits_json), then the
# tenant code; the child's stdout carries only STARTED and the result (the tenant's prints go to stderr).
# No STARTED: the child never reached the tenant's code, so the sandbox (or the host) failed, not it.
_STARTED = "started"
_RUNNER = r"""
import json, math, os, resource, sys
limits = json.loads(sys.argv[1])
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
out = os.fdopen(os.dup(1), "w")
out.write("started\n"); out.flush()  # _STARTED
os.dup2(2, 1)
def reply(payload):
    out.write(json.dumps(payload)); out.flush(); os._exit(0)
payload = json.loads(sys.stdin.read())
try:
    scope = {"__name__": "grader"}
    exec(compile(payload["source"], "<grader>", "exec"), scope)
    grade = scope["grade"]
    scores = []
    for i, (sample, item) in enumerate(zip(payload["samples"], payload["items"])):
        value = grade(sample, item)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            reply({"error": f"grade() returned {value!r} for sample {i}; expected a finite number"})
        scores.append(float(value))
except MemoryError:
    reply({"error": "ran out of memory (limit %d MiB)" % (limits["RLIMIT_AS"] >> 20)})
except BaseException as exc:
    reply({"error": f"{type(exc).__name__}: {exc}"})
reply({"scores": scores})
"""


class PythonGrader:
    """Tenant code ``def grade(sample, item) -> float`` run in one sandboxed child process per batch.

    ``sample`` is the completion's ``{"output_text", "output_tools"}`` (``trainers.rewards.samples``),
    ``item`` the row's columns. The child runs under
    ``python -I -S`` in the operating-system sandbox of ``trainers.rewards.sandbox`` (its own namespaces,
    a read-only runtime and a private /tmp, uid 65534, capped processes, CPU and ``memory_mb`` of
    address space per process); it and everything it started is killed after ``timeout`` seconds.
    ``sandbox=False`` (the operator's explicit unsafe choice) runs it as the caller's uid with only the
    rlimits, in an empty temp folder with an empty environment. A failure of the tenant's code raises
    ``GraderError``, which fails the job; a sandbox the host cannot build raises ``SandboxUnavailable``.

    >>> source = "def grade(sample, item):\\n    return len(sample['output_text'])"
    >>> grader = PythonGrader("length", source, timeout=30, memory_mb=1024)
    >>> grader(["q", "q"], ["ab", "abcd"], answer=["x", "y"])
    [2.0, 4.0]
    """

    def __init__(
        self,
        name: str,
        source: str,
        *,
        timeout: float,
        memory_mb: int,
        sandbox: bool = True,
        param: str = "grader",
    ) -> None:
        self.__name__ = name
        self.source, self.timeout, self.memory_mb, self.param = source, timeout, memory_mb, param
        self.sandbox = sandbox

    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
        payload = json.dumps(
            {
                "source": self.source,
                "samples": [sample_namespace(c) for c in completions],
                "items": _items(len(completions), columns),
            },
            default=str,
        )
        limits = sandbox.limits_json(sandbox.Limits(seconds=self.timeout, memory_mb=self.memory_mb))
        if self.sandbox:
            argv = sandbox.command([sandbox.interpreter(), "-I", "-S", "-c", _RUNNER, limits])
        else:
            argv = [sys.executable, "-I", "-c", _RUNNER, limits]
        try:
            proc = _run(argv, payload, self.timeout)
        except subprocess.TimeoutExpired as exc:
            raise GraderError(
                f"python grader {self.__name__!r} timed out after {self.timeout:g} s "
                f"({len(completions)} samples)",
                self.param,
            ) from exc
        started, _, reply = proc.stdout.partition("\n")
        detail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        if started != _STARTED:
            raise sandbox.SandboxUnavailable(f"the python grader's child did not start: {detail}")
        try:
            result = json.loads(reply) if reply else None
        except json.JSONDecodeError:
            result = None
        if not isinstance(result, dict):
            if proc.returncode == -signal.SIGXCPU:
                detail = f"used its {self.timeout:g} s of CPU"
            raise GraderError(f"python grader {self.__name__!r} crashed: {detail}", self.param)
        if "error" in result:
            raise GraderError(f"python grader {self.__name__!r} failed: {result['error']}", self.param)
        scores = result["scores"]
        assert isinstance(scores, list) and len(scores) == len(completions)
        return [float(s) for s in scores]


# after a timeout, how long the child's output may take to close: the sandbox's processes hold it until
# the kernel has killed them (milliseconds); a process that escaped the unsandboxed child's group, longer
_DRAIN_SECONDS = 2.0


def _run(argv: list[str], stdin: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`argv` fed `stdin`, in an empty temp folder with an empty environment and a process group of its
    own, which is killed at the end. Sandboxed, that group is bubblewrap, whose death takes the sandbox's
    init and with it every process in the sandbox; unsandboxed (the operator's unsafe choice) it is the
    child and what it started, but for a process that left the group (`setsid`)."""
    with (
        tempfile.TemporaryDirectory(prefix="grader-") as cwd,
        subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env={},
            start_new_session=True,
        ) as proc,
    ):
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # returns once they are all dead
                proc.communicate(timeout=_DRAIN_SECONDS)
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# -- specs ----------------------------------------------------------------------------------------------
def validate_grader(spec: Any, *, param: str = "grader", allow_python: bool = True) -> None:
    """Raise ``GraderError(message, param)`` if ``spec`` is not a well-formed grader; run nothing.

    >>> validate_grader({"type": "string_check", "name": "x", "operation": "eq",
    ...                  "input": "{{sample.output_text}}", "reference": "a"})
    >>> validate_grader({"type": "multi", "graders": {"a": {"type": "string_check", "name": "a",
    ...     "operation": "equals", "input": "{{sample.output_text}}", "reference": "a"}},
    ...     "calculate_output": "a"})
    Traceback (most recent call last):
    ...
    trainers.rewards.graders.GraderError: operation must be one of eq, ne, like, ilike, not 'equals'
    """
    if not isinstance(spec, Mapping):
        raise GraderError("a grader must be an object", param)
    kind = spec.get("type")
    if kind not in GRADER_TYPES:
        raise GraderError(f"type must be one of {', '.join(GRADER_TYPES)}, not {kind!r}", f"{param}.type")
    if kind != "multi":
        _require(spec, "name", param)
    if kind in ("string_check", "text_similarity"):
        for key in ("input", "reference"):
            value = _require(spec, key, param)
            for match in _TEMPLATE.finditer(value):
                if match.group(1) == "sample" and path_parts(match.group(2))[0] not in SAMPLE_FIELDS:
                    known = ", ".join(f"sample.{f}" for f in SAMPLE_FIELDS)
                    raise GraderError(
                        f"unknown template variable sample.{match.group(2)} (known: {known})",
                        f"{param}.{key}",
                    )
            # a `{{...}}` that is not a variable would be compared as literal text: surely a typo
            for braced in _BRACED.findall(value):
                if not _TEMPLATE.fullmatch(braced):
                    raise GraderError(
                        f"{braced} is not a template variable; use {{{{sample.output_text}}}}, "
                        "{{sample.output_tools}} or {{item.<field>}}",
                        f"{param}.{key}",
                    )
    if kind == "string_check" and spec.get("operation") not in STRING_OPERATIONS:
        raise GraderError(
            f"operation must be one of {', '.join(STRING_OPERATIONS)}, not {spec.get('operation')!r}",
            f"{param}.operation",
        )
    if kind == "text_similarity" and spec.get("evaluation_metric") not in SIMILARITY_METRICS:
        raise GraderError(
            f"evaluation_metric must be one of {', '.join(SIMILARITY_METRICS)}, "
            f"not {spec.get('evaluation_metric')!r}",
            f"{param}.evaluation_metric",
        )
    if kind == "score_model":
        _require(spec, "model", param)
    if kind == "python":
        if not allow_python:
            raise GraderError(
                "python graders are disabled on this server; the operator must enable them", f"{param}.type"
            )
        _check_python_source(_require(spec, "source", param), f"{param}.source")
    if kind == "multi":
        graders = spec.get("graders")
        if not isinstance(graders, Mapping) or not graders:
            raise GraderError("graders must be a non-empty object of named graders", f"{param}.graders")
        for name, sub in graders.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise GraderError(f"grader name {name!r} must be an identifier", f"{param}.graders")
            validate_grader(sub, param=f"{param}.graders.{name}", allow_python=allow_python)
        formula = _require(spec, "calculate_output", param)
        parse_formula(formula, list(graders), param=f"{param}.calculate_output")


def build_grader(
    spec: Mapping[str, Any],
    *,
    allow_python: bool = False,
    python_timeout: float = 30.0,
    python_memory_mb: int = 1024,
    python_sandbox: bool = True,
    param: str = "grader",
) -> RewardFunc:
    """The reward function a grader spec describes (validated first).

    >>> g = build_grader({"type": "string_check", "name": "exact", "operation": "eq",
    ...                   "input": "{{sample.output_text}}", "reference": "{{item.answer}}"})
    >>> g(["q", "q"], ["Lima", "lima"], answer=["Lima", "Lima"]), g.__name__
    ([1.0, 0.0], 'exact')
    """
    validate_grader(spec, param=param, allow_python=allow_python)
    kind = spec["type"]
    name = str(spec.get("name", kind))
    if kind == "string_check":
        return StringCheck(name, spec["operation"], spec["input"], spec["reference"], param)
    if kind == "text_similarity":
        return TextSimilarity(name, spec["evaluation_metric"], spec["input"], spec["reference"], param)
    if kind == "score_model":
        return ScoreModel(name, spec["model"], param=param)
    if kind == "python":
        return PythonGrader(
            name,
            spec["source"],
            timeout=python_timeout,
            memory_mb=python_memory_mb,
            sandbox=python_sandbox,
            param=param,
        )
    graders = {
        sub: build_grader(
            s,
            allow_python=allow_python,
            python_timeout=python_timeout,
            python_memory_mb=python_memory_mb,
            python_sandbox=python_sandbox,
            param=f"{param}.graders.{sub}",
        )
        for sub, s in spec["graders"].items()
    }
    return MultiGrader(name, graders, spec["calculate_output"], param)


def _require(spec: Mapping[str, Any], key: str, param: str) -> str:
    value = spec.get(key)
    if not isinstance(value, str) or not value:
        raise GraderError(f"{key} must be a non-empty string", f"{param}.{key}")
    return value


def _check_python_source(source: str, param: str) -> None:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise GraderError(f"source does not compile: {exc.msg} (line {exc.lineno})", param) from exc
    if not any(isinstance(node, ast.FunctionDef) and node.name == "grade" for node in tree.body):
        raise GraderError("source must define a top-level function grade(sample, item)", param)
