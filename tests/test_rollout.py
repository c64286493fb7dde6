"""`pulsesync.integrations.rollout` against odd engine replies, and the TRL adapter's plumbing.

The real loop runs in tests/test_grpo_loop.py (`-m engine`). Here an HTTP server on 127.0.0.1
answers as vLLM 0.32's OpenAI server does (`CompletionResponse`: `choices[].index`, `token_ids`
with `return_token_ids`, `logprobs.token_logprobs`; `GET /weight_info`'s `{"weight_version": ...}`:
vllm/entrypoints/openai/completion/protocol.py and rl/online/api_router.py), then breaks one reply
at a time: every odd reply is an EngineError or a PolicyLagError, never a crash or a label.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from pulsesync.errors import EngineError, PolicyLagError
from pulsesync.integrations.rollout import RolloutClient

Reply = Callable[[dict[str, Any]], web.Response]


class Engine:
    """The engine's weight version, each /v1/completions body seen, and replies to break on cue."""

    def __init__(self) -> None:
        self.version: object = "pulsesync:4:d4"
        self.bodies: list[dict[str, Any]] = []
        self.completions: Reply | None = None  # None: a well-formed reply

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if request.path == "/weight_info":
            return web.json_response({"weight_version": self.version})
        self.bodies.append(body)
        if self.completions is not None:
            return self.completions(body)
        choices = [
            {"index": i, "text": "", "token_ids": [7, 8, 9], "logprobs": {"token_logprobs": [-0.5, -1.25, -2.0]}}
            for i in range(body["n"])
        ]
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": choices})


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    state = Engine()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", state.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield state, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_repeated_prompts_share_a_request_and_every_completion_is_tagged(engine: tuple[Engine, str]) -> None:
    state, url = engine
    batch = await RolloutClient(url, max_lag=1, sampling={"max_tokens": 3}).generate([[1, 2]] * 3 + [[5]] * 2, 5)
    assert [(b["prompt"], b["n"], b["model"], b["max_tokens"]) for b in state.bodies] == [
        ([1, 2], 3, "tiny", 3),
        ([5], 2, "tiny", 3),
    ]
    assert [c.prompt_ids for c in batch.completions] == [[1, 2]] * 3 + [[5]] * 2
    assert {c.step for c in batch.completions} == {4} and batch.lag == 1 and batch.attempts == 1
    assert batch.requests == state.bodies and len({b["seed"] for b in state.bodies}) == 2


@pytest.mark.parametrize(
    "reply",
    [
        lambda b: web.Response(status=500, body=b"\xff\xfe boom"),
        lambda b: web.Response(status=200, body=b"\xff\xfe\xfd"),
        lambda b: web.json_response({"choices": []}),
        lambda b: web.json_response({"choices": "many"}),
        lambda b: web.json_response(
            {
                "choices": [
                    {"index": i, "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}} for i in range(b["n"])
                ]
            }
        ),
        lambda b: web.json_response(
            {
                "choices": [
                    {"index": i, "token_ids": ["a"], "logprobs": {"token_logprobs": [-1.0]}} for i in range(b["n"])
                ]
            }
        ),
        lambda b: web.json_response(
            {"choices": [{"index": i, "token_ids": [1], "logprobs": {"token_logprobs": ["x"]}} for i in range(b["n"])]}
        ),
        lambda b: web.json_response({"choices": [{"index": 0, "token_ids": [1], "logprobs": None}] * b["n"]}),
    ],
    ids=[
        "500-binary",
        "200-binary",
        "no-choices",
        "choices-not-a-list",
        "lengths",
        "token-not-int",
        "logprob-str",
        "no-logprobs",
    ],
)
async def test_an_odd_completions_reply_is_an_engine_error(engine: tuple[Engine, str], reply: Reply) -> None:
    state, url = engine
    state.completions = reply
    with pytest.raises(EngineError, match=r"rollout: |HTTP 500"):
        await RolloutClient(url, max_lag=1).generate([[1, 2]] * 2, 5)


@pytest.mark.parametrize(
    "version",
    ["default", "someone-else:4:d4", "pulsesync:4", "pulsesync:-4:d4", "pulsesync:4:d4 ", 4, None, "pulsesync:" * 40],
    ids=["default", "another-writer", "truncated", "negative", "trailing", "int", "null", "oversized"],
)
async def test_an_engine_that_holds_no_known_step_is_waited_for_then_a_lag_error(
    engine: tuple[Engine, str], version: object
) -> None:
    state, url = engine
    state.version = version
    with pytest.raises(PolicyLagError, match=r"holds no verified step after 0\.3s; the trainer is at step 5"):
        await RolloutClient(url, max_lag=3, lag_timeout_seconds=0.3, poll_seconds=0.05).generate([[1]], 5)
    assert state.bodies == []  # nothing generated on an unknown policy


async def test_a_batch_whose_policy_changes_every_time_gives_up_with_an_engine_error(
    engine: tuple[Engine, str],
) -> None:
    state, url = engine

    def moving(body: dict[str, Any]) -> web.Response:
        step = int(str(state.version).split(":")[1]) + 1
        state.version = f"pulsesync:{step}:d{step}"  # an update lands during every attempt
        return web.json_response({"choices": [{"index": 0, "token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}]})

    state.completions = moving
    with pytest.raises(EngineError, match="changed its policy during each of 3 attempts"):
        await RolloutClient(url, max_lag=10, attempts=3).generate([[1]], 10)
    assert len(state.bodies) == 3


def test_the_trl_adapter_samples_as_the_trainer_is_configured() -> None:
    trl = pytest.importorskip("trl")
    from pulsesync.integrations.trl import sampling_of

    args = trl.GRPOConfig(
        output_dir="unused", use_cpu=True, max_completion_length=17, temperature=0.7, top_p=0.9, top_k=0
    )
    assert sampling_of(args) == {
        "max_tokens": 17,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "repetition_penalty": 1.0,
    }
    more = sampling_of(trl.GRPOConfig(output_dir="unused", use_cpu=True, top_k=5, min_p=0.1))
    assert (more["top_k"], more["min_p"]) == (5, 0.1)


async def test_a_batch_an_aborting_update_failed_is_generated_again_on_the_new_step(
    engine: tuple[Engine, str],
) -> None:
    """`pause_mode: abort` fails the running requests of an update; that batch is retried, not an error."""
    state, url = engine

    def aborted_by_an_update(body: dict[str, Any]) -> web.Response:
        state.version = "pulsesync:5:d5"
        state.completions = None  # the retry gets a well-formed reply
        return web.Response(status=500, text='{"error": "request aborted"}')

    state.completions = aborted_by_an_update
    batch = await RolloutClient(url, max_lag=1).generate([[1]], 5)
    assert (batch.policy.step, batch.attempts, len(state.bodies)) == (5, 2, 2)
