"""The chat template of the made models: Qwen3's conventions, written out so nothing is downloaded.

What it must do for the stack's probes and vLLM's parsers (`--reasoning-parser qwen3`,
`--tool-call-parser hermes`):
* tools go into the system turn inside <tools></tools>, one JSON object a line;
* an assistant turn's tool calls are `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`,
  and consecutive `tool` messages are answered in one user turn of <tool_response> blocks;
* an earlier assistant turn's reasoning (`reasoning_content`, or `reasoning`) is shown in
  <think></think> before its answer;
* thinking off (`enable_thinking=false`, or `reasoning_effort="none"`) puts an empty
  `<think>\\n\\n</think>\\n\\n` after the generation prompt, as Qwen3 does, so the answer is content.
"""

from __future__ import annotations

# Every piece of output is a Jinja string expression ({{- '...' }}) and every tag trims the text
# around it, so the result does not depend on Jinja's trim_blocks/lstrip_blocks (transformers sets
# them, other renderers may not). Inside the Jinja strings '\n' is Jinja's own escape.
CHAT_TEMPLATE = (
    "{%- set thinking_off = (enable_thinking is defined and enable_thinking is false)"
    " or (reasoning_effort is defined and reasoning_effort == 'none') -%}"
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    # The system turn: the caller's system message, then the tools.
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- text(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set reasoning = message.reasoning_content or message.reasoning or '' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if reasoning -%}{{- '<think>\\n' + (reasoning | trim) + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- text(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{%- if not loop.first or message.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' -}}"
    "{%- if function.arguments is string -%}{{- function.arguments -}}"
    "{%- else -%}{{- function.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if thinking_off -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
