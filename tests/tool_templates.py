"""Chat templates with tool support, written for the tests in the style of two families.

``QWEN25_STYLE``: ChatML; tools listed in the system turn inside ``<tools>``, calls written as
``<tool_call>{json}</tool_call>``, results as ``<tool_response>`` in a user turn (Hermes).
``LLAMA31_STYLE``: Llama 3.1 headers; tools as indented JSON in the first user turn, calls as
``{"name": ..., "parameters": ...}``, results in an ``ipython`` turn.
"""

QWEN25_STYLE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each call return <tool_call>\\n"
    '{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}{% if m['content'] %}{{ '\\n' + m['content'] }}{% endif %}"
    "{% for call in m['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA31_STYLE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{% if tools %}{{ 'Environment: ipython\\n' }}{% endif %}"
    "{{ system }}{{ '<|eot_id|>' }}"
    "{% set ns = namespace(first=true) %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' and ns.first and tools %}{% set ns.first = false %}"
    "{{ '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{ 'Given the following functions, reply with a JSON function call "
    '{"name": function name, "parameters": arguments}.\\n\\n\' }}'
    "{% for tool in tools %}{{ tool | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}"
    "{{ m['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    "{% set call = m['tool_calls'][0]['function'] %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{ '{\"name\": \"' + call['name'] + '\", \"parameters\": ' }}"
    "{{ call['arguments'] | tojson }}{{ '}<|eot_id|>' }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% else %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
