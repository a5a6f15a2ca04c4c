"""Chat templates for the models whet builds: Jinja, as ``tokenizer.apply_chat_template`` runs them.

:data:`CHAT_TEMPLATE` is Qwen2.5's, less its default system text; it renders exactly what
``whet.learner.prompt.render_chatml`` renders. :data:`COMPACT_CHAT_TEMPLATE` is ChatML with a
short tool list, for small models.
"""

from __future__ import annotations

# Qwen2.5's template, less its default "You are Qwen" system text.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments' }}
    {{- ' within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# For small models: ChatML like Qwen2.5, but the tool list is one line per tool, "- name(arg, arg)",
# instead of full JSON schemas (~100 tokens instead of ~2,300 for the bundled servers: less to read,
# and training sequences twenty times shorter), and it comes before the system text, so the lessons
# at the end of the system text sit right above the user's message. Tool calls and results are Qwen2.5's.
COMPACT_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n# Tools' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {%- set props = fn.parameters.properties if fn.parameters is defined and fn.parameters.properties is defined else {} %}
        {%- set about = (fn.description or '').strip().split('\n')[0].split('. ')[0].rstrip('.') %}
        {{- '\n- ' + fn.name + '(' + (props | list | join(', ')) + ')' }}
        {%- if about %}{{- ': ' + (about | truncate(100, true, '')) }}{%- endif %}
    {%- endfor %}
    {{- '\nCall a tool as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- '\n\n' + messages[0].content }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
""" + CHAT_TEMPLATE[CHAT_TEMPLATE.index("{%- elif messages and messages[0].role == 'system' %}"):]
