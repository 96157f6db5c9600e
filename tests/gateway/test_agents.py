"""An agent framework (openai-agents, over its Chat Completions model) runs a two-tool loop
against a live ``agentgate serve``: the model calls ``get_weather``, the SDK runs it and sends the
result back, the model calls ``convert`` with arguments that satisfy its schema, the run stops
there. The demo model is random, so ``tool_choice="required"`` (grammar-constrained in the
engine) makes the calls valid, and each tool is enabled only on its own turn, so the loop is
deterministic whatever the weights."""

import asyncio
from typing import Annotated, Any, Literal

import pytest

pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    StopAtTools,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI  # noqa: E402
from pydantic import Field  # noqa: E402

from tests.gateway.live import LiveGateway  # noqa: E402


@pytest.fixture(scope="module")
def gateway(native_gateway: LiveGateway) -> LiveGateway:
    return native_gateway


def test_two_tool_loop(gateway: LiveGateway) -> None:
    set_tracing_disabled(True)  # NOTE: no trace export: nothing may leave 127.0.0.1
    calls: list[tuple[str, dict[str, Any]]] = []

    def only_before_weather(ctx: RunContextWrapper[Any], agent: Any) -> bool:
        return not any(name == "get_weather" for name, _ in calls)

    def only_after_weather(ctx: RunContextWrapper[Any], agent: Any) -> bool:
        return not only_before_weather(ctx, agent)

    @function_tool(is_enabled=only_before_weather)
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city, in Celsius."""
        calls.append(("get_weather", {"city": city}))
        return f"{city}: 21 C, sunny"

    @function_tool(is_enabled=only_after_weather)
    def convert(celsius: float, to: Literal["F", "K"]) -> str:
        """Convert a Celsius temperature; `to` is "F" or "K"."""
        calls.append(("convert", {"celsius": celsius, "to": to}))
        return f"{celsius * 9 / 5 + 32:.1f} F"

    client = AsyncOpenAI(base_url=gateway.api_url, api_key="sk-agents", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the tools.",
        model=OpenAIChatCompletionsModel(model="demo", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0.7,
                                     extra_args={"seed": 11}),
        tools=[get_weather, convert],
        tool_use_behavior=StopAtTools(stop_at_tool_names=["convert"]),
        reset_tool_choice=False,
    )

    async def run() -> Any:
        try:
            return await Runner.run(agent, "How warm is it in Paris, in Fahrenheit?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert [name for name, _ in calls] == ["get_weather", "convert"], calls
    assert isinstance(calls[0][1]["city"], str) and len(calls[0][1]["city"]) <= 12
    assert isinstance(calls[1][1]["celsius"], float) and calls[1][1]["to"] in ("F", "K")
    assert result.final_output == f"{calls[1][1]['celsius'] * 9 / 5 + 32:.1f} F"
