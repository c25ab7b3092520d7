"""Chat templates modelled on each family's real one (shortened: the same special tokens, the
same tool prompt and call format; transformers ships none offline), with the special tokens
of the family's vocabulary: what ``tool_parser_choice`` reads to pick a parser."""

from __future__ import annotations

# Qwen2.5-Instruct: ChatML, tools listed in <tools></tools>, calls in <tool_call> blocks.
QWEN25 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
        "query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": "
        "<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>'
            '<|im_end|>\\n' }}
    {%- elif not (message.role == 'system' and tools) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
QWEN_VOCAB = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# Qwen3: Qwen2.5's tool format, plus its <think> blocks.
QWEN3 = QWEN25.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
QWEN3_VOCAB = [*QWEN_VOCAB, "<think>", "</think>"]

# Llama 3.1 / 3.2 / 3.3 Instruct: header tokens, JSON calls with "parameters".
LLAMA3 = """\
{{- bos_token }}
{%- if tools is not none %}{%- set tools_in_user_message = true %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'user' and tools is not none and loop.first %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
        {{- "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\\n\\n" }}
        {{- 'Respond in the format {"name": function name, "parameters": dictionary of '
            'argument name and its value}. Do not use variables.\\n\\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments + '}' }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content
            + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_VOCAB = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

# Mistral 7B Instruct v0.3 (and Mixtral, Nemo): [AVAILABLE_TOOLS] and [TOOL_CALLS].
MISTRAL_V03 = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools is not none and loop.last %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}, {% endif %}
            {%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message.content + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tc in message.tool_calls %}
            {{- '{"name": "' + tc.function.name + '", "arguments": ' + tc.function.arguments
                + ', "id": "' + tc.id + '"}' }}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content + ', "call_id": "'
            + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- elif message.role == 'assistant' %}
        {{- " " + message.content + eos_token }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_V03_VOCAB = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

# Mistral 7B Instruct v0.1 / v0.2: [INST] only, no tools.
MISTRAL_V01 = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '[INST] ' + message.content + ' [/INST]' }}
    {%- else %}{{- message.content + eos_token }}{%- endif %}
{%- endfor %}
"""
MISTRAL_V01_VOCAB = ["<s>", "</s>", "[INST]", "[/INST]"]

# Gemma 2 / Gemma 3 (text): turns of "user" and "model", no tool format.
GEMMA = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}{{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""
GEMMA_VOCAB = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]

# Phi-3 / Phi-3.5-mini-instruct: <|user|> ... <|end|>, no tools.
PHI35 = """\
{% for message in messages %}
{%- if message['role'] == 'system' and message['content'] -%}
{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}
{%- elif message['role'] == 'user' -%}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}
{%- elif message['role'] == 'assistant' -%}
{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}
{%- endif -%}
{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}
{%- else %}{{ eos_token }}{% endif %}
"""
PHI_VOCAB = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Phi-4-mini-instruct: tools as a JSON string inside a system message's own ``tools`` field,
# between <|tool|> and <|/tool|>; never a request's ``tools``, so pagedserve renders those with
# its PHI4_MINI_TOOLS (calls as functools[...], read by phi4_mini_json, as vLLM's template).
PHI4_MINI = """\
{% for message in messages %}
{%- if message['role'] == 'system' and 'tools' in message and message['tools'] is not none -%}
{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools']
   + '<|/tool|>' + '<|end|>' }}
{%- else -%}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{%- endif -%}
{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}
"""
PHI4_VOCAB = [*PHI_VOCAB, "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>"]

# vLLM's answer for Gemma 3 tools (examples/tool_chat_template_gemma3_pythonic.jinja, with
# --tool-call-parser pythonic): Gemma's turns, the tools in the first user turn with a request
# for a Python list of calls, calls written [name(key=value, ...)], results as user turns.
GEMMA3_PYTHONIC = """\
{{ bos_token }}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system'
    else '' -%}
{%- set loop_messages = messages[1:] if messages[0]['role'] == 'system' else messages -%}
{%- for message in loop_messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}
    {{ '<start_of_turn>' + role + '\\n' }}
    {%- if loop.first -%}
        {{ first_user_prefix }}
        {%- if tools is defined and tools is not none -%}
            {{- 'To call functions, answer with a python list of the calls only: '
                '[func_name1(param1=value1, param2=value2), func_name2(param=value)]\\n'
                'The functions, as JSON:\\n' + (tools | tojson) + '\\n\\n' -}}
        {%- endif -%}
    {%- endif -%}
    {%- if message.tool_calls is defined and message.tool_calls -%}
        {{- '[' -}}
        {%- for call in message.tool_calls -%}
            {{- call.function.name + '(' -}}
            {%- if call.function.arguments is mapping -%}
                {%- for key, value in call.function.arguments.items() -%}
                    {{- key + '=' + (value | tojson) -}}{%- if not loop.last %}, {% endif -%}
                {%- endfor -%}
            {%- endif -%}
            {{- ')' -}}{%- if not loop.last %}, {% endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- endif -%}
    {%- if message['role'] == 'tool' -%}
        {{ '<tool_response>\\n' + message['content'] + '</tool_response>' }}
    {%- else -%}{{ (message['content'] or '') | trim }}{%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

# Hermes 2 Pro on Llama 3: a Llama 3 vocabulary, a ChatML template writing <tool_call>.
HERMES_LLAMA3 = QWEN25
HERMES_LLAMA3_VOCAB = [*LLAMA3_VOCAB, "<|im_start|>", "<|im_end|>", "<tool_call>"]

# SmolLM2-Instruct: ChatML that ignores tools (pagedserve renders tools with HERMES_CHATML).
SMOLLM2 = """\
{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM<|im_end|>\\n' }}{% endif %}\
{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""
SMOLLM2_VOCAB = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# family -> (template, the vocabulary's special tokens, the parser chosen, what the template
# writes for a call or None when it renders no tools).
FAMILIES = {
    "qwen2.5": (QWEN25, QWEN_VOCAB, "hermes", "<tool_call>"),
    "qwen3": (QWEN3, QWEN3_VOCAB, "hermes", "<tool_call>"),
    "llama3.x": (LLAMA3, LLAMA3_VOCAB, "llama3_json", '"parameters": '),
    "mistral-v0.3": (MISTRAL_V03, MISTRAL_V03_VOCAB, "mistral", "[TOOL_CALLS] ["),
    "hermes-2-pro-llama3": (HERMES_LLAMA3, HERMES_LLAMA3_VOCAB, "hermes", "<tool_call>"),
    "smollm2": (SMOLLM2, SMOLLM2_VOCAB, "hermes", "<tool_call>"),
    "mistral-v0.1": (MISTRAL_V01, MISTRAL_V01_VOCAB, None, None),
    "gemma2/gemma3": (GEMMA, GEMMA_VOCAB, None, None),
    # pythonic by the flag only, as in vLLM: the template names no marker
    "gemma3-pythonic": (GEMMA3_PYTHONIC, GEMMA_VOCAB, None, "[get_weather("),
    "phi3.5": (PHI35, PHI_VOCAB, None, None),
    "phi4-mini": (PHI4_MINI, PHI4_VOCAB, "phi4_mini_json", "functools[{"),
}
