"""The LLM-judge verifier against a real local HTTP judge (http.server in a thread).

The server plays a scripted list of replies (429s, 5xxs, 400s, ...) and then answers with a
verdict; it records every request's API key and body, so key rotation and retries are observed
on the wire. Backoff waits go through an injected sleep that records the delay and returns at
once. The Harbor tests run real Harbor trials (oracle agent, no-container environment) whose
verifier is loaded by `import_path`.
"""

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from oneloop.agents.demo_tasks import generate_tasks
from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH
from oneloop.agents.judge import (
    IMPORT_PATH,
    Criterion,
    JudgeClient,
    JudgeConfig,
    JudgeRejectedError,
    JudgeResponseError,
    JudgeUnavailableError,
    parse_rubric,
)
from oneloop.agents.trials import TrialOutcome, classify
from oneloop.errors import ConfigError

RUBRIC = (Criterion("States the final number", 3.0), Criterion("Shows the working", 1.0))
VERDICT = {"criteria": [{"id": 1, "met": True, "reason": "ok"}, {"id": 2, "met": False}]}


def completion(content: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


@dataclass
class Reply:
    status: int
    body: object = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class JudgeServer:
    url: str
    script: list[Reply]
    default: Reply
    requests: list[dict] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return [r["authorization"].removeprefix("Bearer ") for r in self.requests]


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    state = JudgeServer(url="", script=[], default=Reply(200, completion(json.dumps(VERDICT))))
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with lock:
                state.requests.append(
                    {"path": self.path, "authorization": self.headers["authorization"],
                     "body": body}
                )  # fmt: skip
                reply = state.script.pop(0) if state.script else state.default
            time.sleep(reply.delay_s)
            data = json.dumps(reply.body if reply.body is not None else {"error": "x"}).encode()
            self.send_response(reply.status)
            for key, value in {"content-type": "application/json", **reply.headers}.items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="judge-server", daemon=True
    )
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def fresh_keys(n: int) -> tuple[str, ...]:
    """Keys unique to one test: the round-robin ring is shared per key set in a process."""
    tag = uuid.uuid4().hex[:6]
    return tuple(f"key{i}-{tag}" for i in range(n))


class SleepRecorder:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def client(server: JudgeServer, keys: tuple[str, ...], **overrides) -> tuple[JudgeClient, list]:
    settings = {"backoff_initial_s": 1.0, "backoff_jitter_s": 0.5, "backoff_max_s": 60.0}
    cfg = JudgeConfig(server.url, "judge-model", keys, **{**settings, **overrides})
    sleep = SleepRecorder()
    return JudgeClient(cfg, sleep=sleep), sleep.delays


def grade(judge: JudgeClient, response: str = "The answer is 42."):
    return asyncio.run(
        asyncio.wait_for(judge.grade("What is 6 * 7?", response, RUBRIC), timeout=60)
    )


