"""Rewards from a service (``--reward-url``, ``--judge URL``): each test starts a real HTTP server on a local port
that answers posted batches as told, and checks what the reward function read back, what the server was sent,
and how a slow, dead or wrong service fails: retried where asking again can help, named in the error, and
handled by the run's reward_errors policy like a reward function that raises."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import posttrain
from posttrain.config import Config, ConfigError
from posttrain.data import remote
from posttrain.data.remote import RemoteReward, RemoteRewardError
from posttrain.data.scoring import RewardError, RewardPolicy, score
from posttrain.tracking.metrics import read_metrics
from posttrain.training.session import load_workload

Answer = Callable[[dict, int], tuple[int, str, float]]  # (request's JSON, its 1-based number) -> (status, body, delay)
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8="]
COMPLETIONS = ["3", "7", "11", "x"]


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "FIRST_BACKOFF_S", 0.01)


@contextlib.contextmanager
def service(answer: Answer) -> Iterator[tuple[str, list[dict]]]:
    """(the URL of a local server answering each POST with ``answer``, the JSON bodies it has been sent)."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            status, text, delay = answer(body, len(received))
            time.sleep(delay)
            payload = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.handle_error = lambda *args: None  # a client that gave up on a slow answer closed the connection
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score", received
    finally:
        server.shutdown()
        server.server_close()


def json_answer(scores: Callable[[dict], object], status: int = 200) -> Answer:
    return lambda body, number: (status, json.dumps(scores(body)), 0.0)


def closed_port_url() -> str:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/score"


def test_scores_as_a_list_with_the_batch_and_its_columns_sent_as_json():
    with service(json_answer(lambda body: [float(c == a) for c, a in zip(body["completions"], body["answer"])])) \
            as (url, received):
        reward = RemoteReward(url)
        scores = reward(PROMPTS, COMPLETIONS, answer=["3", "7", "12", "15"], level=[1, 2, 3, 4])
    assert scores == [1.0, 1.0, 0.0, 0.0]
    assert received == [{"prompts": PROMPTS, "completions": COMPLETIONS, "answer": ["3", "7", "12", "15"],
                         "level": [1, 2, 3, 4]}]
    assert reward.__name__ == f"{url.removeprefix('http://')}"  # logged as reward/127.0.0.1:PORT/score


def test_scores_as_an_object_with_nulls_for_does_not_apply_and_chat_messages_sent_as_they_are():
    chat_prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    chat_completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    with service(json_answer(lambda body: {"scores": [1, None, 0.5, None], "note": "ignored"})) as (url, received):
        assert RemoteReward(url)(chat_prompts, chat_completions) == [1.0, None, 0.5, None]
    assert received[0]["prompts"] == chat_prompts and received[0]["completions"] == chat_completions


def test_a_null_counts_as_a_python_reward_s_none_in_the_weighted_sum():
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    with service(json_answer(lambda body: [1, None, 0.5, None])) as (url, _):
        scores = score([length, RemoteReward(url)], [1.0, 2.0], PROMPTS, COMPLETIONS, {})
    # total = 1 * len + 2 * service where the service applies: [1 + 2, 1, 2 + 1, 1]
    assert scores.total.tolist() == [3.0, 1.0, 3.0, 1.0]
    service_term = scores.terms[f"{url.removeprefix('http://')}"].tolist()
    assert service_term[0::2] == [1.0, 0.5] and all(math.isnan(v) for v in service_term[1::2])


def test_a_column_json_cannot_carry_is_an_error_naming_it():
    with service(json_answer(lambda body: [0.0] * 4)) as (url, received):
        with pytest.raises(RemoteRewardError, match="the column 'when' cannot be sent as JSON"):
            RemoteReward(url)(PROMPTS, COMPLETIONS, answer=["3"] * 4, when=[object()] * 4)
        with pytest.raises(RemoteRewardError, match="the column 'weight' cannot be sent as JSON"):
            RemoteReward(url)(PROMPTS, COMPLETIONS, weight=[1.0, math.nan, 1.0, 1.0])
        with pytest.raises(RemoteRewardError, match="the dataset column 'rubric' has the name of a field"):
            RemoteReward(url, fields={"rubric": "Grade it."})(PROMPTS, COMPLETIONS, rubric=["mine"] * 4)
    assert received == []  # nothing was posted


def test_a_slow_service_is_retried_then_fails_naming_the_url_and_the_timeout():
    with service(lambda body, number: (200, "[0, 0, 0, 0]", 0.5)) as (url, received):
        start = time.perf_counter()
        with pytest.raises(RemoteRewardError) as error:
            RemoteReward(url, timeout=0.1, retries=1)(PROMPTS, COMPLETIONS)
        seconds = time.perf_counter() - start
    assert str(error.value) == (f"{url} did not answer within 0.1 s (reward_url_timeout); tried 2 times "
                                "(reward_url_retries)")
    assert len(received) == 2 and seconds < 0.45  # each try gave up at its timeout, not at the slow answer


def test_a_dead_service_is_retried_then_fails_naming_the_url():
    url = closed_port_url()
    with pytest.raises(RemoteRewardError, match=r"could not be reached \(.*refused.*\); tried 3 times"):
        RemoteReward(url, retries=2)(PROMPTS, COMPLETIONS)


def test_a_5xx_is_retried_and_the_answer_after_it_counts():
    def flaky(body, number):
        return (503, "warming up", 0.0) if number == 1 else (200, "[1, 2, 3, 4]", 0.0)

    with service(flaky) as (url, received):
        assert RemoteReward(url, retries=1)(PROMPTS, COMPLETIONS) == [1.0, 2.0, 3.0, 4.0]
    assert len(received) == 2
    with service(lambda body, number: (500, "boom", 0.0)) as (url, received):
        with pytest.raises(RemoteRewardError, match="answered 500 Internal Server Error: 'boom'; tried 2 times"):
            RemoteReward(url, retries=1)(PROMPTS, COMPLETIONS)
    assert len(received) == 2


