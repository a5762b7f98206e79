"""libdflash.chat_tools: the binding of dflash_chat_tools_typescript (the byte-exact
comparison with Moonshot's converter is tests/chat/test_tools_ts.py)."""
import pytest

import libdflash
from libdflash.chat_tools import tools_typescript

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "city": {"type": "string", "description": "City name"}}}}}]


def test_declaration():
    assert tools_typescript(WEATHER) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "// Weather for a city.\n"
        "type get_weather = (_: {\n"
        "  // City name\n"
        "  city: string,\n"
        "  // Default: \"c\"\n"
        "  unit?: \"c\" | \"f\"\n"
        "}) => any;\n}\n")


def test_json_text_and_no_function_tools():
    assert tools_typescript('[{"type": "_plugin", "function": {"name": "x"}}]') == ""
    assert tools_typescript("[]") == ""


def test_large_output_grows_buffer():
    desc = "d" * 20000
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": desc}}
             for i in range(3)]
    assert tools_typescript(tools).count(desc) == 3


def test_errors():
    with pytest.raises(libdflash.Error) as e:
        tools_typescript([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "x": {"$ref": "#/definitions/X"}}}}}])
    assert e.value.status == "DFLASH_E_FORMAT"
    assert "tools[0] (function f)" in e.value.message
    assert "parameters.properties.x" in e.value.message
    with pytest.raises(libdflash.Error) as e:
        tools_typescript([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "x": {"enum": [[1, 2], "a"]}}}}}])
    assert e.value.status == "DFLASH_E_UNSUPPORTED"
    with pytest.raises(libdflash.Error) as e:
        tools_typescript('{"not": "a list"}')
    assert e.value.status == "DFLASH_E_FORMAT"
