"""An LLM-judge verifier for Harbor: rubric grading by an OpenAI-compatible chat-completions API.

This module owns the judge client (key rotation, retries, score parsing) and `LlmJudgeVerifier`,
a Harbor 0.25 `harbor.verifier.base.BaseVerifier`. Harbor builds a verifier from
`TrialConfig.verifier.import_path` ("oneloop.agents.judge:LlmJudgeVerifier") with its
`verifier.kwargs` as keyword arguments (`VerifierFactory.create_verifier_from_import_path`), then
awaits `verify()` for a `VerifierResult`; an exception from `verify()` becomes the trial's
`exception_info`.

Grading: the agent's response is the file `response_path` inside the environment (the demo's
`/logs/agent/answer.txt` by default); a missing file is the model's failure (reward 0, the judge is
not called). The judge gets the task instruction, the response and the numbered rubric criteria,
and must answer with JSON `{"criteria": [{"id": 1, "met": true, "reason": "..."}, ...]}`; the
reward is the weight of the criteria met over the total weight. The reward is written to the
trial's `verifier/reward.json` (`{"reward": x}`, what Harbor's script verifier reads) with the
verdicts in `verifier/judge.json`, and returned as `VerifierResult(rewards={"reward": x})`.

Failure policy: 408 / 409 / 429 / 5xx, connection errors and timeouts are retried (tenacity:
exponential backoff with jitter, at most `max_attempts`, within `deadline_s`); any other 4xx is
never retried. API keys rotate round robin per judge call, and a 429 moves to the next key.
When the judge cannot grade (rejected request, retries spent, unparsable answer) `verify()`
raises a `JudgeInfraError`: no reward file is written, Harbor records the exception, and
`oneloop.agents.trials.classify` counts every trial exception other than an agent timeout as an
infra error (retried with a fresh trial, then the group masked), never reward 0. The task's
`[verifier] timeout_sec` bounds the whole `verify()` (past it Harbor raises
`VerifierTimeoutError`, an infra error too): keep it above `deadline_s + timeout_s`.

API keys: `api_keys_env` names a variable holding comma-separated keys, looked up in the
verifier's env (`verifier.env`, `${VAR}` templates resolved as Harbor does) and then the process
environment; `api_keys` (a list) is for tests, as Harbor writes verifier kwargs into trial files.
Keys are never written anywhere; records name a key by its index.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from harbor.models.verifier.result import VerifierResult
from harbor.verifier.base import BaseVerifier
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from oneloop.errors import ConfigError, OneloopError

IMPORT_PATH = "oneloop.agents.judge:LlmJudgeVerifier"
DEFAULT_RESPONSE_PATH = "/logs/agent/answer.txt"
DEFAULT_RUBRIC_PATH = "tests/rubric.json"  # relative to the task directory
DEFAULT_API_KEYS_ENV = "JUDGE_API_KEYS"
RETRYABLE_4XX = frozenset({408, 409, 429})
MISSING_RESPONSE_RC = 3  # exit code of the read command when the response file is absent
READ_TIMEOUT_SEC = 60
# What Harbor's VerifierFactory passes to every verifier besides `verifier.kwargs`.
HARBOR_VERIFIER_ARGS = frozenset(
    {"task", "trial_paths", "environment", "override_env", "logger", "verifier_env",
     "step_name", "include_logs", "exclude_logs", "skip_tests_upload"}
)  # fmt: skip
ERROR_BODY_CHARS = 500
SYSTEM_PROMPT = (
    "You grade an AI agent's response against a rubric. For each numbered criterion decide "
    "whether the response meets it. Reply with JSON only, exactly in this form: "
    '{"criteria": [{"id": 1, "met": true, "reason": "one sentence"}, ...]} '
    "with one entry per criterion."
)


class JudgeInfraError(OneloopError, RuntimeError):
    """The judge could not grade the trial: an infrastructure error, never a reward of 0."""


class JudgeRejectedError(JudgeInfraError):
    """The judge API refused the request (a 4xx other than 408/409/429); not retried."""


class JudgeUnavailableError(JudgeInfraError):
    """Rate limits, server errors or timeouts outlasted the retry budget."""


class JudgeResponseError(JudgeInfraError):
    """The judge answered, but not with a verdict for every criterion."""


class _Transient(Exception):
    def __init__(self, what: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(what)
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class Criterion:
    text: str
    weight: float = 1.0


def parse_rubric(value: Any, where: str) -> tuple[Criterion, ...]:
    """A rubric is a non-empty list of strings or {"criterion": str, "weight": number > 0}."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of criteria, got {value!r}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item.strip():
            out.append(Criterion(item.strip()))
            continue
        text = item.get("criterion") if isinstance(item, dict) else None
        weight = item.get("weight", 1.0) if isinstance(item, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}[{i}]: expected a string or {{'criterion': str}}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{where}[{i}].weight: expected a number > 0, got {weight!r}")
        out.append(Criterion(text.strip(), float(weight)))
    return tuple(out)


