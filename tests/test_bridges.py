"""Framework bridges that need no framework: an Anthropic Messages conversation (plain dicts, the API's own
shape) as the response envelope, and clear errors for objects no bridge knows.  The bridges against the real
frameworks are tests/interop/test_frameworks.py."""

from __future__ import annotations

import pytest

import pipelines_port as pp

CONVERSATION = [
    {"role": "user", "content": "Refund order 4521, it arrived damaged."},
    {"role": "assistant", "model": "claude-test", "usage": {"input_tokens": 120, "output_tokens": 30},
     "content": [{"type": "thinking", "thinking": "Look it up first.", "signature": "sig"},
                 {"type": "text", "text": "Let me check."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_order", "input": {"order_id": "4521"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": [{"type": "text", "text": '{"status": "shipped"}'}]}]},
    {"role": "assistant", "model": "claude-test", "usage": {"input_tokens": 200, "output_tokens": 12},
     "content": [{"type": "text", "text": "Order 4521 has shipped; refunding it."}]},
]


def test_an_anthropic_conversation_becomes_the_response_envelope() -> None:
    body = pp.response_from(CONVERSATION)
    assert pp.validate_response(body) == []
    assert body["final_response"] == "Order 4521 has shipped; refunding it."
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    call = body["messages"][1]
    assert call["tool_calls"] == [{"id": "toolu_1", "name": "get_order", "arguments": {"order_id": "4521"}}]
    assert call["content"] == "Let me check." and call["thinking"] == [{"type": "thinking",
                                                                        "text": "Look it up first."}]
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": '{"status": "shipped"}'}
    assert body["metadata"] == {"total_input_tokens": 320, "total_output_tokens": 42, "model": "claude-test"}


def test_overrides_win_and_other_values_go_to_build_response() -> None:
    body = pp.response_from(CONVERSATION, metadata={"model": "mine"})
    assert body["metadata"] == {"model": "mine"}
    assert pp.response_from("plain answer") == {"final_response": "plain answer"}
    assert pp.response_from({"final_response": "ok", "extra": 1})["final_response"] == "ok"


def _agents_run(part: object, raw_response: object) -> object:
    """An OpenAI Agents ``RunResult`` as the bridge reads it: attributes, with the raw items' parts inside."""
    from types import SimpleNamespace as NS

    message = NS(type="message_output_item", raw_item=NS(content=[part]))
    return NS(input="Where is order 4521?", new_items=[message], final_output="It has shipped.",
              last_agent=NS(model="gpt-test"), raw_responses=[raw_response])


def test_an_openai_agents_run_reads_text_parts_and_usage_as_objects_or_dicts() -> None:
    from types import SimpleNamespace as NS

    usage = {"input_tokens": 11, "output_tokens": 4}
    as_objects = pp.response_from(_agents_run(NS(type="output_text", text="It has shipped."), NS(usage=NS(**usage))))
    as_dicts = pp.response_from(_agents_run({"type": "output_text", "text": "It has shipped."}, {"usage": usage}))
    assert as_objects == as_dicts
    assert as_dicts["messages"] == [{"role": "user", "content": "Where is order 4521?"},
                                    {"role": "assistant", "content": "It has shipped."}]
    assert as_dicts["metadata"] == {"total_input_tokens": 11, "total_output_tokens": 4, "model": "gpt-test"}


LANGCHAIN_DUMPED = [  # LangChain messages as their model_dump() gives them
    {"type": "human", "content": "Where is order 4521?"},
    {"type": "ai", "content": [{"type": "thinking", "thinking": "Look it up."}, {"type": "text", "text": ""}],
     "tool_calls": [{"id": "call_1", "name": "get_order", "args": {"order_id": "4521"}}],
     "usage_metadata": {"input_tokens": 50, "output_tokens": 9}, "response_metadata": {"model_name": "lc-test"}},
    {"type": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
]


def test_langchain_messages_read_by_the_one_reader_as_objects_dicts_or_mixed_with_anthropic_ones() -> None:
    class Message:  # a LangChain message object: read through its model_dump()
        def __init__(self, dumped: dict) -> None:
            self.dumped = dumped

        def model_dump(self) -> dict:
            return dict(self.dumped)

    final = {"role": "assistant", "model": "claude-test", "content": [{"type": "text", "text": "It has shipped."}]}
    as_dicts = pp.response_from([*LANGCHAIN_DUMPED, final])
    as_objects = pp.response_from({"messages": [*map(Message, LANGCHAIN_DUMPED), final]})
    assert as_dicts == as_objects
    assert pp.validate_response(as_dicts) == []
    assert as_dicts["final_response"] == "It has shipped."
    assert as_dicts["messages"] == [
        {"role": "user", "content": "Where is order 4521?"},
        {"role": "assistant", "content": None, "thinking": [{"type": "text", "text": "Look it up."}],
         "tool_calls": [{"id": "call_1", "name": "get_order", "arguments": {"order_id": "4521"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
        {"role": "assistant", "content": "It has shipped."}]
    assert as_dicts["metadata"] == {"total_input_tokens": 50, "total_output_tokens": 9, "model": "claude-test"}


def test_objects_no_bridge_knows_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="not a tool this module knows"):
        pp.tools_schema_from([object()])
    with pytest.raises(TypeError, match="cannot proxy"):
        pp.proxied_tools([{"name": "get_order"}])
    with pytest.raises(TypeError, match="list of tools or an agent"):
        pp.tools_schema_from(42)
    assert pp.tools_schema_from([{"name": "get_order", "parameters": {"type": "object"}}])[0]["name"] == "get_order"


def test_handoffs_post_each_transfer_once_and_never_end_the_run() -> None:
    from conformance.harness.mock_proxy import MockProxy

    token = "handoffs-run-token-0123456789"
    with MockProxy(tokens=[token]) as proxy:
        envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url, run_token=token)
        handoffs = pp.Handoffs(envelope=envelope)
        for label in ("triage", "triage", "refunds", " refunds ", "triage"):
            handoffs.enter(label)
        proxy.script("handoff", [{"status": 500, "error_class": "internal", "message": "down"}])
        handoffs.enter("billing")  # a failed post is logged, not raised: tracing never ends a run
        moves = [(r.json["from_sub_agent"], r.json["to_sub_agent"]) for r in proxy.calls(kind="traces")]
    assert moves == [("triage", "refunds"), ("refunds", "triage"), ("triage", "billing")]
    assert handoffs.current == "billing"
    with pytest.raises(pp.ProxyRequestError):
        handoffs.enter("a//b")  # a malformed label is the caller's mistake, said at once