def test_429s_and_500s_then_success_rotates_keys_and_backs_off(judge_server) -> None:
    judge_server.script = [Reply(429), Reply(429), Reply(500), Reply(503)]
    keys = fresh_keys(3)
    judge, delays = client(judge_server, keys)
    verdict = grade(judge)
    assert verdict.score == 3.0 / 4.0  # criterion 1 (weight 3) met, criterion 2 (weight 1) not
    assert [v.met for v in verdict.criteria] == [True, False]
    assert verdict.attempts == 5 and len(judge_server.requests) == 5
    # A 429 moves to the next key; a 5xx retries on the same key.
    assert judge_server.keys == [keys[0], keys[1], keys[2], keys[2], keys[2]]
    assert verdict.key_indices == (0, 1, 2, 2, 2)
    # Exponential backoff: 1 * 2**i plus jitter in [0, 0.5), so every wait is longer.
    assert len(delays) == 4
    for i, delay in enumerate(delays):
        assert 2**i <= delay <= 2**i + 0.5
    assert delays == sorted(delays)
    # The request the judge saw: the model, the instruction, the response, numbered criteria.
    sent = judge_server.requests[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["model"] == "judge-model"
    prompt = sent["body"]["messages"][1]["content"]
    assert "What is 6 * 7?" in prompt and "The answer is 42." in prompt
    assert "1. States the final number" in prompt and "2. Shows the working" in prompt
    # Round robin across calls: three takes so far (start, two 429s) -> the next call uses key 0.
    grade(judge)
    grade(judge)
    assert judge_server.keys[5:] == [keys[0], keys[1]]


def test_400_is_not_retried(judge_server) -> None:
    judge_server.script = [Reply(400, {"error": {"message": "bad max_tokens"}})]
    judge, delays = client(judge_server, fresh_keys(2))
    with pytest.raises(JudgeRejectedError, match="HTTP 400.*bad max_tokens"):
        grade(judge)
    assert len(judge_server.requests) == 1 and delays == []


@pytest.mark.parametrize(
    ("status", "retried"),
    [(401, False), (404, False), (422, False), (408, True), (409, True), (502, True)],
)
def test_which_statuses_are_retried(judge_server, status: int, retried: bool) -> None:
    judge_server.script = [Reply(status)]
    judge, delays = client(judge_server, fresh_keys(1))
    if retried:
        assert grade(judge).attempts == 2
        assert len(delays) == 1
    else:
        with pytest.raises(JudgeRejectedError):
            grade(judge)
        assert len(judge_server.requests) == 1 and delays == []


def test_retry_after_is_honoured_up_to_the_backoff_cap(judge_server) -> None:
    judge_server.script = [Reply(429, headers={"retry-after": "7"}),
                           Reply(429, headers={"retry-after": "900"})]  # fmt: skip
    judge, delays = client(judge_server, fresh_keys(2), backoff_max_s=30.0)
    assert grade(judge).attempts == 3
    assert delays[0] == 7.0  # above the 1 s backoff
    assert delays[1] == 30.0  # capped


def test_retries_spent_is_an_unavailable_error(judge_server) -> None:
    judge_server.default = Reply(500)
    judge, delays = client(judge_server, fresh_keys(2), max_attempts=3)
    with pytest.raises(JudgeUnavailableError, match="failed 3 attempts \\(last: HTTP 500\\)"):
        grade(judge)
    assert len(judge_server.requests) == 3 and len(delays) == 2


def test_timeouts_and_connection_errors_are_retried(judge_server) -> None:
    judge_server.script = [Reply(200, completion(json.dumps(VERDICT)), delay_s=2.0)]
    judge, delays = client(judge_server, fresh_keys(1), timeout_s=0.3)
    verdict = grade(judge)
    assert verdict.attempts == 2 and len(delays) == 1

    closed = JudgeServer(url="http://127.0.0.1:9/v1", script=[], default=Reply(200))
    judge, delays = client(closed, fresh_keys(1), max_attempts=3)
    with pytest.raises(JudgeUnavailableError, match="connection error"):
        grade(judge)
    assert len(delays) == 2


@pytest.mark.parametrize(
    "content",
    [
        "I think it is fine.",
        json.dumps({"criteria": [{"id": 1, "met": True}]}),  # criterion 2 missing
        json.dumps({"criteria": [{"id": 1, "met": "yes"}, {"id": 2, "met": False}]}),
        json.dumps({"criteria": [{"id": 1, "met": True}, {"id": 1, "met": False}]}),
    ],
)
def test_unparsable_verdicts_are_judge_errors_not_retried(judge_server, content: str) -> None:
    judge_server.script = [Reply(200, completion(content))]
    judge, delays = client(judge_server, fresh_keys(1))
    with pytest.raises(JudgeResponseError):
        grade(judge)
    assert len(judge_server.requests) == 1 and delays == []


def test_verdict_in_a_code_fence_is_parsed(judge_server) -> None:
    verdict = {"criteria": [{"id": 2, "met": True}, {"id": 1, "met": True}]}
    judge_server.script = [Reply(200, completion(f"```json\n{json.dumps(verdict)}\n```"))]
    judge, _ = client(judge_server, fresh_keys(1))
    assert grade(judge).score == 1.0


def test_bad_config_and_rubric_name_the_field() -> None:
    with pytest.raises(ConfigError, match="verifier.kwargs.base_url"):
        JudgeConfig("ftp://x", "m", ("k",))
    with pytest.raises(ConfigError, match="verifier.kwargs.api_keys: invalid value <redacted>"):
        JudgeConfig("http://x", "m", ())
    with pytest.raises(ConfigError, match="verifier.kwargs.max_attempts"):
        JudgeConfig("http://x", "m", ("k",), max_attempts=0)
    with pytest.raises(ConfigError, match=r"rubric\[1\].weight"):
        parse_rubric(["a", {"criterion": "b", "weight": -1}], "rubric")
    with pytest.raises(ConfigError, match="non-empty list"):
        parse_rubric([], "rubric")
    assert parse_rubric(["a", {"criterion": "b", "weight": 2}], "r") == (
        Criterion("a"), Criterion("b", 2.0)
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Through Harbor: the verifier loaded by import_path in a real trial
# ----------------------------------------------------------------------------------------------


def run_trial(tmp_path: Path, verifier_kwargs: dict) -> tuple:
    from harbor.models.trial.config import (
        AgentConfig,
        EnvironmentConfig,
        TaskConfig,
        TrialConfig,
        VerifierConfig,
    )
    from harbor.trial.trial import Trial

    splits = generate_tasks(tmp_path / "tasks", n_train=1, n_eval=0, seed=3)
    name = f"judge__{uuid.uuid4().hex[:8]}"
    cfg = TrialConfig(
        task=TaskConfig(path=splits.train[0].path),
        trial_name=name,
        trials_dir=tmp_path / "trials",
        agent=AgentConfig(name="oracle"),
        environment=EnvironmentConfig(
            import_path=NO_CONTAINER_IMPORT_PATH,
            kwargs={"root_base_dir": str(tmp_path / "roots")},
        ),
        verifier=VerifierConfig(import_path=IMPORT_PATH, kwargs=verifier_kwargs),
    )

    async def go():
        trial = await asyncio.wait_for(Trial.create(cfg), timeout=60)
        return await asyncio.wait_for(trial.run(), timeout=120)

    result = asyncio.run(go())
    return result, tmp_path / "trials" / name, splits.train[0]


def test_harbor_trial_records_the_judge_score(judge_server, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TEST_JUDGE_KEYS", ",".join(fresh_keys(2)))
    judge_server.script = [Reply(500)]
    result, trial_dir, task = run_trial(
        tmp_path,
        {"base_url": judge_server.url, "model": "judge-model", "api_keys_env": "TEST_JUDGE_KEYS",
         "rubric": ["States the final number", "Shows the working"],
         "backoff_initial_s": 0.01, "backoff_jitter_s": 0.0},
    )  # fmt: skip
    assert classify(result, trial_dir) == (TrialOutcome.OK, 0.5, None)
    assert json.loads((trial_dir / "verifier" / "reward.json").read_text()) == {"reward": 0.5}
    record = json.loads((trial_dir / "verifier" / "judge.json").read_text())
    assert record["attempts"] == 2 and record["key_indices"] == [0, 0]
    # The oracle's answer file reached the judge; the keys never reach the trial's files.
    assert str(task.question.answer) in judge_server.requests[-1]["body"]["messages"][1]["content"]
    assert task.question.text in judge_server.requests[-1]["body"]["messages"][1]["content"]
    for path in trial_dir.rglob("*"):
        if path.is_file():
            assert "key0-" not in path.read_text(errors="replace"), path


def test_harbor_trial_with_a_rejected_judge_is_an_infra_error(
    judge_server, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TEST_JUDGE_KEYS", ",".join(fresh_keys(1)))
    judge_server.script = [Reply(400, {"error": {"message": "context too long"}})]
    result, trial_dir, _ = run_trial(
        tmp_path,
        {"base_url": judge_server.url, "model": "judge-model", "api_keys_env": "TEST_JUDGE_KEYS",
         "rubric": ["States the final number"]},
    )  # fmt: skip
    outcome, reward, error = classify(result, trial_dir)
    assert (outcome, reward) == (TrialOutcome.INFRA_ERROR, None)  # not a reward of 0
    assert error.startswith("JudgeRejectedError: ") and "HTTP 400" in error
    assert len(judge_server.requests) == 1
    assert not (trial_dir / "verifier" / "reward.json").exists()
    recorded = json.loads((trial_dir / "verifier" / "judge_error.json").read_text())
    assert recorded["error_type"] == "JudgeRejectedError"


def test_harbor_trial_with_missing_keys_is_an_infra_error(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TEST_JUDGE_KEYS", raising=False)
    result, trial_dir, _ = run_trial(
        tmp_path,
        {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_keys_env": "TEST_JUDGE_KEYS",
         "rubric": ["x"]},
    )  # fmt: skip
    outcome, reward, error = classify(result, trial_dir)
    assert (outcome, reward) == (TrialOutcome.INFRA_ERROR, None)
    assert "'TEST_JUDGE_KEYS' is unset or empty" in error


def test_harbor_trial_without_a_response_scores_zero_without_calling_the_judge(
    judge_server, tmp_path, monkeypatch
) -> None:
    """No response file is the model's failure (reward 0, trained on), not an infra error."""
    monkeypatch.setenv("TEST_JUDGE_KEYS", ",".join(fresh_keys(1)))
    result, trial_dir, _ = run_trial(
        tmp_path,
        {"base_url": judge_server.url, "model": "judge-model", "api_keys_env": "TEST_JUDGE_KEYS",
         "rubric": ["x"], "response_path": "/logs/agent/no-such-file.txt"},
    )  # fmt: skip
    assert classify(result, trial_dir) == (TrialOutcome.OK, 0.0, None)
    assert judge_server.requests == []


def test_a_misspelt_verifier_kwarg_is_an_infra_error_naming_it(tmp_path, monkeypatch) -> None:
    """Harbor's BaseVerifier accepts and ignores unknown kwargs; ours must not."""
    monkeypatch.setenv("TEST_JUDGE_KEYS", "k")
    result, trial_dir, _ = run_trial(
        tmp_path,
        {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_keys_env": "TEST_JUDGE_KEYS",
         "rubric": ["x"], "max_atempts": 3},
    )  # fmt: skip
    outcome, _, error = classify(result, trial_dir)
    assert outcome is TrialOutcome.INFRA_ERROR
    assert "verifier.kwargs.max_atempts: unknown to LlmJudgeVerifier" in error


def test_trial_runner_config_selects_the_judge_verifier(
    judge_server, tmp_path, monkeypatch
) -> None:
    """`rollout.verifier_import_path` / `verifier_kwargs` reach Harbor's TrialConfig: the trial
    the runner builds (run here in-process, as its Ray task would) is graded by the judge."""
    from oneloop.agents.trials import TrialRunner, TrialRunnerConfig, run_one_trial

    monkeypatch.setenv("TEST_JUDGE_KEYS", ",".join(fresh_keys(1)))
    judge_server.script = []
    runner = TrialRunner(
        TrialRunnerConfig(
            trials_dir=tmp_path / "trials",
            agent_import_path=None,
            agent_name="oracle",
            environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
            verifier_import_path=IMPORT_PATH,
            verifier_kwargs={
                "base_url": judge_server.url, "model": "judge-model",
                "api_keys_env": "TEST_JUDGE_KEYS",
                "rubric": ["States the final number", "Shows the working"],
            },
        )
    )  # fmt: skip
    splits = generate_tasks(tmp_path / "tasks", n_train=1, n_eval=0, seed=5)
    spec = {**runner._spec_base, "task": str(splits.train[0].path)}
    result = asyncio.run(asyncio.wait_for(run_one_trial(spec, None), timeout=180))
    assert result.outcome is TrialOutcome.OK, result.error
    assert result.reward == 0.5  # the judge's default verdict: criterion 1 met, 2 not
    assert len(judge_server.requests) == 1