@pytest.mark.parametrize("status, body, problem", [
    (200, "[1, 2, 3]", "answered 200 with 3 scores for 4 completions"),
    (200, "great job", "answered 200 with text, not JSON: 'great job'"),
    (200, '{"score": [1, 2, 3, 4]}', "answered 200 with '{\"score\": [1, 2, 3, 4]}'"),
    (200, '[1, "high", 0, 0]', "answered 200 with score 1 = \"high\"; each score is a number, or null"),
    (200, "[1, true, 0, 0]", "answered 200 with score 1 = true"),
    (422, '{"detail": "no answer column"}', "answered 422 Unprocessable Entity: '{\"detail\": \"no answer column\"}'"),
])
def test_an_answer_that_is_not_scores_fails_at_once_naming_the_url_the_status_and_the_problem(status, body, problem):
    with service(lambda request, number: (status, body, 0.0)) as (url, received):
        with pytest.raises(RemoteRewardError) as error:
            RemoteReward(url, retries=2)(PROMPTS, COMPLETIONS)
    assert str(error.value).startswith(f"{url} {problem}")
    assert len(received) == 1  # asking again would get the same answer


def test_the_reward_errors_policy_handles_a_failed_service_once_per_batch():
    with service(lambda request, number: (200, "[1]", 0.0)) as (url, received):
        reward = RemoteReward(url, retries=0)
        skipped = score([reward], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(on_error="skip"))
        assert skipped.failed.tolist() == [True] * 4 and skipped.failures == {reward.__name__: 4}
        assert len(received) == 1  # not asked again sample by sample
        with pytest.raises(RewardError, match=f"failed on the batch of 4:\n(.|\n)*{url} answered 200 with 1 scores"):
            score([reward], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(on_error="error"))
    with pytest.raises(RewardError, match="could not be reached"):  # in a forked worker (reward_timeout) too
        score([RemoteReward(closed_port_url(), retries=0)], [1.0], PROMPTS, COMPLETIONS, {},
              RewardPolicy(timeout=10.0, on_error="error"))


def test_reward_url_settings_are_checked_where_the_config_is_built():
    with pytest.raises(ConfigError) as error:
        Config.from_flat({"reward_url": ["127.0.0.1:8000", "http://a/score", "http://a/score"],
                          "reward_url_timeout": 0, "reward_url_retries": -1})
    assert error.value.problems == [
        "reward_url: got '127.0.0.1:8000'; give the service's URL, e.g. http://127.0.0.1:8000/score",
        "reward_url: a service is named twice; name each once",
        "reward_url_timeout: got 0; use seconds > 0",
        "reward_url_retries: got -1; use 0 or more",
    ]


def test_a_judge_service_is_sent_the_batch_and_the_rubric(tmp_path):
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Score {completion} as an answer to {prompt}, from {low} to {high}.")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(PROMPTS, "3 7 11".split())))
    with service(json_answer(lambda body: [0.25 * len(c) for c in body["completions"]])) as (url, received):
        config = Config.from_flat({"dataset": str(dataset), "judge": url, "judge_rubric": str(rubric),
                                   "judge_weight": 0.5, "max_new_tokens": 4})
        work = load_workload(config)
        judge, = work.reward_fns
        assert (judge.__name__, work.reward_weights) == ("judge", [0.5])
        assert judge(PROMPTS[:2], ["3", "77"], answer=["3", "7"]) == [0.25, 0.5]
    assert received == [{"prompts": PROMPTS[:2], "completions": ["3", "77"], "answer": ["3", "7"],
                         "rubric": rubric.read_text()}]


def test_reward_urls_are_a_dataset_run_s_rewards_beside_its_functions(tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    config = Config.from_flat({"dataset": str(dataset), "reward": ["numeric_match"], "reward_weights": [2.0],
                               "reward_url": ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"], "max_new_tokens": 4})
    work = load_workload(config)
    assert [fn.__name__ for fn in work.reward_fns] == ["numeric_match", "127.0.0.1:9/a", "127.0.0.1:9/b"]
    assert work.reward_weights == [2.0, 1.0, 1.0]
    alone = load_workload(Config.from_flat({"dataset": str(dataset), "reward_url": ["http://127.0.0.1:9/a"],
                                            "max_new_tokens": 4}))
    assert [fn.__name__ for fn in alone.reward_fns] == ["127.0.0.1:9/a"]


def test_a_grpo_run_trains_on_a_service_s_rewards(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1)]]

    def sevens(body):  # the share of 7s in each completion
        return [c.count("7") / max(len(c), 1) for c in body["completions"]]

    with service(json_answer(sevens)) as (url, received):
        result = posttrain.train(model=str(tiny_model_dir), algorithm="grpo", train_dataset=rows,
                                 eval_dataset=rows[:4], reward_url=[url], output=str(tmp_path / "run"),
                                 max_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_size=4,
                                 report_to="none", progress=False, eval_every=0, save_every=0)
    assert [len(body["completions"]) for body in received] == [4, 8, 8, 4]  # held-out, 2 steps of 2 x 4, held-out
    answers = {row["prompt"]: row["answer"] for row in rows}
    for body in received:
        assert set(body) == {"prompts", "completions", "answer"}
        assert body["answer"] == [answers[prompt] for prompt in body["prompts"]]
    name = f"reward/{url.removeprefix('http://')}"
    logged = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    step_scores = [sevens(body) for body in received[1:3]]
    assert [row[name] for row in logged] == pytest.approx([sum(s) / len(s) for s in step_scores])
