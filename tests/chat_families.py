"""Chat-template fixtures for today's reasoning and tool-calling LLM families.

Per family: a chat template written from the family's documented rendering facts (where the
reasoning comes from, what history loses, generation prompts, tool-call and tool-result formats,
end tokens, where rendering is not prefix-stable), a small byte-level BPE tokenizer built offline
around it (``build_tokenizer``), and 36 conversations of the kinds users bring
(``conversation_set``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """One LLM family: its chat template and the tokenizer facts a model directory carries."""

    name: str
    template: str  # the Jinja text, rendered by transformers' apply_chat_template
    special_tokens: list[str]  # every special/added token of the template (one id each)
    bos_token: str | None
    eos_token: str  # the tokenizer's eos
    stop_tokens: list[str]  # generation_config.json's eos_token_id: what ends a generation
    pad_token: str
    reasoning: bool  # whether the family has reasoning at all
    serving_kwargs: dict  # chat-template kwargs the family is usually served with
    reasoning_field: str | None = None  # the message field the template reads reasoning from
    tool_arguments: str = "any"  # the tool-call arguments the template takes: any|string|mapping


# ------------------------------------------------------------------------------------------------
# Shared pieces

# A JSON-schema tool list rendered as a TypeScript-style namespace (gpt-oss, Kimi K2.5).
_TS_MACROS = r"""
{%- macro ts_type(p) -%}
{%- if p is not mapping -%}
{{- 'any' -}}
{%- elif p.enum is defined -%}
{{- p.enum | map('tojson') | join(' | ') -}}
{%- elif p.type == 'string' -%}
{{- 'string' -}}
{%- elif p.type == 'number' or p.type == 'integer' -%}
{{- 'number' -}}
{%- elif p.type == 'boolean' -%}
{{- 'boolean' -}}
{%- elif p.type == 'array' -%}
{{- (ts_type(p['items']) if p['items'] is defined else 'any') + '[]' -}}
{%- elif p.type == 'object' -%}
{{- 'object' -}}
{%- else -%}
{{- 'any' -}}
{%- endif -%}
{%- endmacro -%}
{%- macro ts_namespace(tool_list) -%}
{{- 'namespace functions {\n\n' -}}
{%- for tool in tool_list -%}
{%- set f = tool.function if tool.function is defined else tool -%}
{%- if f.description -%}
{{- '// ' + f.description + '\n' -}}
{%- endif -%}
{%- set params = f.parameters if f.parameters is mapping else {} -%}
{%- set props = params.properties if params.properties is mapping else {} -%}
{%- set required = params.required if params.required is defined else [] -%}
{%- if props -%}
{{- 'type ' + f.name + ' = (_: {\n' -}}
{%- for pname, p in props.items() -%}
{%- if p is mapping and p.description is defined -%}
{{- '// ' + p.description + '\n' -}}
{%- endif -%}
{{- pname + ('' if pname in required else '?') + ': ' + ts_type(p) + ',\n' -}}
{%- endfor -%}
{{- '}) => any;\n\n' -}}
{%- else -%}
{{- 'type ' + f.name + ' = () => any;\n\n' -}}
{%- endif -%}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endmacro -%}
"""

# ------------------------------------------------------------------------------------------------
# Qwen3 (hybrid thinking)

QWEN3_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- (messages[0].content if messages[0].content is string else '') + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nThese functions may be called. Their signatures, one JSON object a line, are inside <tools></tools>:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nTo call a function, reply with a JSON object holding its name and its arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + (messages[0].content if messages[0].content is string else '') + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for m in messages %}
{%- if m.role == 'user' and m.content is string and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + text + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set think = '' %}
{%- if m.reasoning_content is string %}
{%- set think = m.reasoning_content %}
{%- elif '</think>' in text %}
{%- set think = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set text = text.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or think) %}
{{- '<|im_start|>assistant\n<think>\n' + think.strip('\n') + '\n</think>\n\n' + text.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>assistant\n' + text }}
{%- endif %}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{%- if text or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + text + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""

# ------------------------------------------------------------------------------------------------
# Kimi K2-Thinking and K2.5: one body, two tool declarations and two generation prompts

_KIMI_BODY = r"""
{%- if messages[0].role != 'system' %}
{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}
{%- endif %}
{%- set ns = namespace(split=-1) %}
{%- for m in messages %}
{%- if m.role == 'assistant' and not m.tool_calls %}
{%- set ns.split = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- set who = m.name if m.name else m.role %}
{%- if m.role == 'assistant' %}
{{- '<|im_assistant|>' + who + '<|im_middle|>' }}
{%- if loop.index0 > ns.split %}
{{- '<think>' + (m.reasoning_content if m.reasoning_content is string else '') + '</think>' }}
{%- else %}
{{- '<think></think>' }}
{%- endif %}
{{- text }}
{%- if m.tool_calls %}
{{- '<|tool_calls_section_begin|>' }}
{%- for tc in m.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '<|tool_call_begin|>' }}
{{- tc.id }}
{{- '<|tool_call_argument_begin|>' + (f.arguments if f.arguments is string else f.arguments | tojson) + '<|tool_call_end|>' }}
{%- endfor %}
{{- '<|tool_calls_section_end|>' }}
{%- endif %}
{{- '<|im_end|>' }}
{%- elif m.role == 'tool' %}
{{- '<|im_system|>' + (m.name if m.name else 'tool') + '<|im_middle|>## Return of ' + (m.tool_call_id if m.tool_call_id else '') + '\n' + text + '<|im_end|>' }}
{%- elif m.role == 'user' %}
{{- '<|im_user|>' + who + '<|im_middle|>' + text + '<|im_end|>' }}
{%- else %}
{{- '<|im_system|>' + who + '<|im_middle|>' + text + '<|im_end|>' }}
{%- endif %}
{%- endfor %}
"""

KIMI_K2_THINKING_TEMPLATE = (
    r"""
{%- if tools %}
{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}
{%- endif %}
"""
    + _KIMI_BODY
    + r"""
{%- if add_generation_prompt %}
{{- '<|im_assistant|>assistant<|im_middle|>' }}
{%- endif %}
"""
)

KIMI_K25_TEMPLATE = (
    _TS_MACROS
    + r"""
{%- if tools %}
{{- '<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\n\n' + ts_namespace(tools) + '<|im_end|>' }}
{%- endif %}
"""
    + _KIMI_BODY
    + r"""
{%- if add_generation_prompt %}
{{- '<|im_assistant|>assistant<|im_middle|>' }}
{%- if thinking is defined and thinking is false %}
{{- '<think></think>' }}
{%- else %}
{{- '<think>' }}
{%- endif %}
{%- endif %}
"""
)

# ------------------------------------------------------------------------------------------------
# DeepSeek R1 and V3.1

_DEEPSEEK_SYSTEM = r"""
{%- set sys = namespace(text='') %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- if sys.text %}
{%- set sys.text = sys.text + '\n\n' %}
{%- endif %}
{%- set sys.text = sys.text + m.content %}
{%- endif %}
{%- endfor %}
{{- bos_token + sys.text }}
"""

DEEPSEEK_R1_TEMPLATE = _DEEPSEEK_SYSTEM + r"""
{%- set ns = namespace(is_tool=false) %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- if m.role == 'user' %}
{%- if ns.is_tool %}
{{- '<｜tool▁outputs▁end｜>' }}
{%- set ns.is_tool = false %}
{%- endif %}
{{- '<｜User｜>' + text }}
{%- elif m.role == 'assistant' %}
{%- if '</think>' in text %}
{%- set text = text.split('</think>')[-1] %}
{%- endif %}
{%- if ns.is_tool %}
{{- '<｜tool▁outputs▁end｜>' }}
{%- set ns.is_tool = false %}
{%- else %}
{{- '<｜Assistant｜>' }}
{%- endif %}
{{- text }}
{%- if m.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for tc in m.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '<｜tool▁call▁begin｜>' + (tc.type if tc.type is defined else 'function') + '<｜tool▁sep｜>' + f.name + '\n```json\n' + f.arguments + '\n```<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- elif m.role == 'tool' %}
{%- if not ns.is_tool %}
{{- '<｜tool▁outputs▁begin｜>' }}
{%- endif %}
{%- set ns.is_tool = true %}
{{- '<｜tool▁output▁begin｜>' + text + '<｜tool▁output▁end｜>' }}
{%- endif %}
{%- endfor %}
{%- if ns.is_tool %}
{{- '<｜tool▁outputs▁end｜>' }}
{%- endif %}
{%- if add_generation_prompt and not ns.is_tool %}
{{- '<｜Assistant｜><think>\n' }}
{%- endif %}
"""

DEEPSEEK_V31_TEMPLATE = (
    r"""
{%- set think_mode = thinking if thinking is defined else (enable_thinking if enable_thinking is defined else false) %}
"""
    + _DEEPSEEK_SYSTEM
    + r"""
{%- if tools %}
{%- if sys.text %}
{{- '\n\n' }}
{%- endif %}
{{- '## Tools\n\nThe tools below may be called. Write a call as the tool name, then its arguments as one JSON object.\n' }}
{%- for tool in tools %}
{%- set f = tool.function if tool.function is defined else tool %}
{{- '\n### ' + f.name + '\nDescription: ' + (f.description if f.description else '') + '\nParameters: ' + (f.parameters | tojson) + '\n' }}
{%- endfor %}
{%- endif %}
{%- set ns = namespace(is_last_user=false, is_tool=false) %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- if m.role == 'user' %}
{{- '<｜User｜>' + text }}
{%- set ns.is_last_user = true %}
{%- set ns.is_tool = false %}
{%- elif m.role == 'assistant' %}
{%- if '</think>' in text %}
{%- set text = text.split('</think>', 1)[1] %}
{%- endif %}
{%- if ns.is_last_user %}
{%- if m.prefix and think_mode %}
{{- '<｜Assistant｜><think>' }}
{%- else %}
{{- '<｜Assistant｜></think>' }}
{%- endif %}
{%- endif %}
{{- text }}
{%- if m.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for tc in m.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '<｜tool▁call▁begin｜>' + f.name + '<｜tool▁sep｜>' + f.arguments + '<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{%- if not m.prefix %}
{{- '<｜end▁of▁sentence｜>' }}
{%- endif %}
{%- set ns.is_last_user = false %}
{%- set ns.is_tool = false %}
{%- elif m.role == 'tool' %}
{{- '<｜tool▁output▁begin｜>' + text + '<｜tool▁output▁end｜>' }}
{%- set ns.is_last_user = false %}
{%- set ns.is_tool = true %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool %}
{{- '<｜Assistant｜><think>' if think_mode else '<｜Assistant｜></think>' }}
{%- endif %}
"""
)

# ------------------------------------------------------------------------------------------------
# gpt-oss (harmony)

GPT_OSS_TEMPLATE = _TS_MACROS + r"""
{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}
{%- set identity = model_identity if model_identity is defined else 'You are a helpful assistant.' %}
{{- '<|start|>system<|message|>' + identity + '\n\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: ' + effort + '\n\n# Valid channels: analysis, commentary, final. Every message names its channel.' }}
{%- if builtin_tools is defined and builtin_tools %}
{{- '\n\nBuilt-in tools: ' + (builtin_tools | join(', ')) + '.' }}
{%- endif %}
{%- if tools %}
{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- set has_sys = messages | length > 0 and messages[0].role in ['system', 'developer'] %}
{%- if has_sys or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if has_sys %}
{{- '# Instructions\n\n' + messages[0].content }}
{%- if tools %}
{{- '\n\n' }}
{%- endif %}
{%- endif %}
{%- if tools %}
{{- '# Tools\n\n## functions\n\n' + ts_namespace(tools) }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- set ns = namespace(last_call=none, final_later=false) %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- if loop.first and has_sys %}
{%- elif m.role == 'assistant' %}
{%- set think = m.thinking if m.thinking is string else '' %}
{%- for part in [text, think] %}
{%- if '<|channel|>analysis<|message|>' in part or '<|channel|>final<|message|>' in part %}
{{- raise_exception('Channel markers belong to the template, not to message content or thinking.') }}
{%- endif %}
{%- endfor %}
{%- if m.tool_calls %}
{%- if text and think %}
{{- raise_exception('A tool-call message carries content or thinking, not both.') }}
{%- endif %}
{%- set ns.final_later = false %}
{%- for later in messages[loop.index0 + 1:] %}
{%- if later.role == 'assistant' and not later.tool_calls %}
{%- set ns.final_later = true %}
{%- endif %}
{%- endfor %}
{%- if (think or text) and not ns.final_later %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + (think or text) + '<|end|>' }}
{%- endif %}
{%- set tc = m.tool_calls[0] %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' + (f.arguments | tojson) + '<|call|>' }}
{%- set ns.last_call = f.name %}
{%- elif loop.last and not add_generation_prompt %}
{%- if think %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + think + '<|end|>' }}
{%- endif %}
{{- '<|start|>assistant<|channel|>final<|message|>' + text + '<|return|>' }}
{%- else %}
{{- '<|start|>assistant<|channel|>final<|message|>' + text + '<|end|>' }}
{%- endif %}
{%- elif m.role == 'tool' %}
{%- if ns.last_call is none %}
{{- raise_exception('A tool message needs a tool call before it.') }}
{%- endif %}
{{- '<|start|>functions.' + ns.last_call + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson) + '<|end|>' }}
{%- else %}
{{- '<|start|>' + m.role + '<|message|>' + text + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start|>assistant' }}
{%- endif %}
"""

# ------------------------------------------------------------------------------------------------
# Llama 3.1 / 3.3

_LLAMA_TOOL_INTRO = (
    "Answer the request below with a call to one of these functions. Reply with one JSON object "
    'of the form {\\"name\\": function name, \\"parameters\\": object of argument names and values}, '
    "and nothing else.\\n\\n"
)

LLAMA31_TEMPLATE = r"""
{{- bos_token }}
{%- set date = date_string if date_string is defined else '26 Jul 2024' %}
{%- set tools_in_user = tools_in_user_message if tools_in_user_message is defined else true %}
{%- set tool_intro = "TOOL_INTRO" %}
{%- if messages[0].role == 'system' %}
{%- set sys_text = messages[0].content | trim %}
{%- set rest = messages[1:] %}
{%- else %}
{%- set sys_text = '' %}
{%- set rest = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if builtin_tools is defined or tools %}
{{- 'Environment: ipython\n' }}
{%- endif %}
{%- if builtin_tools is defined %}
{{- 'Tools: ' + (builtin_tools | reject('equalto', 'code_interpreter') | join(', ')) + '\n\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date + '\n\n' }}
{%- if tools and not tools_in_user %}
{{- tool_intro }}
{%- for tool in tools %}
{{- (tool | tojson(indent=4)) + '\n\n' }}
{%- endfor %}
{%- endif %}
{{- sys_text + '<|eot_id|>' }}
{%- if tools and tools_in_user %}
{%- if rest | length == 0 %}
{{- raise_exception('The tools go into the first user message, and there is none.') }}
{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' + tool_intro }}
{%- for tool in tools %}
{{- (tool | tojson(indent=4)) + '\n\n' }}
{%- endfor %}
{{- (rest[0].content | trim) + '<|eot_id|>' }}
{%- set rest = rest[1:] %}
{%- endif %}
{%- for m in rest %}
{%- if 'tool_calls' in m %}
{%- if m.tool_calls | length != 1 %}
{{- raise_exception('This template renders exactly one tool call per message.') }}
{%- endif %}
{%- set tc = m.tool_calls[0] %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- if builtin_tools is defined and f.name in builtin_tools %}
{{- '<|python_tag|>' + f.name + '.call(' }}
{%- for k, v in f.arguments.items() %}
{{- k + '="' + (v | string) + '"' }}
{%- if not loop.last %}
{{- ', ' }}
{%- endif %}
{%- endfor %}
{{- ')' }}
{%- else %}
{{- '{"name": "' + f.name + '", "parameters": ' + (f.arguments | tojson) + '}' }}
{%- endif %}
{{- '<|eom_id|>' if builtin_tools is defined else '<|eot_id|>' }}
{%- elif m.role == 'tool' or m.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
{%- if m.content is mapping or m.content is iterable %}
{{- m.content | tojson }}
{%- else %}
{{- m.content | string }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
""".replace("TOOL_INTRO", _LLAMA_TOOL_INTRO)

# ------------------------------------------------------------------------------------------------
# GLM-4.5 / 4.6

GLM45_TEMPLATE = r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\n# Tools\n\nThe functions below may be called to help with the request. Their signatures are inside <tools></tools>:\n<tools>\n' }}
{%- for tool in tools %}
{{- (tool | tojson) + '\n' }}
{%- endfor %}
{{- '</tools>\n\nWrite each call as:\n<tool_call>{function name}\n<arg_key>{argument name}</arg_key>\n<arg_value>{argument value}</arg_value>\n...\n</tool_call>' }}
{%- endif %}
{%- set nothink = enable_thinking is defined and not enable_thinking %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- if m.role == 'user' %}
{{- '<|user|>\n' + text }}
{%- if nothink and not text.endswith('/nothink') %}
{{- '/nothink' }}
{%- endif %}
{%- elif m.role == 'system' %}
{{- '<|system|>\n' + text }}
{%- elif m.role == 'assistant' %}
{%- set think = '' %}
{%- if m.reasoning_content is string %}
{%- set think = m.reasoning_content %}
{%- elif '</think>' in text %}
{%- set think = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set text = text.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|assistant|>' }}
{%- if loop.index0 > ns.last_user and think %}
{{- '\n<think>' + think.strip() + '</think>' }}
{%- else %}
{{- '\n<think></think>' }}
{%- endif %}
{%- if text.strip() %}
{{- '\n' + text.strip() }}
{%- endif %}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '\n<tool_call>' + f.name + '\n' }}
{%- for k, v in f.arguments.items() %}
{{- '<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\n' }}
{%- endfor %}
{{- '</tool_call>' }}
{%- endfor %}
{%- endif %}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}
{{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' + text + '\n</tool_response>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>' }}
{%- if nothink %}
{{- '\n<think></think>' }}
{%- endif %}
{%- endif %}
"""

# ------------------------------------------------------------------------------------------------
# Mistral Nemo-Instruct

MISTRAL_TEMPLATE = r"""
{%- if messages | length > 0 and messages[0].role == 'system' %}
{%- set system_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(turn=0, last_user=-1) %}
{%- for m in loop_messages %}
{%- if m.role == 'user' %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- if m.role != 'tool' and not m.tool_calls %}
{%- if (m.role == 'user') != (ns.turn % 2 == 0) %}
{{- raise_exception('After an optional system message, the roles must alternate user, assistant, user, assistant, ...') }}
{%- endif %}
{%- set ns.turn = ns.turn + 1 %}
{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for m in loop_messages %}
{%- if m.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if loop.last and system_message is defined %}
{{- '[INST]' + system_message + '\n\n' + m.content + '[/INST]' }}
{%- else %}
{{- '[INST]' + m.content + '[/INST]' }}
{%- endif %}
{%- elif m.role == 'assistant' and m.tool_calls %}
{{- '[TOOL_CALLS][' }}
{%- for tc in m.tool_calls %}
{%- if tc.id is not string or tc.id | length != 9 %}
{{- raise_exception('A tool call id must be a string of exactly 9 characters.') }}
{%- endif %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- (f | tojson)[:-1] + ', "id": "' + tc.id + '"}' }}
{%- if not loop.last %}
{{- ', ' }}
{%- endif %}
{%- endfor %}
{{- ']</s>' }}
{%- elif m.role == 'assistant' %}
{{- m.content + '</s>' }}
{%- elif m.role == 'tool' %}
{{- '[TOOL_RESULTS]{"content": ' + (m.content | string) + ', "call_id": "' + (m.tool_call_id | string) + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('Only user, assistant and tool messages, after an optional system message, are supported.') }}
{%- endif %}
{%- endfor %}
"""

# ------------------------------------------------------------------------------------------------
# The families

_DS_BOS, _DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DS_COMMON = [_DS_BOS, _DS_EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
_DS_CALLS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
_KIMI_SPECIALS = [
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            name="qwen3",
            template=QWEN3_TEMPLATE,
            special_tokens=[
                "<|endoftext|>",
                "<|im_start|>",
                "<|im_end|>",
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                "<tool_response>",
                "</tool_response>",
            ],
            bos_token=None,
            eos_token="<|im_end|>",
            stop_tokens=["<|im_end|>", "<|endoftext|>"],
            pad_token="<|endoftext|>",
            reasoning=True,
            serving_kwargs={},
            reasoning_field="reasoning_content",
        ),
        Family(
            name="kimi_k2_thinking",
            template=KIMI_K2_THINKING_TEMPLATE,
            special_tokens=_KIMI_SPECIALS,
            bos_token="[BOS]",
            eos_token="[EOS]",
            stop_tokens=["<|im_end|>"],
            pad_token="[PAD]",
            reasoning=True,
            serving_kwargs={},
            reasoning_field="reasoning_content",
        ),
        Family(
            name="kimi_k25",
            template=KIMI_K25_TEMPLATE,
            special_tokens=_KIMI_SPECIALS,
            bos_token="[BOS]",
            eos_token="[EOS]",
            stop_tokens=["<|im_end|>"],
            pad_token="[PAD]",
            reasoning=True,
            serving_kwargs={},
            reasoning_field="reasoning_content",
        ),
        Family(
            name="deepseek_r1",
            template=DEEPSEEK_R1_TEMPLATE,
            special_tokens=_DS_COMMON
            + _DS_CALLS
            + ["<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"],
            bos_token=_DS_BOS,
            eos_token=_DS_EOS,
            stop_tokens=[_DS_EOS],
            pad_token=_DS_EOS,
            reasoning=True,
            serving_kwargs={},
            reasoning_field=None,
            tool_arguments="string",
        ),
        Family(
            name="deepseek_v31",
            template=DEEPSEEK_V31_TEMPLATE,
            special_tokens=_DS_COMMON + _DS_CALLS,
            bos_token=_DS_BOS,
            eos_token=_DS_EOS,
            stop_tokens=[_DS_EOS],
            pad_token=_DS_EOS,
            reasoning=True,
            serving_kwargs={"thinking": True},  # served thinking: the data has reasoning
            reasoning_field=None,
            tool_arguments="string",
        ),
        Family(
            name="gpt_oss",
            template=GPT_OSS_TEMPLATE,
            special_tokens=[
                "<|start|>",
                "<|end|>",
                "<|message|>",
                "<|channel|>",
                "<|constrain|>",
                "<|return|>",
                "<|call|>",
            ],
            bos_token="<|startoftext|>",
            eos_token="<|return|>",
            stop_tokens=["<|return|>", "<|call|>", "<|endoftext|>"],
            pad_token="<|endoftext|>",
            reasoning=True,
            serving_kwargs={"reasoning_effort": "medium"},
            reasoning_field="thinking",
        ),
        Family(
            name="llama31",
            template=LLAMA31_TEMPLATE,
            special_tokens=[
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ],
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            stop_tokens=["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
            pad_token="<|finetune_right_pad_id|>",
            reasoning=False,
            serving_kwargs={},
        ),
        Family(
            name="glm45",
            template=GLM45_TEMPLATE,
            special_tokens=[
                "[gMASK]",
                "<sop>",
                "<|system|>",
                "<|user|>",
                "<|assistant|>",
                "<|observation|>",
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                "<arg_key>",
                "</arg_key>",
                "<arg_value>",
                "</arg_value>",
                "<tool_response>",
                "</tool_response>",
            ],
            bos_token=None,
            eos_token="<|endoftext|>",
            stop_tokens=["<|user|>", "<|observation|>", "<|endoftext|>"],
            pad_token="<|endoftext|>",
            reasoning=True,
            serving_kwargs={},
            reasoning_field="reasoning_content",
            tool_arguments="mapping",
        ),
        Family(
            name="mistral",
            template=MISTRAL_TEMPLATE,
            special_tokens=[
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_CALLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ],
            bos_token="<s>",
            eos_token="</s>",
            stop_tokens=["</s>"],
            pad_token="<pad>",
            reasoning=False,
            serving_kwargs={},
        ),
    ]
}


def _family(family: Family | str) -> Family:
    return family if isinstance(family, Family) else FAMILIES[family]


def all_tokens(family: Family | str) -> list[str]:
    """The family's special tokens, then bos, eos, pad and stop tokens not among them."""
    fam = _family(family)
    extra = [fam.bos_token, fam.eos_token, fam.pad_token, *fam.stop_tokens]
    out: list[str] = []
    for tok in [*fam.special_tokens, *extra]:
        if tok is not None and tok not in out:
            out.append(tok)
    return out


# ------------------------------------------------------------------------------------------------
# The tokenizer

_PUNCTUATION = (
    '{"name": "x", "arguments": {"a": 1, "b": [2, 3], "c": true, "d": null}} '
    "<tag></tag> [x] (y) a=b; c: d, e. f? g! 'h' `i` ```json\n{}\n``` // # ## ### -> => | & * _ ~ + \\n"
)


# Words, numbers, punctuation runs, and newline runs kept whole (as today's vocabularies split).
_PRETOKENIZE = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _corpus(fam: Family) -> list[str]:
    """The rows as JSON and as plain text, the template with its newline escapes made real (so
    that runs like "\\n\\n" merge into one token, as in real vocabularies), and punctuation."""
    rows = conversation_set(fam)
    texts = [json.dumps(row, ensure_ascii=False) for row in rows]
    for row in rows:
        for m in row.get("messages", row.get("conversations", [])):
            texts.append(str(m.get("content", m.get("value", ""))))
    return texts + [fam.template, fam.template.replace("\\n", "\n"), _PUNCTUATION]


def build_tokenizer(family: Family | str, out_dir: Path) -> Path:
    """A small byte-level BPE tokenizer with the family's chat template, saved as a HF directory
    (tokenizer_config.json holds the template) with a generation_config.json listing the stop
    tokens' ids as eos_token_id. Returns out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = _family(family)
    tokens = all_tokens(fam)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(fam) * 3, trainer)
    named = {fam.bos_token, fam.eos_token, fam.pad_token}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos_token,
        eos_token=fam.eos_token,
        pad_token=fam.pad_token,
        additional_special_tokens=[t for t in tokens if t not in named],
    )
    fast.chat_template = fam.template
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir, save_jinja_files=False)
    generation_config = {
        "eos_token_id": [tok.token_to_id(t) for t in fam.stop_tokens],
        "pad_token_id": tok.token_to_id(fam.pad_token),
    }
    if fam.bos_token is not None:
        generation_config["bos_token_id"] = tok.token_to_id(fam.bos_token)
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out_dir


# ------------------------------------------------------------------------------------------------
# The conversations

_TOPICS = [
    "rivers",
    "volcanoes",
    "bread",
    "chess",
    "comets",
    "bridges",
    "tea",
    "owls",
    "glaciers",
    "violins",
    "deserts",
    "lighthouses",
]
_REASONING_FIELDS = ["reasoning_content", "reasoning", "thinking"]
_TOOL_KINDS = ["get_weather", "search_books", "convert_units", "lookup_stock"]


def _tool_spec(kind: str, name: str, i: int) -> tuple[dict, dict, str]:
    """(the tool's OpenAI schema, the call's arguments, the tool's result text) for row i."""
    if kind == "get_weather":
        desc, props = f"Weather now in a city, service {i}", {
            "city": {"type": "string", "description": "the city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }
        args, result = {"city": f"city {i}", "unit": "celsius"}, f"sunny and mild in city {i}"
    elif kind == "search_books":
        desc, props = f"Search a library catalogue, shelf {i}", {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "how many books at most"},
        }
        args, result = {"query": f"books about topic {i}", "limit": 3}, f"three books on topic {i}"
    elif kind == "convert_units":
        desc, props = f"Convert a length between units, table {i}", {
            "value": {"type": "number"},
            "from_unit": {"type": "string"},
            "to_unit": {"type": "string"},
        }
        args = {"value": i, "from_unit": "miles", "to_unit": "kilometers"}
        result = f"the length is {i} miles or about {round(i * 1.609)} kilometers"
    else:
        desc, props = f"Latest price of a stock, market {i}", {
            "symbol": {"type": "string", "description": "the ticker symbol"},
        }
        args, result = {"symbol": f"SYM{i}"}, f"stock SYM{i} trades at {i} dollars"
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }
    return schema, args, f"tool result {i}: {result}"


def _call_id(fam: Family, name: str, i: int) -> str:
    if fam.name.startswith("kimi"):
        return f"functions.{name}:0"
    if fam.name == "mistral":
        return f"call{i:03d}ab"  # exactly 9 characters
    return f"call_{i}_0"


def _assistant(fam: Family, content: str, reasoning: str | None, field: str) -> dict:
    msg = {"role": "assistant", "content": content}
    if fam.reasoning and reasoning is not None:
        msg[field] = reasoning
    return msg


def _sharegpt(messages: list[dict]) -> list[dict]:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


def _plain_row(fam: Family, i: int, turns: int, inline: bool) -> dict:
    topic = _TOPICS[i % len(_TOPICS)]
    field = _REASONING_FIELDS[i % len(_REASONING_FIELDS)]
    messages: list[dict] = []
    if i % 2 == 0:
        messages.append(
            {"role": "system", "content": f"system {i}: you answer questions about {topic} briefly"}
        )
    for t in range(1, turns + 1):
        question = f"question {i} turn {t}: tell me one thing about {topic}"
        answer = f"answer {i} turn {t}: here is a plain fact about {topic}"
        thought = f"reasoning {i} turn {t}: the user asks about {topic} so I recall a fact"
        messages.append({"role": "user", "content": question})
        if fam.reasoning and inline:
            content = (
                f"<think>\n{thought}\n</think>\n\n{answer}"
                if i % 2 == 0
                else f"<think>{thought}</think>{answer}"
            )
            messages.append({"role": "assistant", "content": content})
        else:
            messages.append(_assistant(fam, answer, thought, field))
    return {"messages": messages}


def _tool_row(fam: Family, i: int) -> dict:
    j = i - 24
    kind = _TOOL_KINDS[j % len(_TOOL_KINDS)]
    name = f"{kind}_{i}"
    schema, args, result = _tool_spec(kind, name, i)
    extra = {
        "type": "function",
        "function": {
            "name": f"get_time_{i}",
            "description": f"The current time in zone {i}",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    field = _REASONING_FIELDS[j % len(_REASONING_FIELDS)]
    call_id = _call_id(fam, name, i)
    arguments = args if j % 2 == 0 else json.dumps(args)
    role = {4: "ipython", 5: "function"}.get(j % 6, "tool")
    messages: list[dict] = []
    if j % 3 == 0:
        messages.append({"role": "system", "content": f"system {i}: you use the tools when useful"})
    messages += [
        {"role": "user", "content": f"question {i} turn 1: please look this up with a tool"},
        {
            **_assistant(fam, "", f"reasoning {i} turn 1: I should call a tool first", field),
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": role, "tool_call_id": call_id, "name": name, "content": result},
        _assistant(
            fam,
            f"answer {i} turn 2: the tool gave me what you asked for",
            f"reasoning {i} turn 2: the tool returned data so I can answer",
            field,
        ),
    ]
    return {"tools": [schema, extra], "messages": messages}


def conversation_set(family: Family | str) -> list[dict]:
    """36 JSONL-ready rows for the family (each with an "id").

    Reasoning families: rows 0-11 two-turn with the reasoning in a separate field
    (reasoning_content, reasoning, thinking in rotation), rows 12-23 two-turn with the reasoning
    inline as <think>...</think>answer (rows 12, 15, 18, 21 in ShareGPT form), rows 24-35 tool-call
    chains (tools, user, assistant tool call with reasoning, tool result, final answer with
    reasoning). Families without reasoning: rows 0-11 two-turn, rows 12-23 three-turn (rows 3, 9,
    15, 21 in ShareGPT form), rows 24-35 tool-call chains, no reasoning anywhere. Tool-call
    arguments are JSON objects in even chain rows and JSON strings in odd ones; the tool result
    has role "ipython" in rows 28 and 34 and "function" in rows 29 and 35."""
    fam = _family(family)
    rows = []
    for i in range(36):
        if i < 12:
            row = _plain_row(fam, i, turns=2, inline=False)
        elif i < 24:
            row = _plain_row(fam, i, turns=2 if fam.reasoning else 3, inline=fam.reasoning)
        else:
            row = _tool_row(fam, i)
        sharegpt = (fam.reasoning and i in (12, 15, 18, 21)) or (
            not fam.reasoning and i in (3, 9, 15, 21)
        )
        if sharegpt:
            row = {"conversations": _sharegpt(row["messages"])}
        rows.append({"id": f"{fam.name}-{i:02d}", **row})
    return rows