@dataclass(frozen=True)
class JudgeConfig:
    """How the judge is called; errors name `verifier.kwargs.<field>`."""

    base_url: str  # OpenAI-compatible API root, e.g. https://api.example.com/v1
    model: str
    api_keys: tuple[str, ...]
    timeout_s: float = 120.0  # one HTTP attempt, start to finish
    max_attempts: int = 6  # attempts per judge call, the first included
    deadline_s: float = 900.0  # no new attempt after this many seconds
    backoff_initial_s: float = 1.0  # wait after the first failure; doubles each retry
    backoff_max_s: float = 60.0
    backoff_jitter_s: float = 1.0  # uniform(0, jitter) added to every wait
    temperature: float = 0.0
    max_tokens: int = 2048

    def __post_init__(self) -> None:
        checks = (
            ("base_url", self.base_url.startswith(("http://", "https://"))),
            ("model", bool(self.model)),
            ("api_keys", bool(self.api_keys) and all(self.api_keys)),
            ("timeout_s", self.timeout_s > 0),
            ("max_attempts", self.max_attempts >= 1),
            ("deadline_s", self.deadline_s > 0),
            ("backoff_initial_s", self.backoff_initial_s > 0),
            ("backoff_max_s", self.backoff_max_s >= self.backoff_initial_s),
            ("backoff_jitter_s", self.backoff_jitter_s >= 0),
            ("temperature", self.temperature >= 0),
            ("max_tokens", self.max_tokens >= 1),
        )
        for name, ok in checks:
            if not ok:
                shown = "<redacted>" if name == "api_keys" else repr(getattr(self, name))
                raise ConfigError(f"verifier.kwargs.{name}: invalid value {shown}")


class KeyRing:
    """Round-robin API keys shared by every judge call of this process using the same keys."""

    def __init__(self, n_keys: int) -> None:
        self._n = n_keys
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            index = self._next
            self._next = (self._next + 1) % self._n
            return index


_RINGS: dict[tuple[str, ...], KeyRing] = {}
_RINGS_LOCK = threading.Lock()


def key_ring(keys: Sequence[str]) -> KeyRing:
    with _RINGS_LOCK:
        return _RINGS.setdefault(tuple(keys), KeyRing(len(keys)))


@dataclass(frozen=True)
class CriterionVerdict:
    criterion: str
    weight: float
    met: bool
    reason: str


@dataclass(frozen=True)
class JudgeVerdict:
    score: float  # met weight / total weight, in [0, 1]
    criteria: tuple[CriterionVerdict, ...]
    attempts: int
    key_indices: tuple[int, ...]  # the key of each attempt, by index
    model: str


@dataclass
class _CallLog:
    attempts: int = 0
    key_indices: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date: the backoff alone decides


def _content(body: Any) -> str:
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise JudgeResponseError(f"judge reply has no choices[0].message.content: {body!r:.300}")
    return content


def parse_verdicts(content: str, rubric: Sequence[Criterion]) -> tuple[CriterionVerdict, ...]:
    """The judge's JSON verdicts, one per criterion (ids 1..N), or `JudgeResponseError`."""
    start, end = content.find("{"), content.rfind("}")
    try:
        data = json.loads(content[start : end + 1]) if 0 <= start < end else None
    except ValueError:
        data = None
    items = data.get("criteria") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise JudgeResponseError(f"judge reply is not {{'criteria': [...]}} JSON: {content:.300}")
    by_id: dict[int, dict[str, Any]] = {}
    for item in items:
        ident = item.get("id") if isinstance(item, dict) else None
        if type(ident) is not int or not 1 <= ident <= len(rubric) or ident in by_id:
            raise JudgeResponseError(f"judge verdict has a bad or repeated id: {item!r:.200}")
        if not isinstance(item.get("met"), bool):
            raise JudgeResponseError(f"judge verdict {ident} has no boolean 'met': {item!r:.200}")
        by_id[ident] = item
    missing = sorted(set(range(1, len(rubric) + 1)) - set(by_id))
    if missing:
        raise JudgeResponseError(f"judge gave no verdict for criteria {missing}")
    return tuple(
        CriterionVerdict(c.text, c.weight, by_id[i]["met"], str(by_id[i].get("reason", "")))
        for i, c in enumerate(rubric, start=1)
    )


