"""The llava-1.5 chat format as a Jinja template for the built checkpoints.

Renders ``SYSTEM USER: <image>\\nquestion ASSISTANT: answer</s>USER: ... ASSISTANT:``.
Content may be a plain string or an OpenAI-style list of parts; image parts
(``image``, ``image_url``, ``input_image``) become ``<image>\\n`` where they stand,
consecutive text parts are joined with a space. ``<s>`` is not in the template:
the tokenizer adds it, as llava-hf's does.
"""

LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}"
    "{%- set parts = message['content'] -%}"
    "{%- endif -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'] | upper }}: {% endif -%}"
    "{%- for part in parts -%}"
    "{%- if part['type'] in ['image', 'image_url', 'input_image'] -%}{{ '<image>\n' }}"
    "{%- elif part['type'] == 'text' -%}"
    "{%- if not loop.first and loop.previtem['type'] == 'text' %} {% endif -%}"
    "{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '</s>' }}{%- else %} {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)
