"""The tiny model's chat templates: a simplified Qwen3/Hermes ChatML template, two tool-list styles.

Both styles take `tools`, roles system/user/assistant/tool and OpenAI-shaped assistant `tool_calls`,
and both have the model answer in the same Hermes form (`<tool_call>{"name": .., "arguments": ..}
</tool_call>`), so the agent's parser, the TITO accounting and the renderer do not change. They
differ only in how the system turn lists the tools:

* `json` (the default): every tool as its JSON schema, one per line inside `<tools></tools>`, with
  Qwen3's instructions around it, as real Qwen3 checkpoints render them;
* `compact`: one line per tool, `name(arg, ...): description`, and a one-line reminder of the call
  form. Written for the CPU demo: the JSON form of the calculator's five tools is ~530 tokens, which
  made 85 % of every demo prompt; the compact form of the same tools is ~60.
"""

TOOL_LIST_STYLES = ("json", "compact")

_JSON_TOOLS = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
"""

_COMPACT_TOOLS = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '<tools>' }}
    {%- for tool in tools %}
        {%- set f = tool.function if tool.function is defined else tool %}
        {%- set props = (f.parameters.properties if f.parameters is defined else {}) or {} %}
        {{- '\\n' + f.name + '(' + (props | list | join(', ')) + '): ' + (f.description or '') }}
    {%- endfor %}
    {{- '\\n</tools>\\nCall a tool as <tool_call>\\n{"name": <name>, "arguments": {...}}\\n' }}
    {{- '</tool_call><|im_end|>\\n' }}
"""

_MESSAGES = """\
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if not loop.first or content %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif not (message.role == 'system' and loop.first) %}
        {{- raise_exception('unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def chat_template(tool_list: str = "json") -> str:
    """The Jinja chat template with tools listed in style `tool_list` (module docstring)."""
    if tool_list not in TOOL_LIST_STYLES:
        raise ValueError(f"tool_list: expected one of {TOOL_LIST_STYLES}, got {tool_list!r}")
    return (_JSON_TOOLS if tool_list == "json" else _COMPACT_TOOLS) + _MESSAGES


CHAT_TEMPLATE = chat_template("json")
"""The default template (JSON tool list)."""