def judge_messages(instruction: str, response: str, rubric: Sequence[Criterion]) -> list[dict]:
    criteria = "\n".join(f"{i}. {c.text}" for i, c in enumerate(rubric, start=1))
    user = (
        f"## Task given to the agent\n{instruction}\n\n## Agent's response\n{response}\n\n"
        f"## Criteria\n{criteria}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


class JudgeClient:
    """Grades responses against rubrics with retries and key rotation (see the module doc).

    `sleep` is awaited for every backoff wait (tests pass a recorder); `transport` is an optional
    httpx transport.
    """

    def __init__(
        self,
        cfg: JudgeConfig,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.cfg = cfg
        self._sleep = sleep
        self._transport = transport
        self._ring = key_ring(cfg.api_keys)
        self._backoff = wait_exponential_jitter(
            multiplier=cfg.backoff_initial_s, max=cfg.backoff_max_s, jitter=cfg.backoff_jitter_s
        )

    def _wait(self, state: RetryCallState) -> float:
        delay = self._backoff(state)
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Transient) and exc.retry_after is not None:
            delay = max(delay, min(exc.retry_after, self.cfg.backoff_max_s))
        return delay

    async def _attempt(
        self, http: httpx.AsyncClient, payload: dict[str, Any], key_index: int
    ) -> str:
        headers = {"Authorization": f"Bearer {self.cfg.api_keys[key_index]}"}
        try:
            response = await asyncio.wait_for(
                http.post("chat/completions", json=payload, headers=headers), self.cfg.timeout_s
            )
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _Transient(f"timed out after {self.cfg.timeout_s} s ({exc!r})") from exc
        except httpx.TransportError as exc:
            raise _Transient(f"connection error: {exc!r}") from exc
        status = response.status_code
        if status in RETRYABLE_4XX or status >= 500:
            raise _Transient(f"HTTP {status}", status, _retry_after(response))
        if status >= 400:
            raise JudgeRejectedError(
                f"judge {self.cfg.base_url} rejected the request with HTTP {status} (not "
                f"retried): {response.text[:ERROR_BODY_CHARS]}"
            )
        try:
            body = response.json()
        except ValueError as exc:
            raise JudgeResponseError(f"judge reply is not JSON: {response.text:.300}") from exc
        return _content(body)

    async def grade(
        self, instruction: str, response: str, rubric: Sequence[Criterion]
    ) -> JudgeVerdict:
        """One judge call (with its retries) -> the verdict; `JudgeInfraError` when it fails."""
        payload = {
            "model": self.cfg.model,
            "messages": judge_messages(instruction, response, rubric),
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
        }
        log = _CallLog()
        key_index = self._ring.take()
        content = ""

        async def sleep(seconds: float) -> None:
            log.waits.append(seconds)
            await self._sleep(seconds)

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_Transient),
            stop=stop_after_attempt(self.cfg.max_attempts) | stop_after_delay(self.cfg.deadline_s),
            wait=self._wait,
            sleep=sleep,
            reraise=True,
        )
        timeout = httpx.Timeout(self.cfg.timeout_s)
        base_url = self.cfg.base_url.rstrip("/") + "/"
        async with httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=self._transport
        ) as http:
            try:
                async for attempt in retrying:
                    with attempt:
                        log.attempts += 1
                        log.key_indices.append(key_index)
                        try:
                            content = await self._attempt(http, payload, key_index)
                        except _Transient as exc:
                            if exc.status == 429:  # this key is rate limited: use another
                                key_index = self._ring.take()
                            raise
            except _Transient as exc:
                raise JudgeUnavailableError(
                    f"judge {self.cfg.base_url} failed {log.attempts} attempts (last: {exc}); "
                    f"waits {[round(w, 2) for w in log.waits]} s"
                ) from exc
        verdicts = parse_verdicts(content, rubric)
        total = sum(v.weight for v in verdicts)
        score = sum(v.weight for v in verdicts if v.met) / total
        return JudgeVerdict(score, verdicts, log.attempts, tuple(log.key_indices), self.cfg.model)


