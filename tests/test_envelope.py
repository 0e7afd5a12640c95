"""Envelope immutability, secrecy, binding to contexts, and the child-process environment."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Dict, List

import pytest

import pipelines_port as pp

SECRET = "tok-very-secret-7f3a"


def make(**body: Any) -> pp.Envelope:
    payload: Dict[str, Any] = {
        "odyssey_proxy_url": "https://api.example.com/api/odyssey-proxy/runs/abc",
        "run_id": 17, "task_id": 42, "agent_id": 8, "run_token_jti": "jti-1",
        "input": {"user_instruction": "Refund #4521", "input": {"order": {"id": "4521", "tags": ["a"]}}},
        "tools_schema": [{"name": "get_order"}],
    }
    payload.update(body)
    return pp.Envelope.from_dispatch(payload, {"X-Pipelines-Run-Token": SECRET})


def test_envelope_is_read_only_all_the_way_down() -> None:
    env = make()
    with pytest.raises(AttributeError):
        env.run_token = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del env.proxy_url
    with pytest.raises(TypeError):
        env.task_input["order"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        env.task_input["order"]["tags"].append("b")
    with pytest.raises(TypeError):
        env.raw["input"].update({"x": 1})
    with pytest.raises(TypeError):
        env.tools_schema.append({"name": "x"})  # type: ignore[union-attr]
    assert env.task_input == {"order": {"id": "4521", "tags": ["a"]}}


def test_envelope_does_not_alias_the_callers_body() -> None:
    body = {"odyssey_proxy_url": "https://p.example.com/x", "input": {"input": {"k": [1]}}}
    env = pp.Envelope.from_dispatch(body, {"X-Pipelines-Run-Token": SECRET})
    body["input"]["input"]["k"].append(2)
    assert env.task_input == {"k": [1]}


def test_frozen_data_still_behaves_as_json() -> None:
    env = make()
    assert isinstance(env.task_input, dict) and isinstance(env.task_input["order"]["tags"], list)
    assert json.loads(json.dumps(env.raw))["input"]["input"]["order"]["id"] == "4521"
    mutable = copy.deepcopy(env.task_input)
    mutable["order"]["tags"].append("b")  # a deep copy is an ordinary, mutable dict
    assert type(mutable) is dict and mutable["order"]["tags"] == ["a", "b"]
    assert dict(env.task_input) == env.task_input


def test_repr_and_str_never_show_the_run_token() -> None:
    env = make()
    for text in (repr(env), str(env), f"{env}", repr([env]), repr({"e": env})):
        assert SECRET not in text
        assert "17" in text  # ids are safe to show
    assert env.run_token == SECRET


def test_pickle_and_replace_round_trip() -> None:
    env = make()
    again = pickle.loads(pickle.dumps(env))
    assert again == env and again.run_token == SECRET
    changed = env.replace(run_id=99)
    assert changed.run_id == 99 and env.run_id == 17 and changed.task_input == env.task_input
    with pytest.raises(TypeError):
        env.replace(no_such_field=1)
    with pytest.raises(pp.EnvelopeError):
        env.replace(proxy_url="file:///etc/passwd")


def test_unknown_fields_are_kept_in_raw() -> None:
    env = make(brand_new={"x": [1, 2]})
    assert env.raw["brand_new"] == {"x": [1, 2]}


def test_error_messages_never_contain_the_token() -> None:
    with pytest.raises(pp.EnvelopeError) as info:
        pp.Envelope.from_dispatch({}, {"X-Pipelines-Run-Token": SECRET})
    assert SECRET not in str(info.value)
    with pytest.raises(pp.EnvelopeError) as info:
        pp.Envelope.from_dispatch({"odyssey_proxy_url": "https://p/x"}, {"X-Pipelines-Run-Token": SECRET + "\x01"})
    assert SECRET not in str(info.value) and "control" in str(info.value)


def test_headers_as_pairs_bytes_and_messages() -> None:
    import email.message

    msg = email.message.Message()
    msg["X-Pipelines-Run-Token"] = SECRET
    for headers in (
        [(b"x-pipelines-run-token", SECRET.encode())],
        [("X-Pipelines-Run-Token", SECRET)],
        msg,
    ):
        env = pp.Envelope.from_dispatch({"odyssey_proxy_url": "https://p.example.com/x"}, headers)
        assert env.run_token == SECRET


# -- binding -------------------------------------------------------------------------


def test_current_envelope_needs_a_binding() -> None:
    with pytest.raises(pp.EnvelopeError) as info:
        pp.current_envelope()
    assert "bind_envelope" in str(info.value)
    env = make()
    with pp.bind_envelope(env):
        assert pp.current_envelope() is env
        with pp.bind_envelope(env.replace(run_id=2)) as inner:
            assert pp.current_envelope() is inner
        assert pp.current_envelope() is env
    with pytest.raises(pp.EnvelopeError):
        pp.current_envelope()


def test_bind_rejects_non_envelopes() -> None:
    with pytest.raises(TypeError):
        with pp.bind_envelope({"run_token": "x"}):  # type: ignore[arg-type]
            pass


def test_threads_never_see_each_others_envelope() -> None:
    barrier = threading.Barrier(50)
    seen: Dict[int, List[Any]] = {}

    def worker(i: int) -> None:
        env = make(run_id=i)
        with pp.bind_envelope(env):
            barrier.wait()  # every thread is bound at the same moment
            seen[i] = [pp.current_envelope().run_id for _ in range(200)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(values == [i] * 200 for i, values in seen.items()) and len(seen) == 50


def test_asyncio_tasks_never_see_each_others_envelope() -> None:
    async def one(i: int) -> List[Any]:
        with pp.bind_envelope(make(run_id=i)):
            out = []
            for _ in range(20):
                await asyncio.sleep(0)
                out.append(pp.current_envelope().run_id)
            return out

    async def main() -> List[List[Any]]:
        return await asyncio.gather(*(one(i) for i in range(50)))

    results = asyncio.run(main())
    assert results == [[i] * 20 for i in range(50)]


def test_a_fresh_thread_does_not_inherit_the_binding() -> None:
    seen: List[Any] = []
    with pp.bind_envelope(make()):
        t = threading.Thread(target=lambda: seen.append(pp._current.get()))
        t.start()
        t.join()
    assert seen == [None]


# -- child-process environment (§5) -----------------------------------------------------


def test_child_env_carries_the_run_without_touching_os_environ() -> None:
    before = dict(os.environ)
    env = make()
    child = env.child_env()
    assert dict(os.environ) == before
    assert child["PIPELINES_RUN_TOKEN"] == SECRET
    assert child["PIPELINES_ODYSSEY_PROXY_URL"] == env.proxy_url
    assert child["PIPELINES_API_URL"] == "https://api.example.com"
    assert child["PIPELINES_RUN_ID"] == "17" and child["PIPELINES_TASK_ID"] == "42"
    # A child process rebuilds the same envelope from it.
    code = (
        "import json, pipelines_port as pp; e = pp.Envelope.from_env();"
        "print(json.dumps([e.user_instruction, e.task_input, e.task_id, e.run_token == %r, e.tools_schema]))" % SECRET
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(child, PYTHONPATH=os.getcwd()), capture_output=True, text=True,
        timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["Refund #4521", {"order": {"id": "4521", "tags": ["a"]}}, 42, True,
                                      [{"name": "get_order"}]]


def test_child_env_of_two_runs_are_independent() -> None:
    a, b = make(run_id=1), make(run_id=2).replace(run_token="tok-b")
    base = {"PATH": "/usr/bin"}
    env_a, env_b = a.child_env(base), b.child_env(base)
    assert env_a["PIPELINES_RUN_TOKEN"] == SECRET and env_b["PIPELINES_RUN_TOKEN"] == "tok-b"
    assert env_a["PIPELINES_RUN_ID"] == "1" and env_b["PIPELINES_RUN_ID"] == "2"
    assert base == {"PATH": "/usr/bin"}


def test_conversation_builds_the_turn_from_history_prompt_and_task_input() -> None:
    first = make()  # one turn: the instruction, with the task input as JSON
    (turn,) = first.conversation()
    assert turn["role"] == "user" and turn["content"].startswith("Refund #4521\n\nTask input:\n")
    assert json.loads(turn["content"].split("Task input:\n", 1)[1]) == {"order": {"id": "4521", "tags": ["a"]}}
    later = pp.Envelope.from_dispatch({
        "odyssey_proxy_url": "https://p.example.com/x",
        "input": {"user_instruction": "Refund #4521", "latest_user_prompt": "and the other one?",
                  "session_id": 5, "turn_id": "5-t1", "input": {"k": 1},
                  "messages": [{"role": "user", "content": "Refund #4521"}, {"role": "assistant", "content": "Done."},
                               {"role": "tool", "content": "skipped"}, {"role": "assistant", "content": None},
                               "junk", {"role": "user", "content": "   "}]}},
        {"X-Pipelines-Run-Token": SECRET})
    assert later.conversation() == [{"role": "user", "content": "Refund #4521"},
                                    {"role": "assistant", "content": "Done."},
                                    {"role": "user", "content": "and the other one?"}]
    repeated = later.replace(messages=[{"role": "user", "content": "and the other one?"}])
    assert repeated.conversation() == [{"role": "user", "content": "and the other one?"}]  # not doubled
    assert make(input={}).conversation() == [{"role": "user", "content": "(no instruction given)"}]