def _api_keys(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = env.get(name) or os.environ.get(name, "")
    keys = tuple(key.strip() for key in raw.split(",") if key.strip())
    if not keys:
        raise ConfigError(
            f"verifier.kwargs.api_keys_env: environment variable {name!r} is unset or empty; "
            "set it to one or more comma-separated judge API keys"
        )
    return keys


class LlmJudgeVerifier(BaseVerifier):
    """Harbor verifier: rubric grading by an LLM judge (see the module docstring).

    kwargs (`verifier.kwargs`): `base_url`, `model` (required); `rubric` (list) or `rubric_path`
    (relative to the task dir, default tests/rubric.json); `api_keys_env` (default
    JUDGE_API_KEYS) or `api_keys`; `response_path`, `max_response_chars`; and any
    `JudgeConfig` field (timeouts, retries, backoff, temperature, max_tokens).
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        rubric: list[Any] | None = None,
        rubric_path: str = DEFAULT_RUBRIC_PATH,
        api_keys: list[str] | None = None,
        api_keys_env: str = DEFAULT_API_KEYS_ENV,
        response_path: str = DEFAULT_RESPONSE_PATH,
        max_response_chars: int = 50_000,
        **kwargs: Any,
    ) -> None:
        fields = set(JudgeConfig.__dataclass_fields__) - {"base_url", "model", "api_keys"}
        judge_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        # BaseVerifier swallows unknown kwargs; a misspelt verifier kwarg must not pass silently.
        unknown = sorted(set(kwargs) - HARBOR_VERIFIER_ARGS)
        if unknown:
            raise ConfigError(
                f"verifier.kwargs.{unknown[0]}: unknown to LlmJudgeVerifier; expected base_url, "
                f"model, rubric, rubric_path, api_keys_env, api_keys, response_path, "
                f"max_response_chars or one of {sorted(fields)}"
            )
        kwargs.pop("skip_tests_upload", None)  # the judge uploads no tests
        super().__init__(**kwargs)
        self.response_path = response_path
        if max_response_chars < 1:
            raise ConfigError("verifier.kwargs.max_response_chars: expected an integer >= 1")
        self.max_response_chars = max_response_chars
        if rubric is not None:
            self.rubric = parse_rubric(rubric, "verifier.kwargs.rubric")
        else:
            path = self.task.paths.task_dir / rubric_path
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"verifier.kwargs.rubric_path: cannot read a JSON rubric at {path} ({exc})"
                ) from exc
            self.rubric = parse_rubric(data, str(path))
        if api_keys is None:
            from harbor.utils.env import resolve_env_vars

            env = {
                **self.task.config.verifier.env,
                **(self.verifier_env or {}),
                **self.override_env,
            }
            api_keys = list(_api_keys(resolve_env_vars(env), api_keys_env))
        cfg = JudgeConfig(base_url=base_url, model=model, api_keys=tuple(api_keys), **judge_kwargs)
        self.client = JudgeClient(cfg)

    async def _read_response(self) -> str | None:
        path = shlex.quote(self.response_path)
        command = (
            f"if [ -f {path} ]; then head -c {4 * self.max_response_chars} {path}; "
            f"else exit {MISSING_RESPONSE_RC}; fi"
        )
        result = await asyncio.wait_for(
            self.environment.exec(command, timeout_sec=READ_TIMEOUT_SEC), READ_TIMEOUT_SEC + 10
        )
        if result.return_code == MISSING_RESPONSE_RC:
            return None
        if result.return_code != 0:
            raise JudgeInfraError(
                f"reading {self.response_path} in the environment failed with exit code "
                f"{result.return_code}: {(result.stderr or '')[:ERROR_BODY_CHARS]}"
            )
        return (result.stdout or "")[: self.max_response_chars]

    def _write(self, name: str, data: Mapping[str, Any]) -> None:
        self.trial_paths.verifier_dir.mkdir(parents=True, exist_ok=True)
        (self.trial_paths.verifier_dir / name).write_text(json.dumps(data, indent=2))

    async def verify(self) -> VerifierResult:
        started = time.monotonic()
        response = await self._read_response()
        if response is None:
            score, record = 0.0, {"reward": 0.0, "reason": f"no response at {self.response_path}"}
        else:
            try:
                verdict = await self.client.grade(self.task.instruction, response, self.rubric)
            except JudgeInfraError as exc:
                self._write(
                    "judge_error.json",
                    {"error_type": type(exc).__name__, "error": str(exc),
                     "elapsed_sec": time.monotonic() - started},
                )  # fmt: skip
                raise
            score, record = verdict.score, {"reward": verdict.score, **asdict(verdict)}
        record["elapsed_sec"] = time.monotonic() - started
        self._write("judge.json", record)
        self._write("reward.json", {"reward": score})
        return VerifierResult(rewards={"reward": score})
